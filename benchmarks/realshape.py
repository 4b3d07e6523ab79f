"""Real-size benchmark; same as `flexmarl bench realshape`. See flexmarl_jax/bench/realshape.py."""

import sys

from flexmarl_jax.bench.realshape import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
