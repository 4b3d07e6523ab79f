"""Weight sync (trainer -> rollout instances) through the StateStore, the path trainer swaps use too.

    sync = StoreWeightSync(store, rollout.sync_weights, target_for=lambda agent: rollout_shardings[agent])
    sync(agent, trainer.params, version)

Each sync sets the new params under ``weights/<agent>`` (wherever they are: the trainer's slice, or host
memory for a suspended agent), gets them onto the rollout instances' shardings (packed transfer), keeps
that rollout copy as the stored value (so the store never holds the trainer's arrays past the call, and a
trainer swap-out can free its slice) and hands it to the rollout side, where placing it again is a no-op.

Agents sync concurrently (`JointOrchestrator.sync_all` runs a thread per agent): a lock per agent keeps two
syncs of one agent in order, and none holds one agent's sync behind another's. The StateStore's own lock is
held while a transfer is issued, not while it runs (JAX transfers are asynchronous), so transfers to different
agents' instances overlap on the devices.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from flexmarl_jax import faults
from flexmarl_jax.transfer import StateStore

KEY_PREFIX = "weights/"


class StoreWeightSync:
    """A ``sync_weights(agent, params, version)`` that stages the params through a StateStore.

    push: the rollout side's sync_weights (receives params already on ``target_for(agent)``).
    target_for: agent -> a StateStore.get target (a sharding pytree like the params, a Mesh or a Sharding).
    """

    def __init__(self, store: StateStore, push: Callable[[str, Any, int], None],
                 target_for: Callable[[str], Any]):
        self.store, self.push, self.target_for = store, push, target_for
        self._locks: dict[str, threading.Lock] = {}  # agent -> its syncs' lock (made under _locks_guard)
        self._locks_guard = threading.Lock()
        self.synced: dict[str, int] = {}  # agent -> last version pushed

    def _lock_of(self, agent: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(agent, threading.Lock())

    def key(self, agent: str) -> str:
        return KEY_PREFIX + agent

    def __call__(self, agent: str, params: Any, version: int) -> None:
        faults.raise_if_fired("weight_sync", agent)
        key = self.key(agent)
        with self._lock_of(agent):
            self.store.set(key, params)
            staged = self.store.get(key, self.target_for(agent))
            self.store.set(key, staged)  # drops (never deletes) the trainer's arrays
            self.synced[agent] = int(version)
        self.push(agent, staged, version)

    def served(self, agent: str, target: Any | None = None) -> Any:
        """The weights last synced to ``agent``'s rollout (e.g. for an instance that starts serving it)."""
        return self.store.get(self.key(agent), target)
