#!/usr/bin/env bash
# The worker side of launch/tpu_vm.sh. `tpu_vm.sh install` copies this file to every TPU VM worker
# (~/flexmarl/tpu_worker.sh) and tpu_vm.sh runs it there through `gcloud compute tpus tpu-vm ssh --worker=all`:
#
#   tpu_worker.sh install git URL EXTRAS       Python >= 3.11, a venv, pip install "flexmarl-jax[EXTRAS] @ git+URL"
#   tpu_worker.sh install tree TARBALL EXTRAS  the same from a tarball of a local tree (unpacked to ~/flexmarl/src)
#   tpu_worker.sh train [flexmarl train args]  start this worker's one `flexmarl train` process, detached; follow
#                                              its log until it ends; exit with its status
#   tpu_worker.sh logs [follow]                this worker's log so far (follow: until the run ends)
#
# Every line it prints starts with "[worker N] " (N: the TPU metadata's agent-worker-number, the index JAX's
# runtime gives this process), so that tpu_vm.sh can split the interleaved output of all workers into one
# file per worker. FLEXMARL_HOME (default ~/flexmarl) and TPU_WORKER_ID (default: the metadata) are settable
# so that tests can run this script on a machine that is not a TPU VM.
set -euo pipefail

HOME_DIR=${FLEXMARL_HOME:-$HOME/flexmarl}
VENV=$HOME_DIR/venv
LOG_DIR=$HOME_DIR/logs
METADATA_URL=http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number

worker_id() {
  if [[ -n "${TPU_WORKER_ID:-}" ]]; then
    echo "$TPU_WORKER_ID"
  else
    curl -sf -H 'Metadata-Flavor: Google' "$METADATA_URL" || hostname
  fi
}

# A Python >= 3.11 interpreter (pyproject's requires-python). TPU VM images are Ubuntu 22.04 with Python 3.10:
# install 22.04's python3.11 packages, or, where apt cannot, a standalone build through uv.
python_at_least_311() {
  local candidate
  for candidate in python3.13 python3.12 python3.11 python3; do
    if command -v "$candidate" >/dev/null &&
        "$candidate" -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      command -v "$candidate"
      return
    fi
  done
  echo "provisioning Python 3.11 (the image has $(python3 --version 2>&1 || echo 'no python3'))" >&2
  if sudo apt-get update -qq >&2 && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3.11 python3.11-venv >&2; then
    command -v python3.11
  else
    curl -LsSf https://astral.sh/uv/install.sh | sh >&2
    "$HOME/.local/bin/uv" python install 3.11 >&2
    "$HOME/.local/bin/uv" python find 3.11
  fi
}

install() {
  local mode=$1 source=$2 extras=$3 python requirement
  mkdir -p "$HOME_DIR"
  python=$(python_at_least_311)
  "$python" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  case "$mode" in
    git) requirement="flexmarl-jax[$extras] @ git+$source" ;;
    tree)
      rm -rf "$HOME_DIR/src" && mkdir -p "$HOME_DIR/src"
      tar -xzf "$source" -C "$HOME_DIR/src"
      requirement="$HOME_DIR/src[$extras]" ;;
    *) echo "install: unknown source kind '$mode' (git or tree)"; return 2 ;;
  esac
  "$VENV/bin/pip" install -q "$requirement"
  echo "installed $("$VENV/bin/pip" show flexmarl-jax | grep '^Version') with $("$VENV/bin/python" --version)"
}

run_pid() {  # the pid of this worker's run while it is alive; nothing otherwise
  local pid
  pid=$(cat "$LOG_DIR/train.pid" 2>/dev/null) || return 0
  if kill -0 "$pid" 2>/dev/null; then echo "$pid"; fi
}

train() {
  local running
  if [[ ! -x "$VENV/bin/flexmarl" ]]; then
    echo "flexmarl is not installed on this worker (no $VENV/bin/flexmarl): run tpu_vm.sh install first"
    return 1
  fi
  running=$(run_pid)
  if [[ -n "$running" ]]; then
    echo "a run is already going on this worker (pid $running); tpu_vm.sh logs follows it"
    return 1
  fi
  mkdir -p "$LOG_DIR"
  rm -f "$LOG_DIR/train.exit"
  # A local tree's configs/ is where relative --config paths point; a pip install from git reads its configs as
  # modules (--config=flexmarl_jax.configs.gsm8k_chain:tpu_v5e_32) from any directory.
  if [[ -d "$HOME_DIR/src" ]]; then cd "$HOME_DIR/src"; else cd "$HOME_DIR"; fi
  # Distributed first, so that the user's own --config.distributed.* flags (later ones win) can override it.
  # nohup + setsid: the run outlives this ssh session (a dropped connection, a closed laptop); `logs` reattaches.
  nohup setsid bash -c '"$@" >"$0/train.log" 2>&1; echo $? >"$0/train.exit"' "$LOG_DIR" \
    "$VENV/bin/flexmarl" train --config.distributed.enabled=True "$@" </dev/null >/dev/null 2>&1 &
  echo $! >"$LOG_DIR/train.pid"
  echo "started flexmarl train (pid $!), log $LOG_DIR/train.log"
  follow
}

follow() {  # prints the log until the run's process ends, then returns the run's exit status
  local pid
  pid=$(cat "$LOG_DIR/train.pid" 2>/dev/null) || { echo "no run was started on this worker"; return 1; }
  tail -n +1 -s 0.5 --pid="$pid" -F "$LOG_DIR/train.log" 2>/dev/null || true
  report_exit
}

report_exit() {
  local status
  if [[ -n "$(run_pid)" ]]; then
    echo "flexmarl train is still running"
    return 0
  fi
  status=$(cat "$LOG_DIR/train.exit" 2>/dev/null) || { echo "flexmarl train ended without an exit status"; return 1; }
  echo "flexmarl train exited with status $status"
  return "$status"
}

logs() {
  if [[ "${1:-}" == follow ]]; then
    follow
  else
    cat "$LOG_DIR/train.log" 2>/dev/null || echo "no log yet at $LOG_DIR/train.log"
    report_exit
  fi
}

main() {
  local command=${1:-}
  shift || true
  case "$command" in
    install) install "$@" ;;
    train) train "$@" ;;
    logs) logs "$@" ;;
    *) echo "usage: tpu_worker.sh install git|tree SOURCE EXTRAS | train [flexmarl train args] | logs [follow]"
       return 2 ;;
  esac
}

id=$(worker_id)
# pipefail: the pipeline's status is main's, not sed's.
main "$@" 2>&1 | sed -u "s/^/[worker $id] /"
