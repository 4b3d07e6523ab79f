"""Thin script: `python benchmarks/workflows.py --json PATH` == `flexmarl bench workflows --json PATH`."""

import sys

from flexmarl_jax.bench.workflows import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
