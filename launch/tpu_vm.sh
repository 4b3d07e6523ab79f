#!/usr/bin/env bash
# Drive Cloud TPU VMs end to end from your machine: create, install, train, logs, delete (docs/launch.md).
#
#   export TPU_NAME=flexmarl ZONE=us-west4-a ACCELERATOR=v5litepod-32
#   launch/tpu_vm.sh create            # or: launch/tpu_vm.sh queued (a queued resource, served when capacity frees)
#   launch/tpu_vm.sh install           # every worker: Python >= 3.11, a venv, flexmarl-jax (REPO_URL or this tree)
#   launch/tpu_vm.sh train --config=configs/gsm8k_chain.py:tpu_v5e_32 --workdir=gs://BUCKET/run1
#   launch/tpu_vm.sh logs              # each worker's log, into logs/$TPU_NAME/worker-N.log
#   launch/tpu_vm.sh delete
#
# Settings (environment variables):
#   TPU_NAME     the TPU VM (node) name                                          required by every subcommand
#   ZONE         its zone                                                        required by every subcommand
#   ACCELERATOR  accelerator type: v5litepod-8, v5e-8 (= v5litepod-8), v6e-8, v5p-8, v4-32, ...  create, queued
#   RUNTIME      TPU software version; unset: the one the accelerator's generation needs (runtime_for below)
#   PROJECT      Google Cloud project; unset: gcloud's configured project
#   REPO_URL     install: pip install flexmarl-jax from this git URL (may end with @REF); unset: scp this tree
#   EXTRAS       install: the package extras (default tpu: jax[tpu])
#   QUEUED_ID    queued: the queued resource's id (default TPU_NAME); delete: set it to delete that queued
#                resource (and its VM) instead of a VM made by `create`
#   LOGS_DIR     train, logs: where each worker's log is collected (default logs/TPU_NAME)
#
# Everything remote goes through `gcloud compute tpus ...`; the worker side is launch/tpu_worker.sh.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(dirname "$HERE")
WORKER_SCRIPT='~/flexmarl/tpu_worker.sh'  # expanded by the worker's shell

usage() {
  echo "usage: launch/tpu_vm.sh create|queued|install|train [flexmarl train args]|logs [follow]|delete" \
       "(settings in environment variables; docs/launch.md)"
}

die() {
  echo "tpu_vm.sh: $*" >&2
  exit 2
}

need() {  # need VAR "what it is": one line and exit 2, before any gcloud call, when VAR is unset or empty
  [[ -n "${!1:-}" ]] || die "set $1 ($2)"
}

# The TPU software version each generation's VMs need (Cloud TPU docs, "TPU software versions").
runtime_for() {
  case "$1" in
    v6e-*) echo v2-alpha-tpuv6e ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v5litepod-*) echo v2-alpha-tpuv5-lite ;;
    v2-* | v3-* | v4-*) echo tpu-ubuntu2204-base ;;
    *) return 1 ;;
  esac
}

# The TPU API calls v5e slices v5litepod-N; v5e-N is accepted here as the name people use.
accelerator_type() {
  need ACCELERATOR "the accelerator type, e.g. v5litepod-8, v6e-8 or v5litepod-32 for a pod slice"
  case "$ACCELERATOR" in
    v5e-*) echo "v5litepod-${ACCELERATOR#v5e-}" ;;
    *) echo "$ACCELERATOR" ;;
  esac
}

runtime_version() {
  if [[ -n "${RUNTIME:-}" ]]; then
    echo "$RUNTIME"
  else
    runtime_for "$1" || die "set RUNTIME: no default TPU software version for ACCELERATOR=$1" \
      "(gcloud compute tpus versions list --zone=$ZONE lists them)"
  fi
}

location_flags() {  # the zone (and project) every gcloud call names
  LOCATION=(--zone="$ZONE")
  if [[ -n "${PROJECT:-}" ]]; then LOCATION+=(--project="$PROJECT"); fi
}

ssh_all() {  # runs a command on every worker at once
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${LOCATION[@]}" --worker=all --command="$1"
}

# Splits the interleaved "[worker N] line" output of all workers: every line goes to stdout as it comes, and what
# follows its tag to LOGS_DIR/worker-N.log (anything before the tag, such as a prefix of the ssh client's, is
# dropped there).
collect_by_worker() {
  mkdir -p "$LOGS_DIR"
  rm -f "$LOGS_DIR"/worker-*.log
  awk -v dir="$LOGS_DIR" '
    { print; fflush() }
    match($0, /\[worker [0-9]+\] /) {
      file = dir "/worker-" substr($0, RSTART + 8, RLENGTH - 10) ".log"
      print substr($0, RSTART + RLENGTH) >> file
      fflush(file)
    }'
}

create() {
  local type runtime
  type=$(accelerator_type)
  runtime=$(runtime_version "$type")
  gcloud compute tpus tpu-vm create "$TPU_NAME" "${LOCATION[@]}" --accelerator-type="$type" --version="$runtime"
}

queued() {
  local type runtime
  type=$(accelerator_type)
  runtime=$(runtime_version "$type")
  gcloud compute tpus queued-resources create "${QUEUED_ID:-$TPU_NAME}" --node-id="$TPU_NAME" "${LOCATION[@]}" \
    --accelerator-type="$type" --runtime-version="$runtime"
  echo "queued; it is ready when 'gcloud compute tpus queued-resources describe ${QUEUED_ID:-$TPU_NAME}" \
       "--zone=$ZONE' says ACTIVE. Delete it with QUEUED_ID=${QUEUED_ID:-$TPU_NAME} launch/tpu_vm.sh delete"
}

existing_files() {  # NUL-separated paths under REPO_ROOT in, the ones that exist out
  local path
  while IFS= read -r -d '' path; do
    if [[ -e "$REPO_ROOT/$path" ]]; then printf '%s\0' "$path"; fi
  done
}

install() {
  local extras=${EXTRAS:-tpu} staging
  if [[ -n "${REPO_URL:-}" ]]; then
    gcloud compute tpus tpu-vm scp "$HERE/tpu_worker.sh" "$TPU_NAME:" "${LOCATION[@]}" --worker=all
    ssh_all "mkdir -p ~/flexmarl && mv ~/tpu_worker.sh $WORKER_SCRIPT && bash $WORKER_SCRIPT install git $(printf '%q %q' "$REPO_URL" "$extras")"
  else
    # This tree as git sees it (tracked and untracked files, without what .gitignore leaves out: .venv, runs/;
    # files deleted but not yet committed are skipped).
    staging=$(mktemp -d)
    trap "rm -rf '$staging'" EXIT  # expanded now: the variable is local to this function
    git -C "$REPO_ROOT" ls-files -z --cached --others --exclude-standard | existing_files |
      tar -C "$REPO_ROOT" --null -T - -czf "$staging/flexmarl-src.tar.gz"
    gcloud compute tpus tpu-vm scp "$HERE/tpu_worker.sh" "$staging/flexmarl-src.tar.gz" "$TPU_NAME:" \
      "${LOCATION[@]}" --worker=all
    ssh_all "mkdir -p ~/flexmarl && mv ~/tpu_worker.sh ~/flexmarl-src.tar.gz ~/flexmarl/ && bash $WORKER_SCRIPT install tree ~/flexmarl/flexmarl-src.tar.gz $(printf '%q' "$extras")"
  fi
}

train() {  # one `flexmarl train` per worker, joined by JAX's distributed runtime; the arguments pass through
  local args=""
  if (($#)); then args=$(printf ' %q' "$@"); fi
  ssh_all "bash $WORKER_SCRIPT train$args" | collect_by_worker
}

logs() {
  local follow=""
  if [[ "${1:-}" == follow ]]; then follow=" follow"; fi
  ssh_all "bash $WORKER_SCRIPT logs$follow" | collect_by_worker
}

delete() {
  if [[ -n "${QUEUED_ID:-}" ]]; then
    gcloud compute tpus queued-resources delete "$QUEUED_ID" "${LOCATION[@]}" --force --quiet
  else
    gcloud compute tpus tpu-vm delete "$TPU_NAME" "${LOCATION[@]}" --quiet
  fi
}

main() {
  local command=${1:-}
  case "$command" in
    create | queued | install | train | logs | delete) shift ;;
    -h | --help | help) usage; return 0 ;;
    *) usage >&2; return 2 ;;
  esac
  need TPU_NAME "the TPU VM name"
  need ZONE "the zone of the TPU VM, e.g. us-west4-a"
  LOGS_DIR=${LOGS_DIR:-logs/$TPU_NAME}
  location_flags
  "$command" "$@"
}

main "$@"
