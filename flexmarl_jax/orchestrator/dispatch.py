"""Turns claimed store rows into trainer micro-batches and feeds one agent's trainer.

The loss normaliser of an agent's iteration is fixed before any micro-batch is dispatched (an upper
bound on the agent's rows and tokens that the config determines), and GRPO group statistics only need the
rows of one group (the sink writes each group's advantages when its last reward arrives; a claim holds
whole groups) — so the accumulated gradient does not depend on how the iteration was cut into
micro-batches or in which order they arrived.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping

import jax
import numpy as np

from flexmarl_jax.metrics import Timeline
from flexmarl_jax.store import ClaimedRows, ExperienceStore
from flexmarl_jax.train.batch import build_micro_batch
from flexmarl_jax.train.normalizers import IterationNormalizers
from flexmarl_jax.train.trainer import AgentTrainer

CLAIM_COLUMNS = ("prompt_tokens", "response_tokens", "behaviour_logprobs", "reward", "advantage")


@dataclasses.dataclass
class DispatchStats:
    """What one agent's dispatcher did in one iteration."""

    micro_batches: int = 0
    rows: int = 0
    rewards: list = dataclasses.field(default_factory=list)
    # Sum of -log p of the sampled tokens: an unbiased estimate of the policy's entropy per token.
    neg_logprob_sum: float = 0.0
    tokens: int = 0
    first_claim_s: float | None = None  # seconds after the iteration started


class AgentDispatcher:
    """Claims an agent's complete groups from the store and accumulates their gradients.

    `drain(rollout_done)` keeps claiming full micro-batches while rollout runs (the asynchronous pipeline)
    and, once `rollout_done` is set, the remaining groups as a last partial micro-batch.
    """

    def __init__(self, agent: str, trainer: AgentTrainer, store: ExperienceStore, *, micro_batch_size: int,
                 normalizers: IterationNormalizers, aggregation: str, pad_id: int,
                 max_staleness: int, variable_groups: bool, timeline: Timeline, resource: str,
                 on_trained: Callable[[list[str], str, Mapping[str, int]], None] | None = None):
        # The trainer's activate() holds training devices and release() frees them whenever the agent has
        # nothing claimable: no-ops for a dedicated trainer; a shared slice for agent-centric allocation.
        self.agent, self.trainer, self.store = agent, trainer, store
        self.micro_batch_size = micro_batch_size
        self.normalizers, self.aggregation = normalizers, aggregation
        self.pad_id, self.max_staleness = pad_id, max_staleness
        # A conditional node's groups have varying sizes, so claims take whole groups up to the size.
        self.variable_groups = variable_groups
        self.timeline, self.resource = timeline, resource
        self.on_trained = on_trained
        self.claimed: list[ClaimedRows] = []

    def _to_micro_batch(self, rows: ClaimedRows):
        rewards = np.asarray(rows.columns["reward"], np.float32)
        advantages = np.asarray(rows.columns["advantage"], np.float32)
        keep = [i for i, response in enumerate(rows.columns["response_tokens"]) if len(response) > 0]
        pick = lambda column: [rows.columns[column][i] for i in keep]  # noqa: E731
        return build_micro_batch(
            agent=self.agent, prompt_ids=pick("prompt_tokens"), response_ids=pick("response_tokens"),
            behaviour_logprobs=pick("behaviour_logprobs"), advantages=[float(advantages[i]) for i in keep],
            normalizers=self.normalizers, aggregation=self.aggregation,
            batch_size=self.micro_batch_size, max_len=self.trainer.config.max_len, pad_id=self.pad_id,
        ), rewards

    def train_claimed(self, rows: ClaimedRows, current_versions: Mapping[str, int], stats: DispatchStats) -> None:
        if self.on_trained is not None:
            self.on_trained(list(rows.sample_ids), self.agent, current_versions)
        batch, rewards = self._to_micro_batch(rows)
        self.trainer.activate()  # may wait for a free slice: not training time
        with self.timeline.busy(self.resource, "train", agent=self.agent):
            self.trainer.accumulate(batch)
            jax.block_until_ready(self.trainer.accumulated_gradients())  # the interval is compute, not dispatch
        self.claimed.append(rows)
        stats.micro_batches += 1
        stats.rows += len(rows)
        stats.rewards.extend(rewards.tolist())
        for logprobs in rows.columns["behaviour_logprobs"]:
            stats.neg_logprob_sum -= float(np.sum(logprobs))
            stats.tokens += len(logprobs)

    def drain(self, current_versions: Mapping[str, int], rollout_done: threading.Event, stats: DispatchStats,
              *, iteration_start: float, poll_s: float = 5.0) -> None:
        """Claims and trains until rollout is done and nothing claimable is left."""
        try:
            self._drain(current_versions, rollout_done, stats, iteration_start=iteration_start, poll_s=poll_s)
        finally:
            self.trainer.release()

    def _drain(self, current_versions, rollout_done, stats, *, iteration_start: float, poll_s: float) -> None:
        since = None  # set when the last claim left less than a micro-batch: wait for new rows first
        while True:
            finished = rollout_done.is_set()  # read before claiming: rows can only be added before it
            # While rollout runs, a claim blocks until an append makes a micro-batch claimable or rollout
            # ends (the store's `until` + `wake_claims`); `poll_s` is only a safety net. Groups of a
            # conditional agent vary in size: take whole groups, but only a full micro-batch's worth.
            rows = self.store.claim_micro_batch(
                self.agent, self.micro_batch_size, current_versions=dict(current_versions),
                max_staleness=self.max_staleness, columns=CLAIM_COLUMNS,
                allow_partial=finished or self.variable_groups,
                min_rows=self.micro_batch_size if self.variable_groups and not finished else None,
                timeout=0 if finished else poll_s, until=None if finished else rollout_done,
                since=None if finished else since)
            if rows is None:
                self.trainer.release()  # nothing claimable now: another agent may use the slice
                if finished:
                    return
                continue
            since = rows.table_changes if rows.claimable_after < self.micro_batch_size else None
            if stats.first_claim_s is None:
                stats.first_claim_s = self.timeline.now() - iteration_start
            self.train_claimed(rows, current_versions, stats)
            if finished and rows.claimable_after == 0:
                return  # every row is in the store once rollout is done, and none is left to claim

    def commit(self) -> int:
        """After the update is applied: the iteration's rows are consumed (durably); returns the count."""
        consumed = self.store.mark_consumed(self.claimed) if self.claimed else 0
        self.claimed.clear()
        return consumed

    def release_all(self) -> None:
        """The iteration failed before its update: give every claim back, drop the gradients."""
        for rows in self.claimed:
            self.store.release(rows)
        self.claimed.clear()
        self.trainer.discard_accumulated()
