"""Thin script: `python benchmarks/parity.py --json parity.json` == `flexmarl bench parity --json ...`."""

import sys

from flexmarl_jax.bench.parity import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
