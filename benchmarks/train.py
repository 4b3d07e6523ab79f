"""Trainer benchmark; same as `flexmarl bench train`. See flexmarl_jax/bench/train.py."""

import sys

from flexmarl_jax.bench.train import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
