"""Faults at random moments, resumed and audited (see flexmarl_jax/bench/faults.py); same as `flexmarl bench faults`."""

import sys

from flexmarl_jax.bench.faults import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
