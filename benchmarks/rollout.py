"""Rollout throughput benchmark (see flexmarl_jax/bench/rollout.py); same as `flexmarl bench rollout`."""

import sys

from flexmarl_jax.bench.rollout import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
