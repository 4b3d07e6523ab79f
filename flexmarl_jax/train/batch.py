"""Micro-batches for the trainer: a fixed-shape pytree, its validation, and a builder from store rows.

A micro-batch has shape ``[micro_batch_size, L]``, L the smallest of the agent's length buckets (powers of two
from 16, then ``max_len``; `length_buckets`) that holds its longest row: a micro-batch of short responses
costs a short step, and the jitted gradient step compiles once per bucket, at most ~log2(max_len) times.
Rows shorter than L are right-padded; missing rows (the last micro-batch of an uneven iteration) are
all-padding rows whose ``token_weights`` are zero, so they add exactly nothing to the accumulated gradient.
Padding changes no result: attention never looks at padded keys and padded targets weigh zero.

Alignment: position ``t`` of every ``[batch, seq]`` array describes predicting ``targets[t]`` from
``tokens[:t+1]``; ``targets`` is ``tokens`` shifted left by one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from flexmarl_jax.train.normalizers import IterationNormalizers, token_weights_for

# name -> required dtype kind of the per-token arrays; used by validation.
_INT_FIELDS = ("tokens", "targets", "positions")
_BOOL_FIELDS = ("attention_mask", "loss_mask")
_FLOAT_FIELDS = (
    "token_weights",
    "advantages",
    "behaviour_logprobs",
    "old_logprobs",
    "old_sampling_logprobs",
    "ref_logprobs",
    "old_values",
    "returns",
)
ARRAY_FIELDS = _INT_FIELDS + _BOOL_FIELDS + _FLOAT_FIELDS
SMALLEST_BUCKET = 16  # shorter buckets would save little and add compiles


def length_buckets(max_len: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
    """The sequence lengths micro-batches are padded to: powers of two from `smallest` below `max_len`, then
    `max_len` itself (JetStream buckets prompts the same way)."""
    buckets = []
    length = smallest
    while length < max_len:
        buckets.append(length)
        length *= 2
    return (*buckets, max_len)


def bucket_length(longest: int, max_len: int) -> int:
    """The smallest length bucket of `max_len` that holds `longest` tokens (`longest` <= max_len)."""
    return next(bucket for bucket in length_buckets(max_len) if bucket >= longest)


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One agent's micro-batch; every array is ``[batch, seq]``.

    tokens, targets, positions: int32 inputs, next-token targets and positions (0.. per row).
    attention_mask: bool, True on real input tokens (right padding is False).
    loss_mask: bool, True where ``targets`` is a response token that is trained on.
    token_weights: float32 aggregation weight per token, already divided by the iteration's normaliser
        (0 where ``loss_mask`` is False) so the iteration loss is a plain sum over micro-batches.
    advantages: float32 per-token advantage (GRPO broadcasts the sequence advantage over its tokens).
    behaviour_logprobs: float32 log-probs recorded by the rollout engine that generated the token.
    old_logprobs: float32 log-probs under the policy at the start of this iteration (the PPO ratio's
        denominator; defaults to ``behaviour_logprobs``). The trainer recomputes them in its step unless
        ``TrainerConfig.old_logprobs_in_step`` is False.
    old_sampling_logprobs: float32 log-probs under the same old policy, but of the distribution rollout samples
        from (the agent's temperature, top-k and top-p; see models/sampling_distribution.py): the truncated IS
        weight's numerator, compared with ``behaviour_logprobs``. Equals ``old_logprobs`` for plain softmax
        sampling; defaults to it, and the trainer recomputes it in its step with ``old_logprobs``.
    ref_logprobs: float32 log-probs under the frozen reference model (used only when the KL is on).
    old_values, returns: float32 critic values before the update and value targets (PPO only).
    segment_ids: None, or for a packed micro-batch (train/packing.py) int32: which of the sequences packed into
        the row each position belongs to (1, 2, ...; 0 on padding). Its rows are then bins, not sequences.
    agent: name of the agent whose rows these are (static metadata, checked by the trainer).
    """

    tokens: jax.Array
    targets: jax.Array
    positions: jax.Array
    attention_mask: jax.Array
    loss_mask: jax.Array
    token_weights: jax.Array
    advantages: jax.Array
    behaviour_logprobs: jax.Array
    old_logprobs: jax.Array
    old_sampling_logprobs: jax.Array
    ref_logprobs: jax.Array
    old_values: jax.Array
    returns: jax.Array
    segment_ids: jax.Array | None = None
    agent: str = dataclasses.field(default="", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def replace(self, **changes) -> MicroBatch:
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(MicroBatch, data_fields=[*ARRAY_FIELDS, "segment_ids"], meta_fields=["agent"])


def validate_micro_batch(batch: MicroBatch, *, agent: str, batch_size: int, max_len: int,
                         bin_counts: tuple[int, ...] = ()) -> None:
    """Raises ValueError naming the offending field unless ``batch`` fits this agent's static shapes:
    ``[batch_size, L]`` in every field, L one of `length_buckets(max_len)`. A packed batch (``segment_ids`` set,
    train/packing.py) has one of ``bin_counts`` rows instead, and int32 ``segment_ids`` of the same shape.

    Runs on the host before anything is traced or applied, so a bad batch never touches the accumulator.
    """
    if not isinstance(batch, MicroBatch):
        raise TypeError(f"expected a MicroBatch, got {type(batch).__name__}")
    if batch.agent != agent:
        raise ValueError(f"micro-batch belongs to agent {batch.agent!r}, but this trainer trains {agent!r}")
    buckets = length_buckets(max_len)
    tokens_shape = tuple(getattr(batch.tokens, "shape", ()))
    length = tokens_shape[1] if len(tokens_shape) == 2 and tokens_shape[1] in buckets else max_len
    packed = batch.segment_ids is not None
    if packed and (not tokens_shape or tokens_shape[0] not in bin_counts):
        raise ValueError(f"a packed micro-batch of {tokens_shape[:1]} bins; agent {agent!r} takes "
                         f"{list(bin_counts) or 'no packed batches'} (train.pack_rows)")
    rows = tokens_shape[0] if packed else batch_size
    for name in ARRAY_FIELDS + (("segment_ids",) if packed else ()):
        value = getattr(batch, name)
        shape = tuple(getattr(value, "shape", ()))
        if shape != (rows, length):
            needs = f"({rows}, {max_len})" if len(buckets) == 1 else f"({rows}, L) with L in {buckets}"
            raise ValueError(
                f"micro-batch field {name!r} has shape {shape}; agent {agent!r} needs {needs} "
                "(every field alike); build it with build_micro_batch(...)"
            )
        dtype = np.dtype(value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype)
        if name in _INT_FIELDS or name == "segment_ids":
            ok, allowed = dtype == np.int32, "int32"
        elif name in _BOOL_FIELDS:
            ok, allowed = dtype == np.bool_, "bool"
        else:
            ok, allowed = dtype == np.float32, "float32"
        if not ok:
            raise ValueError(f"micro-batch field {name!r} has dtype {dtype}; allowed: {allowed}")


def build_micro_batch(
    *,
    agent: str,
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    behaviour_logprobs: Sequence[Sequence[float]],
    advantages: Sequence[float] | Sequence[Sequence[float]],
    normalizers: IterationNormalizers,
    aggregation: str,
    batch_size: int,
    max_len: int,
    pad_id: int = 0,
    bucketed: bool = True,
    old_logprobs: Sequence[Sequence[float]] | None = None,
    old_sampling_logprobs: Sequence[Sequence[float]] | None = None,
    ref_logprobs: Sequence[Sequence[float]] | None = None,
    old_values: Sequence[Sequence[float]] | None = None,
    returns: Sequence[Sequence[float]] | None = None,
) -> MicroBatch:
    """Pads per-row lists (as stored in the experience store) into a ``[batch_size, L]`` batch: L is the
    smallest length bucket holding the longest row (`bucket_length`), or ``max_len`` when not ``bucketed``.

    Per row: ``prompt_ids`` and ``response_ids`` are token lists; ``behaviour_logprobs`` (and the
    optional ``old_logprobs``/``old_sampling_logprobs``/``ref_logprobs``/``old_values``/``returns``) have one
    value per response token (``old_logprobs`` defaults to ``behaviour_logprobs``, ``old_sampling_logprobs``
    to ``old_logprobs``); ``advantages`` is one float per row (GRPO) or one per response token (PPO/GAE).
    ``normalizers`` must describe the whole iteration of this agent (see IterationNormalizers) and
    ``aggregation`` names the loss aggregation, so that weights are those of the full-batch loss.
    Fewer rows than ``batch_size`` is allowed: the rest is zero-weight padding.
    """
    num_rows = len(prompt_ids)
    columns = dict(
        response_ids=response_ids,
        behaviour_logprobs=behaviour_logprobs,
        advantages=advantages,
        old_logprobs=old_logprobs,
        old_sampling_logprobs=old_sampling_logprobs,
        ref_logprobs=ref_logprobs,
        old_values=old_values,
        returns=returns,
    )
    for name, column in columns.items():
        if column is not None and len(column) != num_rows:
            raise ValueError(f"{name} has {len(column)} rows but prompt_ids has {num_rows}")
    if num_rows == 0 or num_rows > batch_size:
        raise ValueError(f"a micro-batch needs 1..{batch_size} rows (batch_size), got {num_rows}")

    # Inputs per row: every token but the last, which is only a target.
    longest = max(len(prompt) + len(response) - 1 for prompt, response in zip(prompt_ids, response_ids, strict=True))
    length = bucket_length(min(longest, max_len), max_len) if bucketed else max_len
    shape = (batch_size, length)
    out = {name: np.zeros(shape, np.int32) for name in _INT_FIELDS}
    out.update({name: np.zeros(shape, np.bool_) for name in _BOOL_FIELDS})
    out.update({name: np.zeros(shape, np.float32) for name in _FLOAT_FIELDS})
    out["tokens"][:] = pad_id
    out["targets"][:] = pad_id

    for row in range(num_rows):
        prompt, response = list(prompt_ids[row]), list(response_ids[row])
        n_prompt, n_response = len(prompt), len(response)
        if n_prompt == 0 or n_response == 0:
            raise ValueError(f"row {row}: prompt and response must be non-empty "
                             f"(got {n_prompt} prompt and {n_response} response tokens)")
        sequence = prompt + response
        n_inputs = len(sequence) - 1  # the last token is only a target
        if n_inputs > max_len:
            raise ValueError(f"row {row}: prompt+response has {len(sequence)} tokens; "
                             f"max_len={max_len} allows at most {max_len + 1}")
        out["tokens"][row, :n_inputs] = sequence[:-1]
        out["targets"][row, :n_inputs] = sequence[1:]
        out["positions"][row, :n_inputs] = np.arange(n_inputs)
        out["attention_mask"][row, :n_inputs] = True
        # Response token j is the target at input position n_prompt - 1 + j.
        response_slots = slice(n_prompt - 1, n_prompt - 1 + n_response)
        out["loss_mask"][row, response_slots] = True

        def per_token(name: str, values, row=row, n_response=n_response, response_slots=response_slots):
            values = np.asarray(values, np.float32)
            if values.shape != (n_response,):
                raise ValueError(f"row {row}: {name} has shape {values.shape}, "
                                 f"expected one value per response token ({n_response},)")
            out[name][row, response_slots] = values

        per_token("behaviour_logprobs", behaviour_logprobs[row])
        advantage = np.asarray(advantages[row], np.float32)
        if advantage.ndim == 0:
            advantage = np.full((n_response,), advantage, np.float32)
        per_token("advantages", advantage)
        old = (behaviour_logprobs if old_logprobs is None else old_logprobs)[row]
        per_token("old_logprobs", old)
        per_token("old_sampling_logprobs", old if old_sampling_logprobs is None else old_sampling_logprobs[row])
        for name in ("ref_logprobs", "old_values", "returns"):
            if columns[name] is not None:
                per_token(name, columns[name][row])

    out["token_weights"] = token_weights_for(aggregation, out["loss_mask"], normalizers)
    return MicroBatch(**out, agent=agent)


def stack_rows(batch: MicroBatch, rows: slice) -> MicroBatch:
    """Rows ``rows`` of ``batch`` as a smaller MicroBatch (for splitting a full batch in tests/benches)."""
    return MicroBatch(**{name: getattr(batch, name)[rows] for name in ARRAY_FIELDS}, agent=batch.agent)


def build_iteration(
    *,
    agent: str,
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    behaviour_logprobs: Sequence[Sequence[float]],
    advantages: Sequence[float] | Sequence[Sequence[float]],
    aggregation: str,
    micro_batch_size: int,
    max_len: int,
    pad_id: int = 0,
    norm_length: int | None = None,
    bucketed: bool = True,
    **per_token_columns,
) -> list[MicroBatch]:
    """All micro-batches of one agent's iteration, normalised over the whole iteration.

    Takes every row of the iteration (so the normalisers are the full batch's), then cuts them in
    order into chunks of ``micro_batch_size`` rows; the last chunk is padded. ``per_token_columns``
    are the optional per-token lists of `build_micro_batch` (old_logprobs, ref_logprobs, ...).
    """
    normalizers = IterationNormalizers.from_response_lengths([len(r) for r in response_ids], norm_length)
    batches = []
    for start in range(0, len(prompt_ids), micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        extra = {name: column[rows] for name, column in per_token_columns.items() if column is not None}
        batches.append(build_micro_batch(
            agent=agent, prompt_ids=prompt_ids[rows], response_ids=response_ids[rows],
            behaviour_logprobs=behaviour_logprobs[rows], advantages=advantages[rows],
            normalizers=normalizers, aggregation=aggregation, batch_size=micro_batch_size,
            max_len=max_len, pad_id=pad_id, bucketed=bucketed, **extra))
    return batches
