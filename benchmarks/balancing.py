"""Thin script: `python benchmarks/balancing.py --json balancing.json` == `flexmarl bench balancing --json ...`."""

import sys

from flexmarl_jax.bench.balancing import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
