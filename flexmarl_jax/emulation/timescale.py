"""Emulated device time on the host's wall clock: compressed by a factor, with the host's own share checked.

An emulated step of `device_s` device seconds is made to last `device_s / compression` wall seconds
(compression 1 = real time; 60 = an hour of device time per wall minute). The host's own work per step
(Python, the control plane) is not compressed: it adds to every step, so a run whose host overhead is a
large share of the compressed step measures the host, not the emulated devices. `overhead_share` is the
overhead over the compressed step; `MAX_HOST_OVERHEAD_SHARE` (10%) is the bound an emulated run keeps, or
reports that it did not.
"""

from __future__ import annotations

import dataclasses

from flexmarl_jax.emulation.rules import compression_problem

MAX_HOST_OVERHEAD_SHARE = 0.10


@dataclasses.dataclass(frozen=True)
class TimeScale:
    """Device seconds -> wall seconds at `compression` >= 1 (a run's is `pipeline.emulate_compression`)."""

    compression: float

    def __post_init__(self):
        problem = compression_problem(self.compression)
        if problem:
            raise ValueError(f"compression={self.compression!r} {problem}")

    def wall_s(self, device_s: float) -> float:
        """Wall seconds an emulated call of `device_s` device seconds lasts."""
        return device_s / self.compression

    def device_s(self, wall_s: float) -> float:
        """Device seconds a span of `wall_s` wall seconds stands for (reading a compressed timeline)."""
        return wall_s * self.compression

    def overhead_share(self, host_overhead_s: float, device_s: float) -> float:
        """The host's overhead per step as a fraction of the compressed step (inf for a zero-length step)."""
        wall = self.wall_s(device_s)
        if wall <= 0:
            return 0.0 if host_overhead_s <= 0 else float("inf")
        return host_overhead_s / wall

    def overhead_within_bound(self, host_overhead_s: float, device_s: float) -> bool:
        """Whether the host's overhead stays under `MAX_HOST_OVERHEAD_SHARE` of the compressed step."""
        return self.overhead_share(host_overhead_s, device_s) < MAX_HOST_OVERHEAD_SHARE
