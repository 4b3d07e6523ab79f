"""Agent-centric training allocation: agents hold a training slice only while they have work.

Static binding gives every agent its own training devices, which then idle whenever that agent has no
micro-batch (the FlexMARL paper measured 18.8% utilization). Here the training pool is S slices (each a
Mesh over a disjoint device subset) shared by any number of agents:

    pool = TrainingSlicePool.from_devices(jax.devices()[:8], num_slices=2)
    residency = TrainerResidency(StateStore(), pool, offload_tier="host")
    residency.register("solver", initial_state)          # pytree: params, optimizer state, accumulator...
    with residency.session("solver", timeout=60) as active:   # blocks until a slice is free
        active.state = train_step(active.state, micro_batch)  # state lives on active.mesh
    # the slice is released; the state stays parked on it until another agent needs the slice,
    # then it is offloaded (device memory freed) and comes back on whichever slice is free next.

`TrainingSlicePool` decides *which* slice (the agent's previous one when free, so nothing moves) and
accounts busy intervals per slice; `TrainerResidency` moves the state through the `StateStore`. Both are
generic over "a pytree of state per agent"; nothing here knows about models or losses.

Integration with `train.AgentTrainer` (tested in tests/orchestrator/test_allocation.py): a trainer's
jitted steps are bound to one mesh, so the orchestrator keeps one trainer per (agent, slice) it has used
and moves the *state* between them:

    residency = TrainerResidency(store, pool, target_for=lambda agent, mesh: {
        "trainer": trainer_on(agent, mesh).checkpoint_shardings(), "policy_version": None})
    residency.register(agent, {"trainer": trainer.checkpoint_state(), "policy_version": 0})
    with residency.session(agent) as active:
        t = trainer_on(agent, active.mesh)
        t.load_checkpoint_state(active.state["trainer"], active.state["policy_version"])
        ... t.accumulate(micro_batch) ... t.apply()
        active.state = {"trainer": t.checkpoint_state(), "policy_version": t.policy_version}

`checkpoint_state` covers iteration boundaries only (it refuses while gradients are pending). Suspending
an agent between micro-batches of an iteration needs the fp32 gradient accumulator and the pending
micro-batch count in the exported state as well (an AgentTrainer method to add).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from flexmarl_jax.mesh.meshes import make_mesh
from flexmarl_jax.transfer import StateStore

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
    """``agent`` holds ``slice`` since ``granted_at``; ``reused`` when it is the slice the agent used last."""

    agent: str
    slice: TrainingSlice
    granted_at: float
    reused: bool


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
        self._holder[index] = agent
        self._last_agent[index] = agent
        self._last_slice[agent] = index
        lease = SliceLease(agent, self.slices[index], self._clock(), reused=(index == last))
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


# ------------------------------------------------------------------------------------ residency


@dataclasses.dataclass
class ActiveState:
    """An agent's state, placed on its leased slice; assign ``state`` after each step."""

    agent: str
    lease: SliceLease
    state: Any
    moved_from: str  # "slice" (already there), "device" (another slice), "host" or "storage"

    @property
    def mesh(self) -> Mesh:
        return self.lease.slice.mesh

    @property
    def slice(self) -> TrainingSlice:
        return self.lease.slice


@dataclasses.dataclass
class SwapStats:
    """Counts and seconds of state moves done by a `TrainerResidency`."""

    activations: int = 0
    reused: int = 0  # state was already on the granted slice: nothing moved
    moved_between_slices: int = 0
    swapped_in: int = 0  # from host or storage
    swapped_out: int = 0  # offloaded to host or storage
    swap_in_seconds: float = 0.0
    swap_out_seconds: float = 0.0


class TrainerResidency:
    """Keeps each agent's state in a `StateStore` and on a training slice only while the agent works.

    store: where states live between activations (key ``key_prefix + agent``).
    pool: the training slices.
    offload_tier: "host" or "storage" (the store then needs a storage_root) for suspended states.
    park_on_release: leave a released agent's state on its slice until another agent needs that slice
        (re-activating on the same slice then moves nothing); False offloads at every release.
    target_for: (agent, slice mesh) -> get() target; default the mesh itself (leaves keep their specs).
    """

    def __init__(self, store: StateStore, pool: TrainingSlicePool, *, offload_tier: str = "host",
                 park_on_release: bool = True, key_prefix: str = "trainer/",
                 target_for: Callable[[str, Mesh], Any] | None = None):
        if offload_tier not in ("host", "storage"):
            raise ValueError(f"offload_tier={offload_tier!r}; allowed: 'host', 'storage'")
        self.store = store
        self.pool = pool
        self.offload_tier = offload_tier
        self.park_on_release = park_on_release
        self.key_prefix = key_prefix
        self._target_for = target_for or (lambda agent, mesh: mesh)
        self._lock = threading.RLock()  # state moves; never held while waiting for a slice
        self._parked: list[str | None] = [None] * pool.num_slices  # agent whose state sits on each slice
        self._active: dict[str, ActiveState] = {}
        self.stats = SwapStats()

    def key(self, agent: str) -> str:
        return self.key_prefix + agent

    def agents(self) -> list[str]:
        return sorted(k[len(self.key_prefix):] for k in self.store.keys() if k.startswith(self.key_prefix))

    def register(self, agent: str, state: Any) -> None:
        """Hands ``agent``'s initial state (device or host pytree) to the residency; it starts suspended."""
        with self._lock:
            if agent in self._active:
                raise RuntimeError(f"agent {agent!r} is active on slice {self._active[agent].slice.index}")
            self._unpark(agent)
            self.store.set(self.key(agent), state)
            if self.store.where(self.key(agent)) == "device":
                self._offload(agent)

    def location(self, agent: str) -> tuple[str, int | None]:
        """(tier, slice index or None): where ``agent``'s state is now."""
        with self._lock:
            tier = self.store.where(self.key(agent))
            if agent in self._active:
                return tier, self._active[agent].slice.index
            return tier, (self._parked.index(agent) if agent in self._parked else None)

    def activate(self, agent: str, *, timeout: float | None = None) -> ActiveState:
        """Leases a slice (blocking up to ``timeout``) and places ``agent``'s state on it."""
        key = self.key(agent)
        if key not in self.store:
            raise KeyError(f"agent {agent!r} has no registered state; registered: {self.agents()}")
        lease = self.pool.acquire(agent, timeout=timeout)
        try:
            with self._lock:
                index = lease.slice.index
                resident = self._parked[index]
                if resident is not None and resident != agent:
                    self._offload(resident)  # frees the slice's memory for this agent
                started = time.perf_counter()
                if agent in self._parked:
                    source = "slice" if self._parked.index(agent) == index else "device"
                    self._unpark(agent)
                else:
                    source = self.store.where(key)
                target = self._target_for(agent, lease.slice.mesh)
                state = self.store.get(key, target, move=True)
                jax.block_until_ready([x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)])
                self._count_activation(source, time.perf_counter() - started)
                active = ActiveState(agent, lease, state, moved_from=source)
                self._active[agent] = active
                return active
        except BaseException:
            self.pool.release(agent)
            raise

    def deactivate(self, agent: str, state: Any | None = None, *, offload: bool | None = None) -> None:
        """Stores ``agent``'s (new) state and releases its slice.

        state: the state after training (default: the ActiveState's current ``state``).
        offload: True offloads now, False parks it on the slice; default ``not park_on_release``.
        """
        with self._lock:
            active = self._active.pop(agent, None)
            if active is None:
                raise RuntimeError(f"agent {agent!r} is not active; active agents: {sorted(self._active)}")
            try:
                self.store.set(self.key(agent), active.state if state is None else state)
                active.state = None  # the store owns the arrays now
                offload = (not self.park_on_release) if offload is None else offload
                if offload:
                    self._offload(agent)
                else:
                    self._parked[active.slice.index] = agent
            finally:
                self.pool.release(agent)

    @contextlib.contextmanager
    def session(self, agent: str, *, timeout: float | None = None,
                offload: bool | None = None) -> Iterator[ActiveState]:
        """``activate`` ... ``deactivate`` with whatever ``active.state`` holds at the end."""
        active = self.activate(agent, timeout=timeout)
        try:
            yield active
        finally:
            self.deactivate(agent, offload=offload)

    def suspend(self, agent: str) -> None:
        """Offloads a parked (released) agent's state now; no-op if it is not on any device."""
        with self._lock:
            if agent in self._active:
                raise RuntimeError(f"agent {agent!r} is active; deactivate it before suspending")
            if self.store.where(self.key(agent)) == "device":
                self._offload(agent)

    def suspend_all(self) -> None:
        with self._lock:
            for agent in [a for a in self._parked if a is not None]:
                self.suspend(agent)

    def read(self, agent: str, target: Any | None = None) -> Any:
        """A copy of ``agent``'s stored state (on ``target``, or as stored); for checkpoints and tests."""
        with self._lock:
            if agent in self._active:
                raise RuntimeError(f"agent {agent!r} is active; its current state is the ActiveState's")
            return self.store.get(self.key(agent), target)

    # ----------------------------------------------------------------------------------- internals

    def _unpark(self, agent: str) -> None:
        if agent in self._parked:
            self._parked[self._parked.index(agent)] = None

    def _offload(self, agent: str) -> None:
        started = time.perf_counter()
        self.store.evict(self.key(agent), self.offload_tier)
        self._unpark(agent)
        self.stats.swapped_out += 1
        self.stats.swap_out_seconds += time.perf_counter() - started
        logger.debug("offloaded %s to %s", agent, self.offload_tier)

    def _count_activation(self, source: str, seconds: float) -> None:
        self.stats.activations += 1
        if source == "slice":
            self.stats.reused += 1
        elif source == "device":
            self.stats.moved_between_slices += 1
        else:
            self.stats.swapped_in += 1
            self.stats.swap_in_seconds += seconds
