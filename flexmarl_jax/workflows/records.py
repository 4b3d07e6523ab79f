"""What the executor hands to the experience store: one record per agent call, then rewards.

Protocol between the executor and a sink (all calls come from the thread that runs the executor):
  1. `add_calls(records)` as soon as a call's completions exist (reward not known yet).
  2. `close_group(agent, group_id, size)` once the group can no longer grow: every trajectory of that query
     has either made or skipped that node's call. `size` is the number of rows the group really has; it is
     below `samples_per_query` when a conditional edge skipped some trajectories (the chain's corrector),
     and groups with no rows are not reported. All `size` records were added before this call.
  3. `set_rewards(agent, sample_ids, rewards)` when a trajectory finishes (may come before or after the
     `close_group` of the groups its rows belong to). A group is complete for GRPO when it is closed and
     every one of its `size` rows has a reward.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol


def make_sample_id(input_id: str, turn: int, trajectory_id: int) -> str:
    return f"{input_id}_{turn}_{trajectory_id}"


def make_group_id(input_id: str, turn: int) -> str:
    """One GRPO group per (agent, input, turn): the samples one agent produced for the same input and turn."""
    return f"{input_id}_{turn}"


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One agent call of one trajectory. Token fields: prompt_token_ids [prompt_len], token_ids and
    logprobs [response_len] (behaviour log-probs from the generating engine)."""

    sample_id: str
    input_id: str
    turn: int
    trajectory_id: int
    agent: str
    node: str
    group_id: str
    prompt: str
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    policy_version: int
    # agent -> policy version of every upstream (ancestor) call this one saw; the oldest if an agent
    # appears more than once, so staleness checks stay conservative.
    upstream_policy_versions: Mapping[str, int]


class ExperienceSink(Protocol):
    def add_calls(self, records: Sequence[CallRecord]) -> None: ...

    def close_group(self, agent: str, group_id: str, size: int) -> None: ...

    def set_rewards(self, agent: str, sample_ids: Sequence[str], rewards: Sequence[float]) -> None: ...


class InMemorySink:
    """Keeps everything in dicts; for tests, the bench and quick experiments."""

    def __init__(self):
        self._lock = threading.Lock()
        self.records: dict[tuple[str, str], CallRecord] = {}  # (agent, sample_id) -> record
        self.rewards: dict[tuple[str, str], float] = {}
        self.group_sizes: dict[tuple[str, str], int] = {}  # (agent, group_id) -> closed size
        self.events: list[tuple[str, str, str]] = []  # (kind, agent, id) in arrival order

    def add_calls(self, records: Sequence[CallRecord]) -> None:
        with self._lock:
            for record in records:
                key = (record.agent, record.sample_id)
                if key in self.records:
                    raise ValueError(f"duplicate sample id {record.sample_id!r} for agent {record.agent!r}")
                self.records[key] = record
                self.events.append(("add", record.agent, record.sample_id))

    def close_group(self, agent: str, group_id: str, size: int) -> None:
        with self._lock:
            self.group_sizes[(agent, group_id)] = size
            self.events.append(("close", agent, group_id))

    def set_rewards(self, agent: str, sample_ids: Sequence[str], rewards: Sequence[float]) -> None:
        with self._lock:
            for sample_id, reward in zip(sample_ids, rewards, strict=True):
                self.rewards[(agent, sample_id)] = float(reward)
                self.events.append(("reward", agent, sample_id))

    def group_rows(self, agent: str, group_id: str) -> list[CallRecord]:
        with self._lock:
            return sorted(
                (r for (a, _), r in self.records.items() if a == agent and r.group_id == group_id),
                key=lambda r: r.trajectory_id,
            )

    def complete_groups(self, agent: str) -> list[str]:
        """Groups that are closed and whose every row has a reward."""
        with self._lock:
            complete = []
            for (group_agent, group_id), size in self.group_sizes.items():
                rows = [key for key, r in self.records.items() if key[0] == agent and r.group_id == group_id]
                if group_agent == agent and len(rows) == size and all(key in self.rewards for key in rows):
                    complete.append(group_id)
            return sorted(complete)
