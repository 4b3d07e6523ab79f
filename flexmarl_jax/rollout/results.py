"""`ResultTokens` that also carry the behaviour log-prob of every emitted token.

JetStream 0.2.2 packs tokens, validity and lengths into one int32 array so a
single device-to-host copy moves a whole step's results. We keep that: the f32
log-probs are bit-cast to int32 and appended as extra columns, so the copy stays
one array and JetStream's own code (which reads tokens/valid/lengths through
`get_result_at_slot`) keeps working unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from flexmarl_jax.rollout import engine_api


@dataclasses.dataclass(frozen=True)
class SlotDataWithLogProbs(engine_api.SlotData):
    """`SlotData` plus `logprobs` [samples, speculations] f32."""

    logprobs: jax.Array | np.ndarray = None


@struct.dataclass
class LogProbResultTokens(engine_api.ResultTokens):
    """One generate step's results; `data` is [batch, 3 * spec + 1 (+ 1 + 2 * top)] int32.

    Columns: tokens [0, spec), valid [spec, 2 spec), lengths [2 spec, 2 spec + 1)
    (tokens generated so far, this one included), log-probs bit-cast to int32
    [2 spec + 1, 3 spec + 1). An engine that reports raw log-probs (`EngineConfig.top_logprobs` > 0,
    one speculation) appends the drawn token's raw log-prob, then the `top` most likely token ids and
    their raw log-probs (bit-cast).
    """

    logprobs_idx: tuple[int, int] = struct.field(pytree_node=False, default=(0, 0))
    raw_logprobs_idx: tuple[int, int] = struct.field(pytree_node=False, default=(0, 0))
    top_ids_idx: tuple[int, int] = struct.field(pytree_node=False, default=(0, 0))
    top_logprobs_idx: tuple[int, int] = struct.field(pytree_node=False, default=(0, 0))

    @classmethod
    def pack(cls, tokens: jax.Array, logprobs: jax.Array, lengths: jax.Array, valid: jax.Array,
             raw_logprobs: jax.Array | None = None, top_ids: jax.Array | None = None,
             top_logprobs: jax.Array | None = None):
        """Builds the packed result from [batch] tokens/logprobs/lengths/valid (one speculation), and optionally
        the raw log-prob of each drawn token [batch] with the top ids/raw log-probs [batch, top]."""
        columns = [
            tokens.astype(jnp.int32)[:, None],
            valid.astype(jnp.int32)[:, None],
            lengths.astype(jnp.int32)[:, None],
            _bits(logprobs)[:, None],
        ]
        top = 0
        if raw_logprobs is not None:
            top = top_ids.shape[1]
            columns += [_bits(raw_logprobs)[:, None], top_ids.astype(jnp.int32), _bits(top_logprobs)]
        return cls(
            data=jnp.concatenate(columns, axis=-1),
            tokens_idx=(0, 1),
            valid_idx=(1, 2),
            length_idx=(2, 3),
            samples_per_slot=1,
            logprobs_idx=(3, 4),
            raw_logprobs_idx=(4, 5) if raw_logprobs is not None else (0, 0),
            top_ids_idx=(5, 5 + top),
            top_logprobs_idx=(5 + top, 5 + 2 * top),
        )

    def convert_to_numpy(self) -> LogProbResultTokens:
        return self.replace(data=np.asarray(self.data))

    def logprobs(self) -> np.ndarray:
        """[batch, speculations] f32 log-probs (host copy)."""
        return self._floats(self.logprobs_idx)

    @property
    def has_raw_logprobs(self) -> bool:
        return self.raw_logprobs_idx[1] > self.raw_logprobs_idx[0]

    def raw_logprobs(self) -> np.ndarray:
        """[batch] f32: the drawn token's log-prob under the model's own distribution (host copy)."""
        return self._floats(self.raw_logprobs_idx)[:, 0]

    def top(self) -> tuple[np.ndarray, np.ndarray]:
        """([batch, top] int32 ids, [batch, top] f32 raw log-probs), most likely first (host copy)."""
        start, end = self.top_ids_idx
        return np.asarray(self.data)[:, start:end], self._floats(self.top_logprobs_idx)

    def _floats(self, index: tuple[int, int]) -> np.ndarray:
        columns = np.ascontiguousarray(np.asarray(self.data)[:, index[0] : index[1]])
        return columns.view(np.float32)

    def get_result_at_slot(self, slot: int) -> SlotDataWithLogProbs:
        base = super().get_result_at_slot(slot)
        start, end = slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot
        rows = np.ascontiguousarray(np.asarray(self.data)[start:end, self.logprobs_idx[0] : self.logprobs_idx[1]])
        return SlotDataWithLogProbs(
            tokens=base.tokens, valid=base.valid, lengths=base.lengths, logprobs=rows.view(np.float32)
        )


def _bits(values: jax.Array) -> jax.Array:
    """f32 values as int32 bits, so they travel in the one int32 result array."""
    return jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.int32)
