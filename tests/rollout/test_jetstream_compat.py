"""Importing JetStream (and with it TensorFlow) leaves the process quiet and the root logger as it was."""

import json
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


# Samples a few sequences with the engine and the in-process loop, then reports what the process imported.
ROLLOUT_AND_REPORT = """
import json, sys
from flexmarl_jax.models import functional
from flexmarl_jax.models.presets import get_preset
from flexmarl_jax.models.tokenizer import CharTokenizer
from flexmarl_jax.rollout.engine import FlexEngine, SlotSampling
from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest
from flexmarl_jax.rollout.settings import EngineConfig
config = get_preset("tiny")
graphdef, params = functional.init_params(config, seed=0)
engine = FlexEngine(config, graphdef, EngineConfig(max_concurrent_decodes=4, max_prefill_length=16,
                                                   max_decode_length=12, prefill_buckets=None,
                                                   truncate_long_prompts=False, prefill_batch_sizes=(1,),
                                                   top_logprobs=0),
                    CharTokenizer())
requests = [RolloutRequest(tuple(CharTokenizer().encode(text)), num_samples=2, max_new_tokens=12, ignore_eos=True,
                           sampling=SlotSampling(temperature=temperature, seed=7))
            for text, temperature in (("1+2=", 0.0), ("abc", 1.0), ("x*y", 0.7))]
results = RolloutLoop(engine, params).generate(requests)
print(json.dumps({"engine_base": next(base.__module__ for base in type(engine).__mro__ if base.__name__ == "Engine"),
                  "imported": sorted(m for m in ("jetstream", "seqio", "tensorflow") if m in sys.modules),
                  "sequences": [list(r.token_ids) for rs in results for r in rs]}))
"""


@pytest.mark.timeout(300)
def test_rolling_out_imports_neither_jetstream_nor_tensorflow():
    """The engine builds on our own Engine API types (rollout/engine_api.py): a process that only rolls out never
    pays for JetStream's TensorFlow import (about 4 s)."""
    done = subprocess.run([sys.executable, "-c", ROLLOUT_AND_REPORT], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["engine_base"] == "flexmarl_jax.rollout.engine_api" and report["imported"] == []
    assert len(report["sequences"]) == 6 and all(len(tokens) == 12 for tokens in report["sequences"])
