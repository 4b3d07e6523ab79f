"""Streams workflow agent calls into the experience store (the `ExperienceSink` the executor writes to).

A GRPO group is complete once the workflow has closed it (its final size is then known: a conditional
node such as the corrector runs for only some trajectories) and every row has its reward. Complete groups
go to the store from a writer thread, batched (one append per agent and group size, carrying rewards and
advantages), so store latency never delays the rollout and the store sees few, large transactions.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from flexmarl_jax.store import ExperienceStore
from flexmarl_jax.workflows.records import CallRecord

AdvantageFn = Callable[[np.ndarray], np.ndarray]  # rewards [group] -> advantages [group]


class _Group:
    def __init__(self, agent: str, records: list[CallRecord]):
        self.agent, self.records = agent, records
        self.rewards: dict[str, float] = {}
        self.completed_at = 0.0  # time.monotonic() when its last reward arrived

    def complete(self) -> bool:
        return len(self.rewards) == len(self.records)


class StoreSink:
    """Maps `CallRecord`s to store rows; thread-safe (the executor calls it from its callback threads).

    Args:
      advantage_fn: the group-relative advantage estimator, applied to each complete group's rewards.
      on_generated: told about every row just before it enters the store, with the versions it depends on
        (the invariant checker uses it).
      hold: keep complete groups out of the store until `release_held()` (a rollout running ahead of
        training must not feed the current iteration's claims).
      rows_per_write: write an agent's complete groups once they hold this many rows (its trainer's micro-
        batch: fewer rows are not claimable before the rollout ends anyway), or once the oldest has waited
        `max_delay_s`; `flush()` writes everything.
    Call `flush()` before declaring the rollout finished, and `close()` when done with the sink.
    """

    def __init__(self, store: ExperienceStore, advantage_fn: AdvantageFn, *, rows_per_write: int,
                 on_generated: Callable[[CallRecord, dict], None] | None = None, hold: bool = False,
                 max_delay_s: float = 0.5):
        self.store, self.advantage_fn = store, advantage_fn
        self.rows_per_write, self.max_delay_s = rows_per_write, max_delay_s
        self._on_generated = on_generated
        self._cond = threading.Condition()
        self._open: dict[tuple[str, str], list[CallRecord]] = collections.defaultdict(list)
        self._closed: dict[tuple[str, str], _Group] = {}  # closed groups still missing rewards
        self._group_of: dict[tuple[str, str], _Group] = {}  # (agent, sample_id) -> its closed group
        self._early_rewards: dict[tuple[str, str], float] = {}  # rewards of calls whose group is still open
        self._to_write: list[_Group] = []
        self._writing = False
        self._holding = hold
        self._stopping = False
        self._flushing = False
        self._error: BaseException | None = None
        self._writer = threading.Thread(target=self._write_loop, name="store-sink", daemon=True)
        self._writer.start()

    @staticmethod
    def versions_of(record: CallRecord) -> dict[str, int]:
        """Every version the row depends on: its upstream agents' and its own."""
        versions = dict(record.upstream_policy_versions)
        versions[record.agent] = min(record.policy_version, versions.get(record.agent, record.policy_version))
        return versions

    # ---------------------------------------------------------------------------- ExperienceSink protocol
    def add_calls(self, records: Sequence[CallRecord]) -> None:
        with self._cond:
            for record in records:
                self._open[(record.agent, record.group_id)].append(record)

    def close_group(self, agent: str, group_id: str, size: int) -> None:
        with self._cond:
            records = self._open.pop((agent, group_id), [])
            if len(records) != size:
                raise ValueError(f"group {group_id!r} of {agent!r} closed with size {size} but "
                                 f"{len(records)} calls were added")
            if not records:
                return
            # Calls arrive in completion order; the group's advantages (float sums over its rewards) and its rows'
            # order in the store should depend on the samples alone (`pipeline.deterministic`).
            records.sort(key=lambda record: record.trajectory_id)
            group = _Group(agent, records)
            for record in records:
                reward = self._early_rewards.pop((agent, record.sample_id), None)
                if reward is not None:
                    group.rewards[record.sample_id] = reward
                else:
                    self._group_of[(agent, record.sample_id)] = group
            self._closed[(agent, group_id)] = group
            self._enqueue_if_complete(group)

    def set_rewards(self, agent: str, sample_ids: Sequence[str], rewards: Sequence[float]) -> None:
        with self._cond:
            for sample_id, reward in zip(sample_ids, rewards, strict=True):
                group = self._group_of.pop((agent, sample_id), None)
                if group is None:
                    self._early_rewards[(agent, sample_id)] = float(reward)
                else:
                    group.rewards[sample_id] = float(reward)
                    self._enqueue_if_complete(group)

    # ------------------------------------------------------------------------------------------ control
    def release_held(self) -> None:
        """Stops holding: complete groups (held so far and later) go to the store; returns once the held
        ones are written."""
        with self._cond:
            self._holding = False
            self._cond.notify_all()
        self.flush()

    def flush(self) -> None:
        """Waits until every complete group is in the store (unless held); raises a writer failure."""
        with self._cond:
            self._flushing = True
            self._cond.notify_all()
            while (self._to_write and not self._holding or self._writing) and self._error is None:
                self._cond.wait()
            self._flushing = False
            if self._error is not None:
                raise RuntimeError(f"writing experience to the store failed: {self._error}") from self._error

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._writer.join()

    def unfinished(self) -> dict[str, int]:
        """Calls not yet in the store, per agent (empty after a clean, flushed rollout)."""
        with self._cond:
            counts = collections.Counter(agent for agent, _ in self._open)
            counts.update(group.agent for group in self._closed.values())
            counts.update(agent for agent, _ in self._early_rewards)
            counts.update(group.agent for group in self._to_write)
            return dict(counts)

    # ------------------------------------------------------------------------------------------ internal
    def _enqueue_if_complete(self, group: _Group) -> None:
        if group.complete():
            del self._closed[(group.agent, group.records[0].group_id)]
            group.completed_at = time.monotonic()
            self._to_write.append(group)
            self._cond.notify_all()

    def _take_due(self) -> tuple[list[_Group], float | None]:
        """(groups to write now, seconds until more fall due or None). Call with the lock held."""
        if self._flushing or self._stopping:
            return self._to_write, None
        rows: collections.Counter = collections.Counter()
        oldest: dict[str, float] = {}
        for group in self._to_write:
            rows[group.agent] += len(group.records)
            oldest.setdefault(group.agent, group.completed_at)
        now = time.monotonic()
        due = {agent for agent in rows
               if rows[agent] >= self.rows_per_write or now - oldest[agent] >= self.max_delay_s}
        waits = [oldest[agent] + self.max_delay_s - now for agent in rows if agent not in due]
        return [g for g in self._to_write if g.agent in due], (min(waits) if waits else None)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopping and (self._holding or not self._to_write):
                        return
                    if not self._holding and self._to_write:
                        batch, wait_s = self._take_due()
                        if batch:
                            break
                        self._cond.wait(timeout=wait_s)
                    else:
                        self._cond.wait()
                taken = {id(group) for group in batch}
                self._to_write = [group for group in self._to_write if id(group) not in taken]
                self._writing = True
            try:
                self._write(batch)
            except BaseException as error:  # surfaced by flush()
                with self._cond:
                    self._error = error
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, groups: list[_Group]) -> None:
        """One append per (agent, group size, dependencies) with every row's data, reward and advantage.

        Rows of one append share the set of agents they depend on: an agent's groups of different turns
        may depend on different agents (a debater's first round only on itself, later rounds on every
        debater), and the store records a version for every dependency of every row of an append.
        """
        by_key: dict[tuple[str, int, tuple[str, ...]], list[_Group]] = collections.defaultdict(list)
        versions_by_id: dict[int, list[dict[str, int]]] = {}  # id(group) -> each record's versions
        for group in groups:
            versions_by_id[id(group)] = [self.versions_of(r) for r in group.records]
            dependencies = tuple(sorted({a for v in versions_by_id[id(group)] for a in v}))
            by_key[(group.agent, len(group.records), dependencies)].append(group)
        for (agent, group_size, dependencies), same in by_key.items():
            records = [r for group in same for r in group.records]
            group_rewards = [np.asarray([g.rewards[r.sample_id] for r in g.records], np.float32) for g in same]
            rewards = np.concatenate(group_rewards)
            advantages = np.concatenate([np.asarray(self.advantage_fn(r), np.float32) for r in group_rewards])
            versions = [v for group in same for v in versions_by_id[id(group)]]
            if self._on_generated is not None:  # before the rows become claimable
                for record, record_versions in zip(records, versions, strict=True):
                    self._on_generated(record, record_versions)
            self.store.append_rows(
                agent,
                input_ids=[r.input_id for r in records],
                trajectory_ids=[r.trajectory_id for r in records],
                turns=[r.turn for r in records],
                group_ids=[r.group_id for r in records],
                group_size=group_size,
                policy_versions={a: [v.get(a, -1) for v in versions] for a in dependencies},
                columns={
                    "prompt_tokens": [np.asarray(r.prompt_token_ids, np.int32) for r in records],
                    "response_tokens": [np.asarray(r.token_ids, np.int32) for r in records],
                    "behaviour_logprobs": [np.asarray(r.logprobs, np.float32) for r in records],
                    "reward": rewards,
                    "advantage": advantages,
                },
            )
