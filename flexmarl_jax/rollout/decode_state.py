"""What the engine's jitted entry points pass between them (rollout/engine.py): one prefill's `Prefix`, the slots'
`DecodeState`, and a request's `SlotSampling`."""

from __future__ import annotations

import dataclasses

import jax
from flax import struct

from flexmarl_jax.rollout.settings import validate_sampling


@dataclasses.dataclass(frozen=True)
class SlotSampling:
    """Sampling settings of one request (all of its samples); see rollout/sampling.py."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        validate_sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, max_new_tokens=1)


GREEDY = SlotSampling()
# The smallest number of leading slots one generate steps (see FlexEngine.slot_bucket).
MIN_SLOT_BUCKET = 4


@struct.dataclass
class Prefix:
    """Result of one prefill of `rows` prompts (1 through the JetStream API): their KV caches and
    the logits of each prompt's next token.

    cache: dict(k=[layers, rows, bucket, kv_heads, head_dim], v=same).
    next_logits: [rows, vocab] f32. true_length: [rows] i32 (prompt tokens, BOS included).
    temperature/top_p: [rows] f32, top_k/seed: [rows] i32.
    adapter: [rows] i32, the row of the engine's adapter table each prompt decodes with (0 without one).
    """

    cache: dict
    next_logits: jax.Array
    true_length: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    adapter: jax.Array


@struct.dataclass
class DecodeState:
    """Everything `generate` transforms; leading axis = slots.

    cache: dict(k=[layers, slots, cache_length, kv_heads, head_dim], v=same).
    next_logits: [slots, vocab] f32. positions, generated, top_k, seed, sample_index, adapter: [slots] i32.
    temperature, top_p: [slots] f32.
    """

    cache: dict
    next_logits: jax.Array
    positions: jax.Array
    generated: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    sample_index: jax.Array
    adapter: jax.Array
