"""Where agents train: `DedicatedTraining` (a mesh per agent) or `SharedTraining`, S shared training slices on
which a trainer holds a slice only while its agent has work. Both are `TrainingPool`s.

`SharedTraining` wraps every agent's `AgentTrainer` in a `PooledTrainer` that the joint orchestrator uses
in place of the trainer (same calls: accumulate, values, apply, params, policy_version, checkpoint_state). The
agent's state (params, optimizer state, fp32 gradient accumulator, pending count) lives in a `StateStore`
through a `TrainerResidency`. A LoRA agent's frozen base is not part of that moving state: its base group keeps
one copy on the host and one on each slice where one of its agents trained (`SharedTraining.base_on`).

    activate()     leases a free slice (the agent's last one when free, so nothing moves), brings the state
                   there (from host, or from the slice another agent's state was parked on) and binds the
                   trainer to that slice's mesh (`AgentTrainer.load_swap_state`)
    accumulate()   activates if needed, then adds the micro-batch's gradient; the slice stays held
    release()      hands the state back to the store and frees the slice (the state stays parked on it
                   until another agent needs the slice, then it is offloaded to host: device memory freed)
    apply()        activate, optimizer step, release (no slice needed when nothing was accumulated)

The dispatcher releases its agent's slice whenever the agent has nothing claimable, so with fewer slices
than agents the slices go to whichever agents have micro-batches.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh

from flexmarl_jax.models.lora import AgentAdapter, merge_adapter
from flexmarl_jax.orchestrator.allocation import TrainerResidency
from flexmarl_jax.train.slice_pool import TrainingSlicePool
from flexmarl_jax.train.trainer import AgentTrainer
from flexmarl_jax.transfer import StateStore
from flexmarl_jax.transfer.across_processes import spans_processes

logger = logging.getLogger(__name__)


class PooledTrainer:
    """One agent's trainer whose state moves between the pool's slices; a drop-in for `AgentTrainer`."""

    def __init__(self, shared: SharedTraining, trainer: AgentTrainer):
        self._shared, self._trainer = shared, trainer
        self.agent = trainer.agent
        self.model_config, self.config, self.graphdef = trainer.model_config, trainer.config, trainer.graphdef
        self.base_record = trainer.base_record  # a LoRA agent's checkpoints name their base (train/checkpoint.py)
        self.policy_version = trainer.policy_version
        self.pending_micro_batches = trainer.pending_micro_batches
        self._active = None  # the residency's ActiveState while this agent holds a slice
        self._lock = threading.RLock()  # the dispatcher thread and the orchestrator never overlap; cheap safety

    # ----------------------------------------------------------------------------------- residency
    @property
    def active(self) -> bool:
        return self._active is not None

    @property
    def mesh(self):
        """The mesh of the slice this agent used last (checkpoint metadata)."""
        return self._trainer.mesh

    def activate(self) -> None:
        """Blocks until a slice is leased to this agent and its state is on it (no-op when already active)."""
        with self._lock:
            if self._active is not None:
                return
            active = self._shared.residency.activate(self.agent, timeout=self._shared.acquire_timeout)
            state = active.state
            if self._shared.is_lora(self.agent):  # its group's base, held once per slice, joins the state
                state = {**state, "base": self._shared.base_on(self.agent, active.mesh)}
            self._trainer.load_swap_state(state, mesh=active.mesh)
            active.state = None  # the trainer holds the arrays while active
            self._active = active

    def release(self) -> None:
        """Hands the state back to the store and frees the slice (no-op when not active)."""
        with self._lock:
            if self._active is None:
                return
            self._active = None
            state = self._trainer.swap_state()
            state.pop("base", None)  # stays on the slice for the group (SharedTraining.base_on)
            self._shared.residency.deactivate(self.agent, state)

    # ------------------------------------------------------------------------------- trainer calls
    def accumulate(self, batch) -> None:
        with self._lock:
            self.activate()
            self._trainer.accumulate(batch)
            self.pending_micro_batches = self._trainer.pending_micro_batches

    def values(self, batch):
        """PPO: the critic's values of a micro-batch (activates: they are computed on the slice)."""
        with self._lock:
            self.activate()
            return self._trainer.values(batch)

    def apply(self, *, allow_empty: bool = False) -> dict[str, float]:
        with self._lock:
            if self.pending_micro_batches == 0 and not self.active:
                if not allow_empty:
                    raise RuntimeError(f"agent {self.agent!r}: apply() with no accumulated micro-batch "
                                       "(pass allow_empty=True to only advance policy_version)")
                self.policy_version += 1  # nothing to compute: no slice needed
                return {}
            self.activate()
            try:
                self._trainer.policy_version = self.policy_version
                metrics = self._trainer.apply(allow_empty=allow_empty)
                self.policy_version, self.pending_micro_batches = self._trainer.policy_version, 0
                return metrics
            finally:
                self.release()

    def discard_accumulated(self) -> None:
        with self._lock:
            if self.pending_micro_batches == 0 and not self.active:
                return
            self.activate()
            try:
                self._trainer.discard_accumulated()
                self.pending_micro_batches = 0
            finally:
                self.release()

    def accumulated_gradients(self):
        """The fp32 gradient sum on the slice (only while active)."""
        with self._lock:
            if self._active is None:
                raise RuntimeError(f"agent {self.agent!r} is suspended; its gradients are in the StateStore")
            return self._trainer.accumulated_gradients()

    @property
    def params(self):
        """A host copy (numpy leaves) of the policy parameters: safe to hold while the state moves. Leaves on a
        slice that spans processes stay there (no host holds all of them; across_processes.py)."""
        with self._lock:
            if self._active is not None:
                return jax.tree.map(_host_copy, self._trainer.params)
            state = self._shared.residency.read(self.agent)
            if self._shared.is_lora(self.agent):  # its group's base with its adapter merged
                merged = merge_adapter(self._shared.host_base(self.agent), state["trainable"]["adapters"],
                                       self._trainer.config.lora)
                return jax.tree.map(_host_copy, merged)
            return jax.tree.map(_host_copy, state["trainable"]["policy"])

    @property
    def rollout_weights(self):
        """What a weight sync sends, as a host copy: the policy parameters (`params`), or a LoRA agent's adapter."""
        if not self._shared.is_lora(self.agent):
            return self.params
        with self._lock:
            if self._active is not None:
                return jax.tree.map(_host_copy, self._trainer.rollout_weights)
            adapters = self._shared.residency.read(self.agent)["trainable"]["adapters"]
            return jax.tree.map(_host_copy, AgentAdapter(adapters, self._trainer.config.lora))

    def checkpoint_state(self) -> dict:
        """{"trainable", "opt_state"[, "reference"]} as stored (at an iteration boundary, not active)."""
        with self._lock:
            if self.pending_micro_batches or self._active is not None:
                raise RuntimeError(f"agent {self.agent!r}: checkpoint at an iteration boundary, with the agent "
                                   f"suspended ({self.pending_micro_batches} micro-batches pending)")
            state = self._shared.residency.read(self.agent)
            return {key: state[key] for key in ("trainable", "opt_state", "reference") if key in state}


def _without_base(shardings: dict) -> dict:
    return {name: value for name, value in shardings.items() if name != "base"}


def _host_copy(leaf):
    return leaf if spans_processes(leaf) else np.asarray(leaf)


class DedicatedTraining:
    """Every agent trains on a mesh of its own for the whole run (static binding): one slice per agent.

    The other `TrainingPool`, beside `SharedTraining`; the orchestrator treats both alike."""

    def __init__(self, trainers: Mapping[str, AgentTrainer], *, clock: Callable[[], float] = time.perf_counter):
        self.trainers = dict(trainers)
        self.clock = clock

    @property
    def num_slices(self) -> int:
        return len(self.trainers)

    def usage(self, since: float) -> dict[str, Any]:
        """Nothing beyond the busy accounting the orchestrator does itself: every slice is always held."""
        return {}


class TrainingPool(Protocol):
    """Where the agents' trainers run: `trainers` (agent -> a trainer with `activate`/`release` around its
    micro-batches), `num_slices` training slices, a `clock` and per-iteration `usage` figures."""

    trainers: Mapping[str, Any]

    @property
    def num_slices(self) -> int: ...

    def clock(self) -> float: ...

    def usage(self, since: float) -> dict[str, Any]: ...


class SharedTraining:
    """S training slices shared by any number of agents' trainers (agent-centric allocation).

    trainers: agent -> AgentTrainer (any mesh; its state is registered and offloaded to host here, so the
        trainer must not be used directly afterwards: use ``self.trainers[agent]``).
    slice_meshes: one mesh per slice, over pairwise disjoint devices.
    store: where suspended states live (default a new StateStore).
    offload_tier: "host" or "storage" for suspended states. acquire_timeout: seconds an agent may wait for
        a slice before TimeoutError (None: forever). clock: seconds for the pool's busy accounting.
    """

    def __init__(self, trainers: Mapping[str, AgentTrainer], slice_meshes: Sequence[Mesh], *,
                 store: StateStore | None = None, offload_tier: str = "host",
                 acquire_timeout: float | None = None, clock: Callable[[], float] = time.perf_counter):
        self.clock, self.acquire_timeout = clock, acquire_timeout
        self.pool = TrainingSlicePool(list(slice_meshes), clock=clock)
        self.store = store if store is not None else StateStore()
        self._inner = dict(trainers)
        self.residency = TrainerResidency(
            self.store, self.pool, offload_tier=offload_tier,
            target_for=lambda agent, mesh: _without_base(self._inner[agent].swap_shardings(mesh)))
        # A LoRA base group's frozen base is not part of its agents' moving state: one host copy per group, and
        # one copy on each slice an agent of the group has trained on, kept there (`base_on`).
        self._base_group: dict[str, str] = {}  # LoRA agent -> its group's key (the base its checkpoints record)
        self._host_bases: dict[str, Any] = {}
        self._slice_bases: dict[tuple[str, Mesh], Any] = {}
        self._bases_lock = threading.Lock()
        self.trainers: dict[str, PooledTrainer] = {}
        for agent, trainer in self._inner.items():
            self.trainers[agent] = PooledTrainer(self, trainer)
            state = trainer.swap_state()
            base = state.pop("base", None)
            if base is not None:
                key = json.dumps(trainer.base_record, sort_keys=True)
                self._base_group[agent] = key
                self._host_bases.setdefault(key, jax.tree.map(_host_copy, base))
            self.residency.register(agent, state)  # starts suspended, on host
        logger.info("agent-centric training: %d agents on %d slices", len(self._inner), self.pool.num_slices)

    @property
    def num_slices(self) -> int:
        return self.pool.num_slices

    def is_lora(self, agent: str) -> bool:
        return agent in self._base_group

    def host_base(self, agent: str) -> Any:
        """A LoRA agent's frozen base on the host (its group's one copy)."""
        return self._host_bases[self._base_group[agent]]

    def base_on(self, agent: str, mesh: Mesh) -> Any:
        """A LoRA agent's frozen base on a slice's `mesh`: placed there the first time an agent of its group trains
        on that slice, then shared by the whole group (one base per group per slice, whatever the group's size)."""
        key = (self._base_group[agent], mesh)
        with self._bases_lock:
            if key not in self._slice_bases:
                shardings = self._inner[agent].swap_shardings(mesh)["base"]
                self._slice_bases[key] = jax.device_put(self.host_base(agent), shardings)
            return self._slice_bases[key]

    def usage(self, since: float) -> dict[str, Any]:
        """For the iteration record: the fraction of slice time leased to some agent since `since` (a
        `clock()` reading; includes swaps and waits for micro-batches) and the cumulative move stats."""
        return {"held": self.pool.utilization(since, self.clock()), **self.stats()}

    def stats(self) -> dict[str, Any]:
        """The residency's move counts and seconds (cumulative over the run)."""
        stats = self.residency.stats
        return {"activations": stats.activations, "reused": stats.reused,
                "moved_between_slices": stats.moved_between_slices, "swapped_in": stats.swapped_in,
                "swapped_out": stats.swapped_out, "swap_in_s": stats.swap_in_seconds,
                "swap_out_s": stats.swap_out_seconds}
