"""Test-wide setup: 8 fake CPU devices (set before JAX is imported) and shared tiny fixtures."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# TensorFlow, where a test imports it (JetStream's Driver), logs only errors.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# One compile cache for the whole session (and the `flexmarl` subprocesses tests start, and pytest-xdist's
# workers, which inherit this process's environment): engines and trainers jit per instance, so every run of the
# same shapes would otherwise compile everything again. Synthetic checkpoints the recipes' smoke variants make on
# first use (models/fixture_cache.py) go to a session folder, not the user's cache. The process that made the
# folders removes them when it exits.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="flexmarl-jax-test-cache-")
    # Only programs that took 0.1 s or more to compile are written. JAX rescans the whole cache folder (glob,
    # stat and an access-time file per entry) on every write while it holds the lock, so a write costs time in
    # proportion to the entries already there, and the suite's writes cost time quadratic in their number. Most
    # entries are one-op programs (jit_multiply, jit_add, ...) that compile in 30-40 ms. Measured on
    # tests/train plus tests/cli/test_train_workflows.py (two workers): 932 entries and 43 s inside writes at 0 s,
    # 251 entries and 3.4 s at 0.1 s; wall 299 -> 271 s.
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.1"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    # A size limit turns on JAX's file lock around the cache's reads and writes; without one (the default, -1)
    # an entry is written in place, and a process reading it meanwhile (the other worker, a `flexmarl`
    # subprocess) gets a truncated executable. 64 GiB: never reached, so nothing is evicted.
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(64 << 30)
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# LLVM at -O0 without its expensive passes (JAX's own switch for this): most test programs run for less time than
# their compile takes. Measured side by side: the chain smoke run 33 -> 26 s, tests/train/test_lora_training.py
# 33 -> 27 s, two such files at once 66 -> 49 s; the SmolLM2 recipe's smoke run, which is execution-bound, 153 s
# either way. The flag is part of JAX's compile-cache key, so a cache never mixes the two.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# XLA's CPU backend with its older elemental emitters instead of the MLIR fusion emitters: they compile test
# programs in less than half the time. Measured here, one process, cold cache: tests/train/test_lora_training.py
# 34 -> 22 s (backend compile 23.8 -> 10.5 s), three workflow runs of tests/cli/test_train_workflows.py
# 93 -> 64 s; the SmolLM2 smoke run, execution-bound, 118 -> 120 s. Child processes keep the flag
# (mesh/host_devices.py's without_fake_cpu_devices drops only the device count).
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
if "FLEXMARL_FIXTURE_DIR" not in os.environ:
    os.environ["FLEXMARL_FIXTURE_DIR"] = tempfile.mkdtemp(prefix="flexmarl-jax-test-fixtures-")
    atexit.register(shutil.rmtree, os.environ["FLEXMARL_FIXTURE_DIR"], ignore_errors=True)

import pytest  # noqa: E402


@pytest.fixture
def tiny_config():
    """The embedded default config, typed (`RunConfig`)."""
    from flexmarl_jax.config import RunConfig, load_config

    return RunConfig.from_config(load_config())
