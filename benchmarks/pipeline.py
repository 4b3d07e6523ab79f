"""Thin script: `python benchmarks/pipeline.py --json pipeline.json` == `flexmarl bench pipeline --json ...`."""

import sys

from flexmarl_jax.bench.pipeline import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
