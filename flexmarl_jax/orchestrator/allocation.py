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
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import Mesh

from flexmarl_jax.train.slice_pool import SliceLease, TrainingSlice, TrainingSlicePool
from flexmarl_jax.transfer import StateStore

logger = logging.getLogger(__name__)


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
