"""One process of a multi-process `flexmarl train` in tests, reporting all-device computations (all_device_watch).

argv: FLEXMARL_ARGS..."""

import sys

from tests.distributed import all_device_watch

all_device_watch.install()
from flexmarl_jax.cli.main import main  # noqa: E402 - after the watch, like a run's own imports

sys.exit(main(sys.argv[1:]))
