"""Fake CPU devices for a host without accelerators. Pure Python: it must run before JAX is imported."""

from __future__ import annotations

import os

_FLAG = "xla_force_host_platform_device_count"


def fake_cpu_devices(count: int) -> None:
    """Asks XLA for `count` CPU devices, unless XLA_FLAGS already sets a count. Takes effect only if JAX has
    not initialised its backends yet."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{_FLAG}={count}".strip()
