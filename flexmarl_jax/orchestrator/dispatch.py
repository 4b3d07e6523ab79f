"""Turns claimed store rows into trainer micro-batches and feeds one agent's trainer.

The loss normaliser of an agent's iteration is fixed before any micro-batch is dispatched (an upper
bound on the agent's rows and tokens that the config determines), and GRPO group statistics only need the
rows of one group (the sink writes each group's advantages when its last reward arrives; a claim holds
whole groups), and PPO's GAE only a row's own reward and the critic, which changes only at the update — so the
accumulated gradient does not depend on how the iteration was cut into micro-batches or in which order they
arrived, up to float rounding: the sums' order is the arrival order, unless `pipeline.deterministic` fixes it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from flexmarl_jax import faults
from flexmarl_jax.metrics import Timeline
from flexmarl_jax.store import ClaimedRows, ExperienceStore
from flexmarl_jax.train.advantages import gae_from_rewards
from flexmarl_jax.train.batch import MicroBatch, build_micro_batch
from flexmarl_jax.train.normalizers import IterationNormalizers
from flexmarl_jax.train.protocol import Trainer

CLAIM_COLUMNS = ("prompt_tokens", "response_tokens", "behaviour_logprobs", "reward", "advantage")


class TrainerFailed(RuntimeError):
    """An agent's trainer raised while training a micro-batch or applying its update. Nothing of the iteration
    was applied when this comes from a micro-batch, so the iteration may be tried again (run.py does, once)."""

    def __init__(self, agent: str, what: str, error: BaseException):
        super().__init__(f"agent {agent!r}: {what} failed: {error!r}")
        self.agent = agent


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


class _EitherSet:
    """Set when any of its events is: the store's claim `until` only asks `is_set()`, and a dispatcher's claim
    must end once the rollout is done or the dispatcher is stopped."""

    def __init__(self, *events: threading.Event):
        self._events = events

    def is_set(self) -> bool:
        return any(event.is_set() for event in self._events)


class AgentDispatcher:
    """Claims an agent's complete groups from the store and accumulates their gradients.

    `drain(rollout_done)` keeps claiming full micro-batches while rollout runs (the asynchronous pipeline)
    and, once `rollout_done` is set, the remaining groups as a last partial micro-batch. An `ordered`
    dispatcher waits for the rollout, then cuts every row into micro-batches in group-id order.
    With PPO each micro-batch gets its GAE advantages from the critic before its gradient step.
    """

    def __init__(self, agent: str, trainer: Trainer, store: ExperienceStore, *, micro_batch_size: int,
                 normalizers: IterationNormalizers, aggregation: str, pad_id: int,
                 max_staleness: int, variable_groups: bool, timeline: Timeline, resource: str,
                 on_trained: Callable[[list[str], str, Mapping[str, int]], None] | None = None,
                 ordered: bool = False, on_progress: Callable[[str], None] | None = None,
                 stop: threading.Event | None = None):
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
        # `pipeline.deterministic`: train after the rollout, micro-batches cut in group-id order.
        self.ordered = ordered
        self.on_progress = on_progress  # told after every micro-batch (the run's liveness beacon)
        # Set when the iteration is being given up (another agent's trainer failed, a stop was asked for):
        # the dispatcher claims nothing more, so its thread ends at its next claim.
        self.stop = stop if stop is not None else threading.Event()
        # Every claim this dispatcher holds, from the moment it is claimed: committed after the update or
        # released when the iteration fails, even when training the claim is what failed.
        self.claimed: list[ClaimedRows] = []
        self._claims_lock = threading.Lock()
        self._released = False  # release_all ran: a claim that returns later is given back at once

    def _to_micro_batch(self, columns: Mapping[str, list]):
        """The micro-batch of some rows (CLAIM_COLUMNS -> one value per row; rows with an empty response are
        left out) and the rewards of the rows it holds."""
        keep = [i for i, response in enumerate(columns["response_tokens"]) if len(response) > 0]
        pick = lambda column: [columns[column][i] for i in keep]  # noqa: E731
        batch = build_micro_batch(
            agent=self.agent, prompt_ids=pick("prompt_tokens"), response_ids=pick("response_tokens"),
            behaviour_logprobs=pick("behaviour_logprobs"), advantages=[float(a) for a in pick("advantage")],
            normalizers=self.normalizers, aggregation=self.aggregation,
            batch_size=self.micro_batch_size, max_len=self.trainer.config.max_len, pad_id=self.pad_id,
        )
        return batch, np.asarray(pick("reward"), np.float32)

    def _with_gae(self, batch: MicroBatch, rewards: np.ndarray) -> MicroBatch:
        """PPO: the batch with GAE advantages and returns from its rows' rewards (on each row's last response
        token) and the critic's values. The critic changes only when the iteration's update is applied, so these
        are the values of the iteration's start, as if computed for every row before the first micro-batch."""
        loss = self.trainer.config.loss
        values = self.trainer.values(batch)
        advantages, returns = gae_from_rewards(rewards, values, batch.loss_mask, gamma=loss.gamma,
                                               lam=loss.gae_lambda)
        return batch.replace(advantages=advantages, returns=returns,
                             old_values=np.where(batch.loss_mask, values, 0.0).astype(np.float32))

    def _train_rows(self, sample_ids: Sequence[str], columns: Mapping[str, list],
                    current_versions: Mapping[str, int], stats: DispatchStats) -> None:
        """Accumulates the gradient of one micro-batch of rows (columns: CLAIM_COLUMNS -> one value per row)."""
        if self.on_trained is not None:
            self.on_trained(list(sample_ids), self.agent, current_versions)
        batch, kept_rewards = self._to_micro_batch(columns)
        try:
            self.trainer.activate()  # may wait for a free slice: not training time
            with self.timeline.busy(self.resource, "train", agent=self.agent):
                if self.trainer.config.loss.needs_values:
                    batch = self._with_gae(batch, kept_rewards)
                faults.raise_if_fired("trainer_error", self.agent)
                self.trainer.accumulate(batch)
                jax.block_until_ready(self.trainer.accumulated_gradients())  # the interval is compute, not dispatch
        except Exception as error:
            raise TrainerFailed(self.agent, f"training a micro-batch of {len(sample_ids)} rows", error) from error
        if self.on_progress is not None:
            self.on_progress(f"micro-batch of {self.agent}")
        stats.micro_batches += 1
        stats.rows += len(sample_ids)
        stats.rewards.extend(float(reward) for reward in columns["reward"])
        for logprobs in columns["behaviour_logprobs"]:
            stats.neg_logprob_sum -= float(np.sum(logprobs))
            stats.tokens += len(logprobs)

    def train_claimed(self, rows: ClaimedRows, current_versions: Mapping[str, int], stats: DispatchStats) -> None:
        """Trains one claim as one micro-batch. The claim is kept first: if training it fails, `release_all`
        still gives it back. A claim that arrives after the dispatcher was stopped is given back untrained."""
        if self._keep(rows):
            self._train_rows(rows.sample_ids, rows.columns, current_versions, stats)

    def _keep(self, rows: ClaimedRows) -> bool:
        """Adds a new claim to `claimed`; once stopped or released, gives it back instead and returns False."""
        with self._claims_lock:
            if self._released or self.stop.is_set():
                self.store.release(rows)
                return False
            self.claimed.append(rows)
            return True

    def drain(self, current_versions: Mapping[str, int], rollout_done: threading.Event, stats: DispatchStats,
              *, iteration_start: float, poll_s: float = 5.0) -> None:
        """Claims and trains until rollout is done and nothing claimable is left (in order: see `ordered`)."""
        try:
            if self.ordered:
                self._drain_in_order(current_versions, rollout_done, stats, iteration_start=iteration_start)
            else:
                self._drain(current_versions, rollout_done, stats, iteration_start=iteration_start, poll_s=poll_s)
        finally:
            self.trainer.release()

    def _drain_in_order(self, current_versions, rollout_done, stats, *, iteration_start: float) -> None:
        """Once rollout is done, claims every row and trains them in micro-batches cut in (group id, sample id)
        order: which rows share a micro-batch, and the order the gradient sums add up in, then depend on the
        rows alone, not on when each group finished or how the store's claims fell."""
        while not rollout_done.wait(timeout=1.0):
            if self.stop.is_set():
                return
        claims = []
        while (rows := self.store.claim_micro_batch(
                self.agent, self.micro_batch_size, current_versions=dict(current_versions),
                max_staleness=self.max_staleness, columns=CLAIM_COLUMNS, allow_partial=True, timeout=0)) is not None:
            claims.append(rows)
        if not all([self._keep(claim) for claim in claims]) or not claims:  # kept: committed or released
            return
        stats.first_claim_s = self.timeline.now() - iteration_start
        order = sorted((claim.group_ids[claim.group_index[row]], claim.sample_ids[row], index, row)
                       for index, claim in enumerate(claims) for row in range(len(claim)))
        for start in range(0, len(order), self.micro_batch_size):
            if self.stop.is_set():
                return
            chunk = [(claims[index], row) for *_, index, row in order[start:start + self.micro_batch_size]]
            self._train_rows([claim.sample_ids[row] for claim, row in chunk],
                             {name: [claim.columns[name][row] for claim, row in chunk] for name in CLAIM_COLUMNS},
                             current_versions, stats)

    def _drain(self, current_versions, rollout_done, stats, *, iteration_start: float, poll_s: float) -> None:
        since = None  # set when the last claim left less than a micro-batch: wait for new rows first
        while not self.stop.is_set():
            finished = rollout_done.is_set()  # read before claiming: rows can only be added before it
            # While rollout runs, a claim blocks until an append makes a micro-batch claimable or rollout
            # ends (the store's `until` + `wake_claims`); `poll_s` is only a safety net. Groups of a
            # conditional agent vary in size: take whole groups, but only a full micro-batch's worth.
            rows = self.store.claim_micro_batch(
                self.agent, self.micro_batch_size, current_versions=dict(current_versions),
                max_staleness=self.max_staleness, columns=CLAIM_COLUMNS,
                allow_partial=finished or self.variable_groups,
                min_rows=self.micro_batch_size if self.variable_groups and not finished else None,
                timeout=0 if finished else poll_s, until=None if finished else _EitherSet(rollout_done, self.stop),
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
        with self._claims_lock:
            self._released = True
            for rows in self.claimed:
                self.store.release(rows)
            self.claimed.clear()
        self.trainer.discard_accumulated()
