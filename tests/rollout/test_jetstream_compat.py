"""Importing JetStream (and with it TensorFlow) leaves the process quiet and the root logger as it was."""

import os
import subprocess
import sys

import pytest

IMPORT_AND_REPORT = """
import logging
root = logging.getLogger()
before = (root.level, list(root.handlers))
{prelude}
import flexmarl_jax.rollout.jetstream_compat as compat
assert compat.engine_api.Engine is not None
assert (root.level, list(root.handlers)) == before, "the root logger was reconfigured"
print("imported")
"""


def _import(prelude: str = "") -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "TF_CPP_MIN_LOG_LEVEL"}
    return subprocess.run([sys.executable, "-c", IMPORT_AND_REPORT.format(prelude=prelude)], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.timeout(240)
def test_the_import_writes_nothing_unless_verbosity_asks_for_info():
    quiet = _import()
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip() == "imported"
    assert quiet.stderr == ""  # TensorFlow's C++ lines ("Could not find cuda drivers", ...) were diverted
    verbose = _import("from absl import logging as absl_logging; absl_logging.set_verbosity(0)")
    assert verbose.returncode == 0, verbose.stderr
    # With INFO asked for, nothing is diverted: TensorFlow's CPU build prints its CUDA notice again.
    assert verbose.stdout.strip() == "imported"
    assert "cudart_stub" in verbose.stderr
