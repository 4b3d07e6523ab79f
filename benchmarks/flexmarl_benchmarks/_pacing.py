"""Accelerator-paced engine steps for benchmarks on a CPU host (see `pace_steps`)."""

from __future__ import annotations

import time


def pace_steps(instance, pace_s: float) -> None:
    """Pads every engine step of `instance` to at least `pace_s` with a sleep, as if it decoded on its own
    accelerator where a step takes `pace_s`: the sleep frees the host's cores for the rest of the run
    (training, other instances), which a device of its own would not have taken. Tokens are still really
    generated. Patched on the object, so the instance keeps it when the balancer moves it."""
    inner = instance.step

    def paced_step() -> None:
        started = time.perf_counter()
        inner()
        time.sleep(max(0.0, pace_s - (time.perf_counter() - started)))

    instance.step = paced_step
