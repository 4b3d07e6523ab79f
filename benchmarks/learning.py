"""Thin script: `python benchmarks/learning.py --json PATH` == `flexmarl bench learning --json PATH`."""

import sys

from flexmarl_jax.bench.learning import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
