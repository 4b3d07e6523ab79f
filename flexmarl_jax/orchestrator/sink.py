"""Streams workflow agent calls into the experience store (the `ExperienceSink` the executor writes to).

A GRPO group is appended once the workflow closes it (its final size is then known: a conditional node
such as the corrector runs for only some trajectories), so the store can tell a complete group from a
partial one. Rewards arrive as trajectories finish; when the last reward of a group is in, the group's
rewards and advantages are written together and its rows become READY (claimable).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence

import numpy as np

from flexmarl_jax.store import ExperienceStore
from flexmarl_jax.workflows.records import CallRecord

AdvantageFn = Callable[[np.ndarray], np.ndarray]  # rewards [group] -> advantages [group]


class _Group:
    def __init__(self, agent: str, records: list[CallRecord]):
        self.agent, self.records = agent, records
        self.rewards: dict[str, float] = {}
        self.appended = False

    def complete(self) -> bool:
        return self.appended and len(self.rewards) == len(self.records)


class StoreSink:
    """Maps `CallRecord`s to store rows; thread-safe (the executor calls it from its callback threads).

    Args:
      advantage_fn: the group-relative advantage estimator, applied to each complete group's rewards.
      on_generated: told about every row as it is appended, with the versions it depends on (the
        invariant checker uses it).
      hold: keep closed groups out of the store until `release_held()` (a rollout running ahead of training
        must not feed the current iteration's claims).
    """

    def __init__(self, store: ExperienceStore, advantage_fn: AdvantageFn, *,
                 on_generated: Callable[[CallRecord, dict], None] | None = None, hold: bool = False):
        self.store, self.advantage_fn = store, advantage_fn
        self._on_generated = on_generated
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], list[CallRecord]] = collections.defaultdict(list)
        self._groups: dict[tuple[str, str], _Group] = {}  # closed groups, by (agent, group_id)
        self._group_of: dict[tuple[str, str], _Group] = {}  # (agent, sample_id) -> its closed group
        self._early_rewards: dict[tuple[str, str], float] = {}  # rewards of calls whose group is still open
        self._holding = hold
        self._held: list[_Group] = []
        self.rows_appended: collections.Counter[str] = collections.Counter()

    @staticmethod
    def versions_of(record: CallRecord) -> dict[str, int]:
        """Every version the row depends on: its upstream agents' and its own."""
        versions = dict(record.upstream_policy_versions)
        versions[record.agent] = min(record.policy_version, versions.get(record.agent, record.policy_version))
        return versions

    # ---------------------------------------------------------------------------- ExperienceSink protocol
    def add_calls(self, records: Sequence[CallRecord]) -> None:
        with self._lock:
            for record in records:
                self._open[(record.agent, record.group_id)].append(record)

    def close_group(self, agent: str, group_id: str, size: int) -> None:
        with self._lock:
            records = self._open.pop((agent, group_id), [])
            if len(records) != size:
                raise ValueError(f"group {group_id!r} of {agent!r} closed with size {size} but "
                                 f"{len(records)} calls were added")
            if not records:
                return
            group = _Group(agent, records)
            self._groups[(agent, group_id)] = group
            for record in records:
                self._group_of[(agent, record.sample_id)] = group
                reward = self._early_rewards.pop((agent, record.sample_id), None)
                if reward is not None:
                    group.rewards[record.sample_id] = reward
            if self._holding:
                self._held.append(group)
            else:
                self._append(group)

    def set_rewards(self, agent: str, sample_ids: Sequence[str], rewards: Sequence[float]) -> None:
        with self._lock:
            touched = {}
            for sample_id, reward in zip(sample_ids, rewards, strict=True):
                group = self._group_of.get((agent, sample_id))
                if group is None:
                    self._early_rewards[(agent, sample_id)] = float(reward)
                else:
                    group.rewards[sample_id] = float(reward)
                    touched[id(group)] = group
            for group in touched.values():
                self._finish_if_complete(group)

    # ------------------------------------------------------------------------------------------- internal
    def release_held(self) -> None:
        """Appends every held group and stops holding."""
        with self._lock:
            self._holding = False
            held, self._held = self._held, []
            for group in held:
                self._append(group)

    def _append(self, group: _Group) -> None:
        records = group.records
        versions = [self.versions_of(r) for r in records]
        dependencies = sorted({a for v in versions for a in v})
        self.store.append_rows(
            group.agent,
            input_ids=[r.input_id for r in records],
            trajectory_ids=[r.trajectory_id for r in records],
            turns=[r.turn for r in records],
            group_ids=[r.group_id for r in records],
            group_size=len(records),
            policy_versions={a: [v.get(a, -1) for v in versions] for a in dependencies},
            columns={
                "prompt_tokens": [np.asarray(r.prompt_token_ids, np.int32) for r in records],
                "response_tokens": [np.asarray(r.token_ids, np.int32) for r in records],
                "behaviour_logprobs": [np.asarray(r.logprobs, np.float32) for r in records],
            },
        )
        group.appended = True
        self.rows_appended[group.agent] += len(records)
        if self._on_generated is not None:
            for record, record_versions in zip(records, versions, strict=True):
                self._on_generated(record, record_versions)
        self._finish_if_complete(group)

    def _finish_if_complete(self, group: _Group) -> None:
        if not group.complete():
            return
        sample_ids = [r.sample_id for r in group.records]
        rewards = np.asarray([group.rewards[s] for s in sample_ids], np.float32)
        advantages = np.asarray(self.advantage_fn(rewards), np.float32)
        self.store.set_columns(group.agent, sample_ids, {"reward": rewards, "advantage": advantages})
        for sample_id in sample_ids:
            del self._group_of[(group.agent, sample_id)]
        del self._groups[(group.agent, group.records[0].group_id)]

    def unfinished(self) -> dict[str, int]:
        """Calls not yet in a complete group, per agent (empty after a clean rollout)."""
        with self._lock:
            counts = collections.Counter(agent for agent, _ in self._open)
            counts.update(group.agent for group in self._groups.values())
            counts.update(agent for agent, _ in self._early_rewards)
            return dict(counts)
