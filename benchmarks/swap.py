"""Thin script: `python benchmarks/swap.py --json swap.json` == `flexmarl bench swap --json swap.json`."""

import sys

from flexmarl_jax.bench.swap import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
