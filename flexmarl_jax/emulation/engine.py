"""`EmulatedEngine`: a stand-in under JetStream's Engine API whose steps take the cost model's time and whose
tokens are scripted, so the real rollout loop, `EngineInstance`, router and balancer run above it and
hundreds of emulated instances fit on one host.

It answers the calls `RolloutLoop` makes of `FlexEngine` (`prefill_batch`, `insert_many`, `generate`,
`init_decode_state`, plus the Engine API's `prefill` / `insert`) with host-side numpy state, no model.

The device is a queue. Each prefill or generate is enqueued on it: it starts when the device is free (or
now, if it is idle), lasts the cost model's device seconds divided by the compression, and its result is
ready then. Like a real accelerator's asynchronous dispatch, the call returns at once and the host blocks
only when it reads the result (`convert_to_numpy`), so the loop's own bookkeeping overlaps the emulated
device, as it overlaps a real one. Inserting a prefix into slots is taken as free (a KV copy on-device).

What a step costs (see cost_model.py):
* a prefill call: `prefill_s(rows, tokens)` over its real rows (the loop pads a call with dummy rows, which
  carry no sampling settings), `tokens` their mean prompt length;
* a generate call: `decode_step_s(live slots, their mean context)` per decode step it advances: only slots
  still producing tokens count, as in a paged-attention engine (our FlexEngine computes every slot; the engines
  the FlexMARL paper measures do not). The attention cost is linear in the context, so the mean context is
  exact for the sum.

Several steps per call (`tokens_per_call` > 1). One Python call per token per instance is what this host
cannot afford for dozens of instances (their bookkeeping, not the emulated device, then sets the pace). So a
call may advance up to `tokens_per_call` steps, returning each slot's tokens on the Engine API's speculation
axis (`valid` marks them); the loop takes them as it would one by one. A call ends where the first live slot
ends and the next call is one step (`steps_for`), which keeps the single-step refill schedule, so the device
time and every token are what single steps give (tests/emulation/test_emulated_engine.py). What differs: work
submitted mid-call is admitted when the call ends, and load figures refresh per call, not per token.

Tokens: each sample emits `ScriptedTokens.length(seed, sample_index)` tokens, the last of them EOS; a
sequence whose request allows fewer new tokens is ended by the loop at its `max_new_tokens`, and its slot is
charged until the script's end or until the slot is reused (scripts should stay within the budget).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import struct

from flexmarl_jax.emulation.cost_model import CostModel
from flexmarl_jax.emulation.rules import tokens_per_call_problem
from flexmarl_jax.emulation.timescale import TimeScale
from flexmarl_jax.rollout import engine_api
from flexmarl_jax.rollout.engine_shape import EngineShapeFromConfig
from flexmarl_jax.rollout.results import LogProbResultTokens
from flexmarl_jax.rollout.settings import EngineConfig

SCRIPTED_LOGPROB = -1.0  # every scripted token's behaviour log-prob (finite, as importance weights need)


@dataclasses.dataclass(frozen=True)
class ScriptedTokens:
    """What an emulated sample says: `length(seed, sample_index)` tokens (>= 1), `filler_id` then `eos_id`."""

    eos_id: int
    filler_id: int
    length: Callable[[int, int], int]

    def tokens_for(self, seed: int, sample_index: int) -> int:
        count = int(self.length(int(seed), int(sample_index)))
        if count < 1:
            raise ValueError(f"scripted length {count} for seed={seed} sample {sample_index}; need >= 1")
        return count


def fixed_length(tokens: int) -> Callable[[int, int], int]:
    """A script where every sample is `tokens` long."""
    return lambda seed, sample_index: tokens


class DeviceQueue:
    """One emulated device's timeline: work runs back to back, each item after the previous one.

    `host_stall_s` is the wall time the device sat idle waiting for the host *while a run had more work for
    it* (`follows_work`): the host's overhead that did not hide behind the device. `host_stall_share` puts it
    over the device's compressed busy time; `TimeScale.overhead_within_bound`'s 10% applies to it.
    """

    def __init__(self, timescale: TimeScale, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        self.timescale = timescale
        self.clock = clock
        self._sleep = sleep  # waits on `clock` (tests pass a fake clock and a sleep that advances it)
        self._free_at = clock()
        self._lock = threading.Lock()
        self.device_s = 0.0  # device seconds enqueued so far (uncompressed)
        self.host_stall_s = 0.0  # wall seconds
        self.calls = 0
        self._beside: DeviceQueue | None = None  # the timeline this one shares its silicon with (contend_with)
        self._slowdown = 1.0
        self._beside_calls_are_short = False
        self._working: set[int] = set()  # ids of the engines on this queue that have live sequences (set_working)

    def contend_with(self, beside: DeviceQueue, *, slowdown: float, beside_calls_are_short: bool) -> None:
        """Makes this timeline's work run `slowdown` times slower while `beside` has work: two timelines on one
        piece of silicon (`Chip.one_device`: this host's engines and trainers share its cores).

        How much of a call overlaps `beside`'s work: when `beside`'s calls are long (training, seen from an
        engine), its queue already says until when it is busy, and only that stretch of the call is slowed.
        When they are short (engine steps, seen from a training call), the queue knows only the current step;
        engines that are decoding when the call starts are taken to go on decoding through the whole call (a
        rollout issues its steps back to back), and engines that are idle then, to stay idle. An engine is
        decoding while it has live sequences (`set_working`), not only while its step is on the device: between
        two steps its rollout loop's host work runs on the same cores a host chip's training does.
        """
        if not slowdown >= 1.0:
            raise ValueError(f"slowdown={slowdown!r} must be >= 1")
        self._beside, self._slowdown, self._beside_calls_are_short = beside, float(slowdown), beside_calls_are_short

    @property
    def busy_until(self) -> float:
        """The wall-clock time the work enqueued so far ends (in the past when the device is idle)."""
        return self._free_at

    def set_working(self, owner: object, working: bool) -> None:
        """Records whether `owner` (an engine on this queue) has live sequences, so more steps to come."""
        with self._lock:
            if working:
                self._working.add(id(owner))
            else:
                self._working.discard(id(owner))

    @property
    def working(self) -> bool:
        """Whether any engine on this queue has live sequences."""
        return bool(self._working)

    def _contended_wall_s(self, now: float, start: float, wall_s: float) -> float:
        """`wall_s` of work enqueued at `now` to start at `start`, stretched where it overlaps the work of the
        timeline beside."""
        if self._beside is None or self._slowdown == 1.0:
            return wall_s
        beside_until = self._beside.busy_until
        if self._beside_calls_are_short:
            # Live sequences say the engines go on decoding from now on; for a call queued behind others, that
            # is not known at its start, so it is slowed only if engine steps are queued beyond its start.
            decoding = beside_until > start or (self._beside.working and start <= now)
            return wall_s * self._slowdown if decoding else wall_s
        overlap = max(0.0, beside_until - start)  # wall seconds at the slow rate
        if wall_s * self._slowdown <= overlap:
            return wall_s * self._slowdown
        return overlap + (wall_s - overlap / self._slowdown)

    def enqueue(self, device_s: float, *, follows_work: bool = False) -> float:
        """Schedules `device_s` device seconds; returns the wall-clock time the work is done. With
        `follows_work`, an idle gap before it counts as host stall."""
        with self._lock:
            return self._enqueue_locked(self.clock(), device_s, follows_work)

    def _enqueue_locked(self, now: float, device_s: float, follows_work: bool) -> float:
        if follows_work and now > self._free_at:
            self.host_stall_s += now - self._free_at
        start = max(now, self._free_at)
        self._free_at = start + self._contended_wall_s(now, start, self.timescale.wall_s(device_s))
        self.device_s += device_s
        self.calls += 1
        return self._free_at

    def run(self, device_s: float) -> None:
        """Runs `device_s` device seconds as a call the host waits for (a training step, a weight sync): it is
        put on the timeline only once the work ahead of it is done, so it starts as it is enqueued and the
        timeline beside is judged at its real start (`contend_with`), then the host waits until it ends."""
        while True:
            with self._lock:
                now = self.clock()
                if now >= self._free_at:
                    ready_at = self._enqueue_locked(now, device_s, follows_work=False)
                    break
                free_at = self._free_at
            self.wait_until(free_at)
        self.wait_until(ready_at)

    @property
    def host_stall_share(self) -> float:
        """Host stall over the device's busy wall time (0.0 before any work)."""
        busy = self.timescale.wall_s(self.device_s)
        return self.host_stall_s / busy if busy > 0 else 0.0

    def wait_until(self, ready_at: float) -> None:
        """Blocks the host until `ready_at` (the moment a result it reads comes back)."""
        remaining = ready_at - self.clock()
        if remaining > 0:
            self._sleep(remaining)


@struct.dataclass
class EmulatedResult(LogProbResultTokens):
    """A generate step's results, readable on the host once the emulated device has finished the step."""

    ready_at: float = struct.field(pytree_node=False, default=0.0)
    queue: Any = struct.field(pytree_node=False, default=None)

    def convert_to_numpy(self) -> LogProbResultTokens:
        if self.queue is not None:
            self.queue.wait_until(self.ready_at)
        return LogProbResultTokens(data=self.data, tokens_idx=self.tokens_idx, valid_idx=self.valid_idx,
                                   length_idx=self.length_idx, samples_per_slot=self.samples_per_slot,
                                   logprobs_idx=self.logprobs_idx)


@dataclasses.dataclass
class EmulatedPrefix:
    """A prefill's result: per row, its prompt length and seed (its KV cache exists only as a cost)."""

    true_length: np.ndarray  # [rows] int
    seed: np.ndarray  # [rows] int


@dataclasses.dataclass
class EmulatedDecodeState:
    """Per slot: the next position, tokens generated, seed, sample index, scripted length, whether live."""

    positions: np.ndarray
    generated: np.ndarray
    seed: np.ndarray
    sample_index: np.ndarray
    target: np.ndarray
    live: np.ndarray


class EmulatedEngine(EngineShapeFromConfig, engine_api.Engine):
    """A `FlexEngine` look-alike whose device time is `cost_model`'s, compressed by `timescale`.

    Args:
      cost_model: the model on its chips (one instance's replica).
      engine_config: slots, prompt buckets and cache length, as for FlexEngine.
      tokenizer: the agent's tokenizer (pad / EOS ids, stop strings).
      script: the tokens each sample emits.
      tokens_per_call: at most this many tokens per slot per `generate` call (see `steps_for`); 1 = one
        decode step per call, as a real engine. A run's is `pipeline.emulate_tokens_per_call`.
      timescale: device seconds -> wall seconds (a run's: `pipeline.emulate_compression`).
      clock: the wall clock (tests may pass a fake one).
      device: the queue its work runs on (default: a queue of its own; a chip whose emulated devices are one
        piece of silicon, `Chip.one_device`, gives every engine and trainer the same one).
    """

    def __init__(self, cost_model: CostModel, engine_config: EngineConfig, tokenizer: Any, script: ScriptedTokens,
                 *, tokens_per_call: int, timescale: TimeScale, clock: Callable[[], float] = time.perf_counter,
                 device: DeviceQueue | None = None):
        problem = tokens_per_call_problem(tokens_per_call)
        if problem:
            raise ValueError(f"tokens_per_call={tokens_per_call!r} {problem}")
        self.cost_model = cost_model
        self.tokens_per_call = tokens_per_call
        self.model_config = cost_model.model
        self.config = engine_config
        self.tokenizer = tokenizer
        self.script = script
        self.device = device if device is not None else DeviceQueue(timescale, clock)
        self._decoding = False  # whether the last generate left live slots (the loop then calls again at once)
        self._finished_last_call = False  # whether a slot ended in the last generate (the next one is one step)
        self.steps_advanced = 0  # decode steps charged so far (over every generate call)
        self.generate_calls = 0

    # ----------------------------------------------------------------- what the rollout loop calls
    def init_decode_state(self, *args, **kwargs) -> EmulatedDecodeState:
        slots = self.max_concurrent_decodes
        zeros = np.zeros((slots,), np.int64)
        return EmulatedDecodeState(positions=zeros.copy(), generated=zeros.copy(), seed=zeros.copy(),
                                   sample_index=zeros.copy(), target=zeros.copy(), live=np.zeros((slots,), bool))

    def prefill_batch(self, params: Any, padded_tokens, true_lengths, samplings, adapters=None) -> EmulatedPrefix:
        # adapters: FlexEngine's rows of an adapter table; an emulated engine computes no tokens, so none apply
        true_lengths = np.asarray(true_lengths, dtype=np.int64)
        real = [index for index, sampling in enumerate(samplings) if sampling is not None] or [0]
        tokens = float(np.mean(true_lengths[real]))
        self.device.enqueue(self.cost_model.prefill_s(len(real), max(1, round(tokens))), follows_work=self._decoding)
        seeds = np.asarray([(s.seed if s is not None else 0) for s in samplings], dtype=np.int64)
        return EmulatedPrefix(true_length=true_lengths, seed=seeds)

    def insert_many(self, prefix: EmulatedPrefix, decode_state: EmulatedDecodeState, slots, sample_indices,
                    rows=None) -> EmulatedDecodeState:
        rows = [0] * len(slots) if rows is None else list(rows)
        state = decode_state
        for slot, sample_index, row in zip(slots, sample_indices, rows, strict=True):
            seed = int(prefix.seed[row])
            state.positions[slot] = prefix.true_length[row]
            state.generated[slot] = 0
            state.seed[slot] = seed
            state.sample_index[slot] = sample_index
            state.target[slot] = self.script.tokens_for(seed, sample_index)
            state.live[slot] = True
        self.device.set_working(self, bool(state.live.any()))
        return state

    def slot_bucket(self, live_slots: int | None) -> int:
        """Always every slot: the cost model charges a step by its live slots already, so moving sequences into
        a smaller bucket would gain nothing and the loop never does (see FlexEngine.slot_bucket)."""
        return self.max_concurrent_decodes

    def generate(self, params: Any, decode_state: EmulatedDecodeState, live_slots: int | None = None
                 ) -> tuple[EmulatedDecodeState, EmulatedResult]:
        """Advances every live slot by `steps_for` tokens in one call, charged as that many single steps
        (`live_slots`, FlexEngine's hint, changes nothing here).

        The result has one column per token (the Engine API's speculation axis); `valid` marks the tokens a slot
        emitted, so a slot that ends mid-call leaves the rest of its row invalid (it never does: see steps_for).
        """
        state = decode_state
        live = state.live.copy()
        count = int(live.sum())
        steps = self.steps_for(state)
        context = float(state.positions[live].mean()) if count else 0.0
        device_s = self.cost_model.decode_steps_s(count, context, steps) if count else 0.0
        ready_at = self.device.enqueue(device_s, follows_work=self._decoding)
        remaining = state.target - state.generated  # [slots] tokens each live slot has left
        offsets = np.arange(steps)[None, :]  # [1, steps]
        emitted = live[:, None] & (offsets < remaining[:, None])  # [slots, steps]
        last = emitted & (offsets == remaining[:, None] - 1)
        tokens = np.where(last, self.script.eos_id, self.script.filler_id).astype(np.int32)
        finished = live & (remaining <= steps)
        state.generated += steps
        state.positions += steps
        self.steps_advanced += steps
        self.generate_calls += 1
        state.live &= ~finished
        self._finished_last_call = bool(finished.any())
        self._decoding = bool(state.live.any())
        self.device.set_working(self, self._decoding)
        lengths = np.minimum(state.generated, np.maximum(state.target, 1)).astype(np.int32)[:, None]
        logprobs = np.full(tokens.shape, SCRIPTED_LOGPROB, np.float32).view(np.int32)
        data = np.concatenate([tokens, emitted.astype(np.int32), lengths, logprobs], axis=-1)
        result = EmulatedResult(data=data, tokens_idx=(0, steps), valid_idx=(steps, 2 * steps),
                                length_idx=(2 * steps, 2 * steps + 1), samples_per_slot=1,
                                logprobs_idx=(2 * steps + 1, 3 * steps + 1), ready_at=ready_at, queue=self.device)
        return state, result

    def steps_for(self, state: EmulatedDecodeState) -> int:
        """Tokens the next call advances: up to `tokens_per_call`, ending where the first live slot ends, and a
        single step right after a call in which a slot ended.

        Why this keeps the schedule of single steps: the loop learns of a sequence's end one call late (it
        processes a call's tokens after dispatching the next), so a slot that ends at step n is refilled from
        step n + 2. Ending a call at the first end and making the following call one step long keeps exactly
        that; a longer call would leave the freed slot idle longer than a real engine's. The one thing calls of
        several steps change is when work arriving mid-call is admitted: at the call's end, up to
        `tokens_per_call` - 1 steps later than single steps would.
        """
        live = state.live
        if self.tokens_per_call == 1 or self._finished_last_call or not live.any():
            return 1
        return int(min(self.tokens_per_call, (state.target - state.generated)[live].min()))

    # ----------------------------------------------------------------- the rest of the Engine API
    def prefill(self, *, params: Any, existing_prefix: Any = None, padded_tokens, true_length: int,
                sampling: Any = None) -> EmulatedPrefix:
        if existing_prefix is not None:
            raise NotImplementedError("EmulatedEngine does not continue from an existing prefix")
        return self.prefill_batch(params, np.asarray(padded_tokens)[None], [int(true_length)], [sampling])

    def insert(self, prefix: EmulatedPrefix, decode_state: EmulatedDecodeState, slot: int, *,
               sample_index: int = 0, row: int = 0) -> EmulatedDecodeState:
        return self.insert_many(prefix, decode_state, [slot], [sample_index], [row])

    def load_params(self, *args, **kwargs) -> Any:
        raise NotImplementedError("an emulated engine has no weights; EngineInstance gets a placeholder")

    def get_prefix_destination_sharding(self) -> Any:
        return None

    def get_tokenizer(self) -> Any:
        return engine_api.TokenizerParameters(path=f"emulated:{type(self.tokenizer).__name__}", extra_ids=0)

    @property
    def mesh(self) -> Any:
        return None


def placeholder_params() -> Any:
    """What an `EngineInstance` over an emulated engine serves: one scalar (weight syncs swap it, and its
    version, like real weights; their transfer time is the weight-sync emulation's business)."""
    return {"emulated": jnp.zeros((), jnp.int32)}
