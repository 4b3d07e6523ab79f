#!/usr/bin/env bash
# Multi-node GPU training: one `flexmarl train` process per node, joined by JAX's distributed runtime through a
# coordinator on node 0 (docs/launch.md). Each process sees its node's GPUs; the config's placement counts
# the devices of all nodes together.
#
#   launch/gpu_multinode.sh node [flexmarl train args]   run this node's process (start it on every node)
#       COORDINATOR  HOST:PORT of the coordinator, served by the process of rank 0 (its host must be node 0)
#       NUM_NODES    processes in the run (one per node)     under Slurm's srun: SLURM_NTASKS when unset
#       NODE_RANK    this node's rank, 0 .. NUM_NODES-1      under Slurm's srun: SLURM_PROCID when unset
#
#   launch/gpu_multinode.sh ssh [flexmarl train args]    start every node's process from here over ssh
#       HOSTS        the nodes, space-separated; the first is rank 0 and runs the coordinator
#       PORT         the coordinator's port (default 12355)
#       REMOTE_DIR   this repository's path on the nodes (default: the same path as here, e.g. a shared home)
#       LOGS_DIR     where each node's output is collected as node-RANK.log (default logs/gpu)
#
# FLEXMARL is the command that runs flexmarl (default: flexmarl, from the active environment).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(dirname "$HERE")

die() {
  echo "gpu_multinode.sh: $*" >&2
  exit 2
}

node() {
  local num_nodes=${NUM_NODES:-${SLURM_NTASKS:-}} rank=${NODE_RANK:-${SLURM_PROCID:-}}
  [[ -n "${COORDINATOR:-}" ]] || die "set COORDINATOR (HOST:PORT of node 0's coordinator, e.g. 10.0.0.1:12355)"
  [[ "$COORDINATOR" == *:* ]] || die "COORDINATOR=$COORDINATOR must be HOST:PORT"
  [[ -n "$num_nodes" ]] || die "set NUM_NODES (the number of nodes, one process each)"
  [[ -n "$rank" ]] || die "set NODE_RANK (this node's rank, 0 .. NUM_NODES-1)"
  [[ "$num_nodes" =~ ^[1-9][0-9]*$ ]] || die "NUM_NODES=$num_nodes must be a positive integer"
  [[ "$rank" =~ ^[0-9]+$ ]] && ((rank < num_nodes)) || die "NODE_RANK=$rank must be in 0 .. $((num_nodes - 1))"
  # Distributed first, so that later --config.distributed.* flags of the caller win.
  exec ${FLEXMARL:-flexmarl} train --config.distributed.enabled=True \
    --config.distributed.coordinator_address="$COORDINATOR" \
    --config.distributed.num_processes="$num_nodes" --config.distributed.process_id="$rank" "$@"
}

fan_out() {
  local -a hosts
  read -ra hosts <<<"${HOSTS:-}"
  ((${#hosts[@]})) || die "set HOSTS (the nodes, space-separated; the first runs the coordinator)"
  local coordinator="${hosts[0]}:${PORT:-12355}" remote_dir=${REMOTE_DIR:-$REPO_ROOT} logs=${LOGS_DIR:-logs/gpu}
  local args="" rank status=0
  local -a pids
  if (($#)); then args=$(printf ' %q' "$@"); fi
  mkdir -p "$logs"
  for rank in "${!hosts[@]}"; do
    ssh "${hosts[$rank]}" "cd $(printf '%q' "$remote_dir") && COORDINATOR=$coordinator NUM_NODES=${#hosts[@]}" \
      "NODE_RANK=$rank bash launch/gpu_multinode.sh node$args" >"$logs/node-$rank.log" 2>&1 &
    pids[rank]=$!
  done
  echo "started ${#hosts[@]} processes (coordinator $coordinator); their output: $logs/node-RANK.log"
  for rank in "${!pids[@]}"; do
    if ! wait "${pids[$rank]}"; then
      echo "node $rank (${hosts[$rank]}) failed; see $logs/node-$rank.log" >&2
      status=1
    fi
  done
  return "$status"
}

case "${1:-}" in
  node) shift; node "$@" ;;
  ssh) shift; fan_out "$@" ;;
  *) echo "usage: launch/gpu_multinode.sh node|ssh [flexmarl train args] (settings: see the header)" >&2; exit 2 ;;
esac
