"""Response lengths an emulated engine's samples take: fixed, or long-tailed like an RL run's responses.

A script is a function (seed, sample_index) -> tokens, deterministic, so one seed gives every mode of a bench
the same responses. `long_tailed(median, cap)` draws a log-normal length (median `median`, shape `sigma`)
clipped to [1, cap]: most responses are short and a few run to the cap, the long tail that makes a rollout
wait for its slowest sample (the FlexMARL paper's motivation for micro-batch asynchrony).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

DEFAULT_SIGMA = 1.0  # log-normal shape: with median m, about 1 in 40 samples exceeds 7 m


def long_tailed(median: int, cap: int, *, sigma: float = DEFAULT_SIGMA) -> Callable[[int, int], int]:
    """Lengths log-normal around `median`, clipped to [1, cap]; (seed, sample_index) picks the draw."""
    if not 1 <= median <= cap or sigma < 0:
        raise ValueError(f"median={median} must be in [1, cap={cap}] and sigma={sigma} >= 0")

    def length(seed: int, sample_index: int) -> int:
        rng = np.random.default_rng([seed & 0xFFFFFFFF, sample_index & 0xFFFFFFFF])
        draw = math.exp(math.log(median) + sigma * rng.standard_normal())
        return int(min(cap, max(1, round(draw))))

    return length
