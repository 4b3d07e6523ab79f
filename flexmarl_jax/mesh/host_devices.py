"""Fake CPU devices for a host without accelerators. Pure Python: it must run before JAX is imported."""

from __future__ import annotations

import os
from collections.abc import Mapping

_FLAG = "xla_force_host_platform_device_count"


def fake_cpu_devices(count: int) -> None:
    """Asks XLA for `count` CPU devices, unless XLA_FLAGS already sets a count. Takes effect only if JAX has
    not initialised its backends yet."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{_FLAG}={count}".strip()


def without_fake_cpu_devices(environment: Mapping[str, str]) -> dict[str, str]:
    """A copy of `environment` for a child process that fakes its own device count: XLA_FLAGS without the count,
    its other flags kept (a test run's compile settings, say)."""
    child = dict(environment)
    flags = " ".join(flag for flag in child.pop("XLA_FLAGS", "").split() if _FLAG not in flag)
    if flags:
        child["XLA_FLAGS"] = flags
    return child
