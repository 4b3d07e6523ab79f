#!/usr/bin/env bash
# Create a Cloud TPU VM (single host or pod slice), install flexmarl-jax on every worker and start a run.
#
#   TPU_NAME=flexmarl ZONE=us-central2-b ACCELERATOR=v4-32 launch/tpu_vm.sh create
#   TPU_NAME=flexmarl ZONE=us-central2-b launch/tpu_vm.sh install
#   TPU_NAME=flexmarl ZONE=us-central2-b launch/tpu_vm.sh train --config=configs/tiny.py --workdir=gs://bucket/run1
#   TPU_NAME=flexmarl ZONE=us-central2-b launch/tpu_vm.sh delete
#
# On a pod slice every worker runs the same command with FLEXMARL_DISTRIBUTED=1, which makes flexmarl call
# jax.distributed.initialize() (it reads the TPU metadata) before building meshes. Use a gs:// workdir so the experience store (ocdbt) and the
# Orbax checkpoints live on storage that every host sees.
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
RUNTIME=${RUNTIME:-tpu-ubuntu2204-base}
REPO_URL=${REPO_URL:-$(git config --get remote.origin.url || true)}

ssh_all() { gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "$1"; }

case "${1:-}" in
  create)
    : "${ACCELERATOR:?set ACCELERATOR, e.g. v4-8 or v5litepod-16}"
    gcloud compute tpus tpu-vm create "$TPU_NAME" --zone "$ZONE" --accelerator-type "$ACCELERATOR" \
      --version "$RUNTIME" ;;
  install)
    : "${REPO_URL:?set REPO_URL to a clone URL of this repository}"
    ssh_all "set -e; rm -rf flexmarl-jax; git clone -q $REPO_URL flexmarl-jax; cd flexmarl-jax; \
      python3 -m venv .venv; .venv/bin/pip install -q -e '.[tpu]'" ;;
  train)
    shift
    ssh_all "cd flexmarl-jax && FLEXMARL_DISTRIBUTED=1 .venv/bin/flexmarl train $*" ;;
  delete)
    gcloud compute tpus tpu-vm delete "$TPU_NAME" --zone "$ZONE" --quiet ;;
  *)
    echo "usage: $0 create|install|train [flexmarl train args]|delete" >&2; exit 2 ;;
esac
