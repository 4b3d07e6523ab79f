"""The training slice pool: S slices of training devices (each a Mesh over a disjoint device subset) that any
number of agents lease one at a time, first come first served, an agent's previous slice preferred so nothing
moves; busy intervals per slice for utilization (orchestrator/allocation.py moves the trainers' state between
slices; emulation/training_pool.py runs the same pool over placeholder meshes).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import Mesh

from flexmarl_jax.mesh.meshes import make_mesh

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainingSlice:
    """One slice of the training pool: a mesh over devices no other slice uses."""

    index: int
    mesh: Mesh

    @property
    def name(self) -> str:
        """Resource name for timelines (group "train")."""
        return f"train/slice{self.index}"

    @property
    def devices(self) -> frozenset:
        return frozenset(self.mesh.devices.flat)


@dataclasses.dataclass(frozen=True)
class SliceLease:
    """``agent`` holds ``slice`` since ``granted_at``; ``reused`` when it is the slice the agent used last;
    ``previous_agent``: who held the slice before (whose state may be parked there), None for a new slice."""

    agent: str
    slice: TrainingSlice
    granted_at: float
    reused: bool
    previous_agent: str | None = None


@dataclasses.dataclass(frozen=True)
class SliceLeaseInterval:
    """A span during which `agent` held training slice `slice_index`."""

    slice_index: int
    agent: str
    start: float
    end: float


class TrainingSlicePool:
    """S training slices handed to agents on demand, first come first served.

    meshes: one Mesh per slice over pairwise disjoint devices.
    clock: seconds (monotonic); a simulator passes its virtual clock.
    timeline: optional ``metrics.Timeline``; every lease is also recorded there as a "train" interval.
    """

    def __init__(self, meshes: Sequence[Mesh], *, clock: Callable[[], float] = time.perf_counter,
                 timeline: Any | None = None):
        if not meshes:
            raise ValueError("a training pool needs at least one slice (got no meshes)")
        seen: dict = {}
        for index, mesh in enumerate(meshes):
            for device in mesh.devices.flat:
                if device in seen:
                    raise ValueError(f"device {device} is in slice {seen[device]} and slice {index}; "
                                     "training slices must use disjoint devices")
                seen[device] = index
        self.slices = tuple(TrainingSlice(i, mesh) for i, mesh in enumerate(meshes))
        self._clock = clock
        self._timeline = timeline
        if timeline is not None:
            timeline.declare(*(s.name for s in self.slices))
        self._cond = threading.Condition()
        self._holder: list[str | None] = [None] * len(self.slices)
        self._last_agent: list[str | None] = [None] * len(self.slices)
        self._released_at: list[float] = [float("-inf")] * len(self.slices)
        self._leases: dict[str, SliceLease] = {}
        self._last_slice: dict[str, int] = {}
        self._waiting: deque[tuple[object, str]] = deque()
        self._intervals: list[SliceLeaseInterval] = []
        self._created_at = clock()

    @classmethod
    def from_devices(cls, devices: Sequence, num_slices: int, *, tp: int = 1, **kwargs) -> TrainingSlicePool:
        """Splits ``devices`` in order into ``num_slices`` equal ("fsdp", "tp") meshes."""
        devices = list(devices)
        if num_slices < 1 or len(devices) % num_slices:
            raise ValueError(f"num_slices={num_slices} must be >= 1 and divide the {len(devices)} devices")
        per_slice = len(devices) // num_slices
        if per_slice % tp:
            raise ValueError(f"tp={tp} must divide the {per_slice} devices of each slice")
        meshes = [make_mesh(devices[i * per_slice:(i + 1) * per_slice], fsdp=per_slice // tp, tp=tp)
                  for i in range(num_slices)]
        return cls(meshes, **kwargs)

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    # --------------------------------------------------------------------------------- leasing

    def acquire(self, agent: str, *, timeout: float | None = None) -> SliceLease:
        """Blocks until a slice is free (first come first served) and leases it to ``agent``.

        Prefers the slice ``agent`` used last (its state may still be there), then a never-used slice,
        then the slice released longest ago. Raises TimeoutError after ``timeout`` seconds, naming who
        holds the slices, and RuntimeError if ``agent`` already holds one.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._check_not_holding(agent)
            ticket = object()
            self._waiting.append((ticket, agent))
            try:
                while not (self._waiting[0][0] is ticket and None in self._holder):
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(
                            f"agent {agent!r} waited {timeout} s for a training slice; holders: "
                            f"{self._holders_text()}; waiting before it: "
                            f"{[a for t, a in self._waiting if t is not ticket]}")
                    self._cond.wait(remaining)
                return self._grant(agent)
            finally:
                self._waiting.remove((ticket, agent))
                self._cond.notify_all()

    def try_acquire(self, agent: str) -> SliceLease | None:
        """A lease if a slice is free and nobody is waiting, else None (never blocks)."""
        with self._cond:
            self._check_not_holding(agent)
            if self._waiting or None not in self._holder:
                return None
            return self._grant(agent)

    def release(self, agent: str) -> SliceLeaseInterval:
        """Ends ``agent``'s lease; returns the busy interval it accounted."""
        with self._cond:
            lease = self._leases.pop(agent, None)
            if lease is None:
                raise RuntimeError(f"agent {agent!r} holds no training slice; "
                                   f"holders: {self._holders_text()}")
            index = lease.slice.index
            now = self._clock()
            self._holder[index] = None
            self._released_at[index] = now
            interval = SliceLeaseInterval(index, agent, lease.granted_at, now)
            self._intervals.append(interval)
            if self._timeline is not None:
                self._timeline.add_interval(lease.slice.name, kind="train", agent=agent,
                                            start=lease.granted_at, end=now)
            self._cond.notify_all()
            return interval

    def _check_not_holding(self, agent: str) -> None:
        if agent in self._leases:
            raise RuntimeError(f"agent {agent!r} already holds training slice "
                               f"{self._leases[agent].slice.index}; release it first")

    def _grant(self, agent: str) -> SliceLease:
        free = [i for i, holder in enumerate(self._holder) if holder is None]
        last = self._last_slice.get(agent)
        if last in free:
            index = last
        else:  # never-used slices first (nobody's state parked there), then least recently released
            index = min(free, key=lambda i: (self._last_agent[i] is not None, self._released_at[i], i))
        previous = self._last_agent[index]
        self._holder[index] = agent
        self._last_agent[index] = agent
        self._last_slice[agent] = index
        lease = SliceLease(agent, self.slices[index], self._clock(), reused=(index == last), previous_agent=previous)
        self._leases[agent] = lease
        return lease

    def _holders_text(self) -> str:
        return ", ".join(f"slice{i}={holder or 'free'}" for i, holder in enumerate(self._holder))

    # ------------------------------------------------------------------------------- accounting

    def intervals(self, *, include_open: bool = True) -> list[SliceLeaseInterval]:
        """Busy intervals of every slice (open leases end now when ``include_open``)."""
        with self._cond:
            intervals = list(self._intervals)
            if include_open:
                now = self._clock()
                intervals += [SliceLeaseInterval(lease.slice.index, lease.agent, lease.granted_at, now)
                              for lease in self._leases.values()]
            return intervals

    def busy_seconds(self, t0: float | None = None, t1: float | None = None) -> list[float]:
        """Per slice, seconds leased within [t0, t1] (default: pool creation until now)."""
        t0 = self._created_at if t0 is None else t0
        t1 = self._clock() if t1 is None else t1
        busy = [0.0] * self.num_slices
        for interval in self.intervals():
            busy[interval.slice_index] += max(0.0, min(interval.end, t1) - max(interval.start, t0))
        return busy

    def utilization(self, t0: float | None = None, t1: float | None = None) -> float:
        """Leased slice-seconds / (slices x window): the training pool's utilization in [0, 1]."""
        t0 = self._created_at if t0 is None else t0
        t1 = self._clock() if t1 is None else t1
        if t1 <= t0:
            return 0.0
        return sum(self.busy_seconds(t0, t1)) / (self.num_slices * (t1 - t0))
