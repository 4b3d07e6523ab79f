"""Training slices of an emulated run: the real `TrainingSlicePool` (first come first served, an agent's last
slice preferred, busy accounting) over placeholder meshes, since emulated slices own no JAX devices.

`EmulatedSharedTraining` is the `TrainingPool` the orchestrator sees with `mesh.train_slices` > 0: emulated
trainers lease a slice in `activate` and hand it back in `release`, as `PooledTrainer`s do; the real
`DedicatedTraining` serves the static binding (a mesh per agent) unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from flexmarl_jax.train.slice_pool import TrainingSlicePool


class EmulatedMesh:
    """What `TrainingSlicePool` reads of a mesh: its devices (here one token per emulated slice)."""

    def __init__(self, index: int):
        self.devices = np.array([f"emulated-slice{index}"], dtype=object)


class EmulatedSharedTraining:
    """`num_slices` slices shared by the agents' `EmulatedTrainer`s (which must be built with `slices=self.pool`:
    see `make_pool`)."""

    def __init__(self, trainers: Mapping[str, Any], pool: TrainingSlicePool):
        self.trainers = dict(trainers)
        self.pool = pool
        self.clock = pool._clock

    @staticmethod
    def make_pool(num_slices: int, *, clock: Callable[[], float] = time.perf_counter) -> TrainingSlicePool:
        return TrainingSlicePool([EmulatedMesh(index) for index in range(num_slices)], clock=clock)

    @property
    def num_slices(self) -> int:
        return self.pool.num_slices

    def usage(self, since: float) -> dict[str, Any]:
        """The fraction of slice time leased to some agent since `since` (a `clock()` reading)."""
        return {"held": self.pool.utilization(since, self.clock())}
