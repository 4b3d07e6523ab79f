"""Test-wide setup: 8 fake CPU devices (set before JAX is imported) and shared tiny fixtures."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Keep XLA's CPU thread pools from oversubscribing the 2-core CI machine.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402


@pytest.fixture
def tiny_config():
    """The embedded default config, fresh per test."""
    from flexmarl_jax.config import load_config

    return load_config()
