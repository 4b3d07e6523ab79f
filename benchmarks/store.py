"""Experience-store throughput benchmark (see flexmarl_jax/bench/store.py); same as `flexmarl bench store`."""

import sys

from flexmarl_jax.bench.store import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
