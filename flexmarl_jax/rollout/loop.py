"""The in-process continuous-batching rollout loop over the Engine API.

Like MaxText's offline engine, it calls `prefill` / `insert` / `generate` directly
(no JetStream Driver threads). Each `step()`:

1. admits queued work into free slots: the head request, together with queued requests
   of the same prompt bucket (up to the largest `prefill_batch_sizes`), is prefilled in
   one call, and each prompt's samples go into as many free slots as there are (one
   prefill per prompt however many samples; the prefix is kept until all of a prompt's
   samples have a slot);
2. dispatches one `generate` for the slots up to the highest occupied one (one token per slot; an engine
   may return several per call on the Engine API's speculation axis, `valid` marking them, as the emulated engine does);
3. processes the *previous* step's results (one device-to-host copy), so host
   bookkeeping overlaps the device computing the current step. A slot whose sequence
   finished at step k still runs in step k+1 (its output is ignored), then is refilled.

A sequence finishes on a stop token (kept in the output with its log-prob, finish
reason "stop"), on a stop string or a match of the stop pattern, or after `max_new_tokens` ("length"). A request
completes when all of its samples have; its `on_done` callback then receives one
`SequenceResult` per sample, in sample order. A request with `on_tokens` also hears of every token as its step's
results are processed (one `TokenEvent` per sample and step), which is what streaming needs.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from flexmarl_jax.rollout.engine import FlexEngine, Prefix
from flexmarl_jax.rollout.engine_tokenizer import pad_prompt
from flexmarl_jax.rollout.requests import STOP_PATTERN_TOKENS, RolloutRequest, SequenceResult, TokenEvent

__all__ = ["STOP_PATTERN_TOKENS", "RolloutLoop", "RolloutRequest", "SequenceResult", "TokenEvent"]

logger = logging.getLogger(__name__)

@dataclasses.dataclass(eq=False)
class _Sequence:
    """Mutable state of one sample while it is queued or decoding."""

    work: _Work
    sample_index: int
    slot: int = -1
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    policy_version: int = -1
    finish_reason: str | None = None


@dataclasses.dataclass(eq=False)
class _Work:
    """A submitted request plus the samples still waiting for a slot."""

    ticket: int
    request: RolloutRequest
    prompt_ids: tuple[int, ...]  # after truncation, if the engine config truncates
    padded_prompt: np.ndarray
    true_length: int
    waiting: collections.deque  # of _Sequence not yet in a slot
    results: dict  # sample_index -> SequenceResult
    prefix: Prefix | None = None  # kept while samples still wait for a slot (share_prefill)
    prefix_row: int = 0  # this prompt's row in `prefix`
    prefix_version: int = -1
    adapter: int = 0  # the row of the engine's adapter table its samples decode with
    cancelled: bool = False
    pending_done: list | None = None  # every sample's result, until on_done is delivered


class RolloutLoop:
    """Continuous batching of many requests over one FlexEngine.

    Not thread-safe by itself: one thread calls `submit`/`step` (EngineInstance adds the
    locking and the thread). `params`/`policy_version` may be replaced between steps with
    `set_params`; callers are responsible for never doing so while sequences decode
    (EngineInstance enforces that). With `AdaptedParams` (several LoRA agents of one base), one row of the
    adapter table may be replaced with `set_adapter` while sequences of the other rows decode; each row has its
    own policy version, which its sequences report.
    """

    def __init__(self, engine: FlexEngine, params: Any, *, policy_version: int = 0, tokenizer: Any = None,
                 share_prefill: bool = True, defer_callbacks: bool = False):
        self.engine = engine
        self.params = params
        self.policy_version = policy_version
        self.adapter_versions: dict[int, int] = {}  # adapter row -> its version, where set_adapter replaced it
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.share_prefill = share_prefill
        self._state = engine.init_decode_state()
        self._slots: list[_Sequence | None] = [None] * engine.max_concurrent_decodes
        self._queue: collections.deque[_Work] = collections.deque()
        self._inflight: collections.deque = collections.deque()  # (result tokens, slot owners)
        self._tickets = itertools.count()
        self.admission_open = True
        # With defer_callbacks, finished requests' on_done calls wait in _deliveries until the owner
        # runs them (EngineInstance does so outside its lock, so callbacks may submit new work).
        self.defer_callbacks = defer_callbacks
        self._deliveries: list[tuple[Callable, list[SequenceResult]]] = []
        self.steps = 0
        self.generated_tokens = 0

    # ---------------------------------------------------------------- submission
    def submit(self, request: RolloutRequest, adapter: int = 0) -> int:
        """Queues a request; returns its ticket. Raises ValueError for a prompt that fits no bucket. `adapter`:
        with `AdaptedParams` (several LoRA agents of one base), the row of the adapter table its samples decode
        with."""
        padded, true_length = pad_prompt(request.prompt_ids, self.engine.config, self.tokenizer.pad_id)
        if isinstance(adapter, bool) or not isinstance(adapter, int) or adapter < 0:
            raise ValueError(f"adapter={adapter!r} must be an int >= 0 (a row of the engine's adapter table)")
        work = _Work(
            ticket=next(self._tickets), request=request, prompt_ids=tuple(int(t) for t in padded[:true_length]),
            padded_prompt=padded, true_length=true_length,
            waiting=collections.deque(), results={}, adapter=adapter,
        )
        work.waiting.extend(_Sequence(work=work, sample_index=i) for i in range(request.num_samples))
        self._queue.append(work)
        return work.ticket

    # ---------------------------------------------------------------- load figures
    @property
    def queued_requests(self) -> int:
        return sum(1 for w in self._queue if w.waiting)

    @property
    def active_slots(self) -> int:
        return sum(1 for s in self._slots if s is not None)

    @property
    def outstanding_tokens(self) -> int:
        """Upper bound of tokens still to generate: queued samples' budgets plus active remainders."""
        queued = sum(len(w.waiting) * w.request.max_new_tokens for w in self._queue)
        active = sum(s.work.request.max_new_tokens - len(s.token_ids) for s in self._slots if s is not None)
        return queued + active

    def _compact(self) -> None:
        """Moves the last occupied slots into free ones below them when that lets the engine step a smaller slot
        bucket: the sequences of a batch finish in any order, and a tail of a few long ones would otherwise keep
        every slot below the last of them stepping."""
        if not self._compaction_pays():
            return
        self.flush()  # the results in flight are indexed by the slots as they were
        if not self._compaction_pays():
            return
        target = self.engine.slot_bucket(self.active_slots)
        sources = [slot for slot in range(target, len(self._slots)) if self._slots[slot] is not None]
        destinations = [slot for slot in range(target) if self._slots[slot] is None][: len(sources)]
        self._state = self.engine.move_slots(self._state, sources, destinations)
        for source, destination in zip(sources, destinations, strict=True):
            sequence = self._slots[destination] = self._slots[source]
            self._slots[source] = None
            sequence.slot = destination

    def _compaction_pays(self) -> bool:
        occupied = self.active_slots
        return occupied > 0 and self.engine.slot_bucket(occupied) < self.engine.slot_bucket(self._live_slots())

    def _live_slots(self) -> int:
        """One past the highest occupied slot: the engine steps only the slots below it."""
        return max(slot for slot, owner in enumerate(self._slots) if owner is not None) + 1

    def has_work(self) -> bool:
        return bool(self._queue) or self.active_slots > 0 or bool(self._inflight)

    def is_decoding(self) -> bool:
        return self.active_slots > 0 or bool(self._inflight)

    # ---------------------------------------------------------------- stepping
    def step(self) -> None:
        """Admit into free slots, dispatch one generate, process the previous step's tokens."""
        if self.admission_open:
            self._admit()
        self._compact()
        if self.active_slots > 0:
            self._state, result = self.engine.generate(self.params, self._state, self._live_slots())
            result.copy_to_host_async()
            self._inflight.append((result, list(self._slots)))
            self.steps += 1
        # Keep one step in flight while decoding (host work overlaps device work); drain otherwise.
        while len(self._inflight) > (1 if self.active_slots > 0 else 0):
            self._process(*self._inflight.popleft())

    def flush(self) -> None:
        """Processes every dispatched step (no step stays in flight)."""
        while self._inflight:
            self._process(*self._inflight.popleft())

    def run_until_idle(self, max_steps: int | None = None) -> None:
        steps = 0
        while self.has_work():
            self.step()
            steps += 1
            if max_steps is not None and steps >= max_steps:
                raise RuntimeError(f"rollout loop still busy after {max_steps} steps")

    def generate(self, requests: Sequence[RolloutRequest], adapters: Sequence[int] | None = None
                 ) -> list[list[SequenceResult]]:
        """Convenience: runs `requests` (each on its row of `adapters`, default 0) to completion and returns
        their results in order."""
        outputs: dict[int, list[SequenceResult]] = {}
        adapters = [0] * len(requests) if adapters is None else list(adapters)
        for index, (request, adapter) in enumerate(zip(requests, adapters, strict=True)):
            def done(results, index=index, user=request.on_done):
                outputs[index] = results
                if user is not None:
                    user(results)
            self.submit(dataclasses.replace(request, on_done=done), adapter)
        self.run_until_idle()
        return [outputs[i] for i in range(len(requests))]

    def pending_error_callbacks(self) -> list:
        """`on_error` of every unfinished request; forgets them (used when the engine fails)."""
        works = {id(w): w for w in self._queue}
        works.update({id(s.work): s.work for s in self._slots if s is not None})
        self._queue.clear()
        self._slots = [None] * len(self._slots)
        self._inflight.clear()
        return [w.request.on_error for w in works.values() if len(w.results) < w.request.num_samples]

    def cancel(self, request: RolloutRequest) -> bool:
        """Drops an unfinished request (matched by identity): queued samples are forgotten, decoding
        ones free their slots at once. No callback runs. Returns False if it is unknown or done."""
        works = [w for w in self._queue if w.request is request]
        works += [s.work for s in self._slots if s is not None and s.work.request is request]
        if not works:
            return False
        work = works[0]
        work.cancelled = True
        work.waiting.clear()
        work.prefix = None
        for slot, sequence in enumerate(self._slots):
            if sequence is not None and sequence.work is work:
                sequence.finish_reason = "aborted"  # results still in flight for it are ignored
                self._slots[slot] = None
        self._queue = collections.deque(w for w in self._queue if w is not work)
        return True

    # ---------------------------------------------------------------- version control
    def set_params(self, params: Any, policy_version: int) -> None:
        """Swaps weights; only legal with no sequence decoding (no mixing of versions)."""
        if self.is_decoding():
            raise RuntimeError("set_params while sequences are decoding would mix policy versions")
        self.params = params
        self.policy_version = policy_version
        self.adapter_versions = {}
        for work in self._queue:  # prefixes computed under the old weights are stale
            work.prefix = None

    def set_adapter(self, row: int, adapter: Any, spec: Any, policy_version: int) -> None:
        """Replaces row `row` of the adapter table (a LoRA agent's new version) between steps, while other rows'
        sequences decode; refused while a sequence decodes with `row` (it would mix versions: write a spare row
        instead, rollout/adapter_rows.py). Requests still queued for `row` decode under the new version."""
        busy = self.sequences_on(row)
        if busy:
            raise RuntimeError(f"set_adapter({row}) while {busy} sequences decode with that row would mix policy "
                               "versions; write the new version into a row no sequence uses")
        self.params = self.engine.replace_adapter(self.params, row, adapter, spec)
        self.adapter_versions[row] = policy_version
        for work in self._queue:  # prefixes computed under the old adapter are stale
            if work.adapter == row:
                work.prefix = None

    def sequences_on(self, row: int) -> int:
        """How many sequences decode with adapter row `row` now."""
        return sum(1 for sequence in self._slots if sequence is not None and sequence.work.adapter == row)

    def version_of(self, row: int) -> int:
        """The policy version sequences of adapter row `row` decode under."""
        return self.adapter_versions.get(row, self.policy_version)

    def abort_active(self) -> int:
        """Drops every in-flight sequence and puts it back at the front of its request's queue.

        Returns the number of sequences re-queued; they restart from the prompt.
        """
        self.flush()
        requeued = 0
        front: list[_Work] = []
        for slot, sequence in enumerate(self._slots):
            if sequence is None:
                continue
            self._slots[slot] = None
            work = sequence.work
            sequence.slot, sequence.token_ids, sequence.logprobs = -1, [], []
            work.waiting.appendleft(sequence)
            if not any(w is work for w in itertools.chain(self._queue, front)):
                front.append(work)
            requeued += 1
        for work in reversed(front):
            self._queue.appendleft(work)
        return requeued

    # ---------------------------------------------------------------- internals
    def _admit(self) -> None:
        free = [slot for slot, owner in enumerate(self._slots) if owner is None]
        while free and self._queue:
            head = self._queue[0]
            if head.cancelled or not head.waiting:
                self._queue.popleft()
                continue
            if self._has_current_prefix(head):  # the rest of a request admitted in part earlier
                free = self._insert([head], head.prefix, [head.prefix_row], free)
            else:
                group = self._prefill_group(len(free))
                rows = next(b for b in self.engine.config.prefill_batch_sizes if b >= len(group))
                bucket = group[0].padded_prompt.shape[0]
                padded = np.zeros((rows, bucket), np.int32)
                lengths, samplings, adapters = [1] * rows, [None] * rows, [0] * rows  # unused rows are dummies
                for row, work in enumerate(group):
                    padded[row], lengths[row] = work.padded_prompt, work.true_length
                    samplings[row], adapters[row] = work.request.sampling, work.adapter
                prefix = self.engine.prefill_batch(self.params, padded, lengths, samplings, adapters)
                free = self._insert(group, prefix, list(range(len(group))), free)
            self._queue = collections.deque(w for w in self._queue if w.waiting and not w.cancelled)

    def _has_current_prefix(self, work: _Work) -> bool:
        return (self.share_prefill and work.prefix is not None
                and work.prefix_version == self.version_of(work.adapter))

    def _prefill_group(self, free_slots: int) -> list[_Work]:
        """The head request plus queued requests of its bucket, as many as one prefill call takes
        and the free slots can start."""
        head = self._queue[0]
        bucket = head.padded_prompt.shape[0]
        max_rows = self.engine.config.prefill_batch_sizes[-1]
        group, slots_needed = [head], self._slots_wanted(head, free_slots)
        for work in itertools.islice(self._queue, 1, None):
            if len(group) >= max_rows or slots_needed >= free_slots:
                break
            if work.cancelled or not work.waiting or work.padded_prompt.shape[0] != bucket:
                continue
            if self._has_current_prefix(work):
                continue
            group.append(work)
            slots_needed += self._slots_wanted(work, free_slots - slots_needed)
        return group

    def _slots_wanted(self, work: _Work, free_slots: int) -> int:
        return min(free_slots, len(work.waiting)) if self.share_prefill else 1

    def _insert(self, works: list[_Work], prefix: Prefix, rows: list[int], free: list[int]) -> list[int]:
        """Starts as many waiting samples of `works` (prompt rows `rows` of `prefix`) as free slots
        allow, in one insert; returns the slots still free."""
        slots, indices, prefix_rows, started = [], [], [], []
        for work, row in zip(works, rows, strict=True):
            take = min(len(free) - len(slots), self._slots_wanted(work, len(free)))
            for _ in range(take):
                sequence = work.waiting.popleft()
                slots.append(free[len(slots)])
                indices.append(sequence.sample_index)
                prefix_rows.append(row)
                started.append(sequence)
            if work.waiting and self.share_prefill:
                work.prefix, work.prefix_row = prefix, row
                work.prefix_version = self.version_of(work.adapter)
            else:
                work.prefix = None
        if slots:
            self._state = self.engine.insert_many(prefix, self._state, slots, indices, prefix_rows)
        for slot, sequence in zip(slots, started, strict=True):
            sequence.slot = slot
            sequence.policy_version = self.version_of(sequence.work.adapter)
            self._slots[slot] = sequence
        return free[len(slots):]

    def _process(self, result: Any, owners: list[_Sequence | None]) -> None:
        data = result.convert_to_numpy()
        start, end = data.tokens_idx
        tokens = data.data[:, start:end]  # [slots, tokens per call]
        logprobs = data.logprobs()  # [slots, tokens per call]
        # One token per slot (a real engine): taken as is. Several (an engine advancing several steps per call,
        # the Engine API's speculation axis): a slot's tokens are its leading valid ones.
        emitted = (np.ones((tokens.shape[0],), np.int64) if end - start == 1
                   else data.data[:, data.valid_idx[0]:data.valid_idx[1]].cumprod(axis=1).sum(axis=1))
        # Every end-of-sequence id of the checkpoint ends a sequence (chat models list several).
        eos_ids = frozenset(getattr(self.tokenizer, "stop_ids", None) or (self.tokenizer.eos_id,))
        # The raw log-probs an engine reports for the OpenAI server (one token per step): read once per step.
        reported = (data.raw_logprobs(), *data.top()) if getattr(data, "has_raw_logprobs", False) else None
        for slot, sequence in enumerate(owners):
            if sequence is None or sequence.finish_reason is not None or self._slots[slot] is not sequence:
                continue
            count = int(emitted[slot])
            before = len(sequence.token_ids)
            if count == 1:
                self._take(sequence, int(tokens[slot, 0]), float(logprobs[slot, 0]), eos_ids)
            elif count > 1:
                self._take_several(sequence, tokens[slot, :count], logprobs[slot, :count], eos_ids)
            work = sequence.work
            if work.request.on_tokens is not None and len(sequence.token_ids) > before:
                self._tell_tokens(sequence, before, reported, slot)
            if work.pending_done is not None:  # the request's last sample finished: after its last tokens' event
                self._deliver(work.request.on_done, work.pending_done)
                work.pending_done = None

    def _tell_tokens(self, sequence: _Sequence, before: int, reported: tuple | None, slot: int) -> None:
        """Hands the sample's tokens from `before` on to its request's on_tokens (deferred like on_done);
        `reported`: the step's (raw log-probs [slots], top ids, top raw log-probs [slots, K]), or None."""
        raw: tuple[float, ...] = ()
        top: tuple[tuple[tuple[int, float], ...], ...] = ()
        if reported is not None:
            raw_logprobs, top_ids, top_logprobs = reported
            raw = (float(raw_logprobs[slot]),)
            top = (tuple(zip(top_ids[slot].tolist(), top_logprobs[slot].tolist(), strict=True)),)
        event = TokenEvent(sequence.sample_index, tuple(sequence.token_ids[before:]),
                           tuple(sequence.logprobs[before:]), raw, top, sequence.finish_reason)
        self._deliver(sequence.work.request.on_tokens, event)

    def _deliver(self, callback: Callable, argument: Any) -> None:
        if self.defer_callbacks:
            self._deliveries.append((callback, argument))
        else:
            callback(argument)

    def _take(self, sequence: _Sequence, token: int, logprob: float, eos_ids: frozenset) -> None:
        """Appends one token to `sequence` and finishes it on a stop or at its token budget."""
        request = sequence.work.request
        sequence.token_ids.append(token)
        sequence.logprobs.append(logprob)
        self.generated_tokens += 1
        stopped = (token in eos_ids and not request.ignore_eos) or token in request.stop_token_ids
        if stopped or self._hit_stop_string(sequence):
            self._finish(sequence, "stop")
        elif len(sequence.token_ids) >= request.max_new_tokens:
            self._finish(sequence, "length")

    def _take_several(self, sequence: _Sequence, tokens: np.ndarray, logprobs: np.ndarray,
                      eos_ids: frozenset) -> None:
        """`_take` over consecutive tokens [count], in bulk where no stop string needs a per-token check: the
        sequence keeps its tokens up to the first stop or its budget, exactly as one by one."""
        request = sequence.work.request
        if request.stop_strings or request.stop_pattern:
            for token, logprob in zip(tokens.tolist(), logprobs.tolist(), strict=True):
                if sequence.finish_reason is not None:
                    return
                self._take(sequence, token, logprob, eos_ids)
            return
        stops = set(request.stop_token_ids) | (set() if request.ignore_eos else eos_ids)
        stop_at = np.flatnonzero(np.isin(tokens, list(stops))) if stops else ()
        budget = request.max_new_tokens - len(sequence.token_ids)
        keep = min(len(tokens), budget, int(stop_at[0]) + 1 if len(stop_at) else len(tokens))
        sequence.token_ids.extend(tokens[:keep].tolist())
        sequence.logprobs.extend(logprobs[:keep].tolist())
        self.generated_tokens += keep
        if len(stop_at) and stop_at[0] < keep:
            self._finish(sequence, "stop")
        elif len(sequence.token_ids) >= request.max_new_tokens:
            self._finish(sequence, "length")

    def _hit_stop_string(self, sequence: _Sequence) -> bool:
        request = sequence.work.request
        # Checked after every token, so the first match is found when its last token arrives; a bounded window
        # keeps the cost per token constant (a match longer than the window is never seen).
        if request.stop_pattern and re.search(request.stop_pattern,
                                              self.tokenizer.decode(sequence.token_ids[-STOP_PATTERN_TOKENS:])):
            return True
        stops = request.stop_strings
        if not stops:
            return False
        # Decode only the response's tail, but a tail of text rather than of tokens (some ids decode to ""):
        # the window doubles until it holds the longest stop string and the newest token's text, plus a margin
        # for the tokenizer's decoding of its first few characters, or the whole response. A match anywhere in
        # it ends the sequence: the check runs after every token, so a match is new, and it may end inside the
        # newest token (OpenAI's stop semantics). Per token this costs O(stop length), not O(response length).
        tokens = sequence.token_ids
        needed = max(len(s) for s in stops) + len(self.tokenizer.decode(tokens[-1:])) + 8
        window = 8
        while True:
            text = self.tokenizer.decode(tokens[-window:])
            if len(text) >= needed or window >= len(tokens):
                return any(s in text for s in stops)
            window *= 2

    def _finish(self, sequence: _Sequence, reason: str) -> None:
        sequence.finish_reason = reason
        self._slots[sequence.slot] = None
        work = sequence.work
        work.results[sequence.sample_index] = SequenceResult(
            prompt_ids=work.prompt_ids,
            token_ids=tuple(sequence.token_ids),
            logprobs=tuple(sequence.logprobs),
            finish_reason=reason,
            policy_version=sequence.policy_version,
            sample_index=sequence.sample_index,
        )
        if len(work.results) == work.request.num_samples and work.request.on_done is not None:
            # Deferred after this step's token events of the sequence (`_process` tells them once `_take` returns).
            results = [work.results[i] for i in range(work.request.num_samples)]
            work.pending_done = results

    def take_deliveries(self) -> list[tuple[Callable, Any]]:
        """Deferred (callback, argument) pairs, oldest first: token events and (on_done, results); the caller
        runs them."""
        deliveries, self._deliveries = self._deliveries, []
        return deliveries
