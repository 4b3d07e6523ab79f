"""Steady iterations: which timed iterations a benchmark's statistics may use.

A real run compiles a program the first time it meets a shape (a training length bucket, a prefill batch size),
in later iterations too; those seconds are no iteration's steady cost. JAX reports every trace, lowering and
backend compile (`jax.monitoring`, events under `/jax/core/compile/`): `compile_seconds()` is their running sum
in this process, so a benchmark reads it before and after an iteration. An iteration is steady when its compiles
took under `STEADY_COMPILE_SHARE` of it; with fewer than `MIN_STEADY` steady iterations a statistic uses all of
them, and the count of steady ones says so. The listener sums every thread's compiles: time one iteration at a
time (as the benchmarks do), not two beside each other.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

STEADY_COMPILE_SHARE = 0.05  # an iteration whose compiles took less than this share of it is steady
MIN_STEADY = 3
_COMPILE_EVENTS = "/jax/core/compile/"
_compile_seconds = [0.0]  # summed by the listener below (registered once per process)
_listening = [False]


def compile_seconds() -> float:
    """Seconds JAX has spent tracing, lowering and compiling in this process since the first call."""
    if not _listening[0]:
        import jax

        def listen(event: str, duration: float, **_: object) -> None:
            if event.startswith(_COMPILE_EVENTS):
                _compile_seconds[0] += duration

        jax.monitoring.register_event_duration_secs_listener(listen)
        _listening[0] = True
    return _compile_seconds[0]


def is_steady(seconds: float, compile_s: float) -> bool:
    return compile_s < STEADY_COMPILE_SHARE * seconds


def steady_indices(seconds: Sequence[float], compile_s: Sequence[float]) -> list[int]:
    """The steady iterations' indices, or every index when fewer than `MIN_STEADY` are steady."""
    steady = [i for i, (s, c) in enumerate(zip(seconds, compile_s, strict=True)) if is_steady(s, c)]
    return steady if len(steady) >= MIN_STEADY else list(range(len(seconds)))


def steady_median(seconds: Sequence[float], compile_s: Sequence[float]) -> tuple[float, int]:
    """(the median of the steady iterations, how many there were); the median of all when fewer than
    `MIN_STEADY` are steady (then the count says so)."""
    count = sum(is_steady(s, c) for s, c in zip(seconds, compile_s, strict=True))
    return statistics.median(seconds[i] for i in steady_indices(seconds, compile_s)), count
