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
    """One generate step's results; `data` is [batch, 3 * spec + 1] int32.

    Columns: tokens [0, spec), valid [spec, 2 spec), lengths [2 spec, 2 spec + 1)
    (tokens generated so far, this one included), log-probs bit-cast to int32
    [2 spec + 1, 3 spec + 1).
    """

    logprobs_idx: tuple[int, int] = struct.field(pytree_node=False, default=(0, 0))

    @classmethod
    def pack(cls, tokens: jax.Array, logprobs: jax.Array, lengths: jax.Array, valid: jax.Array):
        """Builds the packed result from [batch] tokens/logprobs/lengths/valid (one speculation)."""
        data = jnp.stack(
            [
                tokens.astype(jnp.int32),
                valid.astype(jnp.int32),
                lengths.astype(jnp.int32),
                jax.lax.bitcast_convert_type(logprobs.astype(jnp.float32), jnp.int32),
            ],
            axis=-1,
        )
        return cls(
            data=data,
            tokens_idx=(0, 1),
            valid_idx=(1, 2),
            length_idx=(2, 3),
            samples_per_slot=1,
            logprobs_idx=(3, 4),
        )

    def convert_to_numpy(self) -> LogProbResultTokens:
        return self.replace(data=np.asarray(self.data))

    def logprobs(self) -> np.ndarray:
        """[batch, speculations] f32 log-probs (host copy)."""
        columns = np.ascontiguousarray(np.asarray(self.data)[:, self.logprobs_idx[0] : self.logprobs_idx[1]])
        return columns.view(np.float32)

    def get_result_at_slot(self, slot: int) -> SlotDataWithLogProbs:
        base = super().get_result_at_slot(slot)
        start, end = slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot
        rows = np.ascontiguousarray(np.asarray(self.data)[start:end, self.logprobs_idx[0] : self.logprobs_idx[1]])
        return SlotDataWithLogProbs(
            tokens=base.tokens, valid=base.valid, lengths=base.lengths, logprobs=rows.view(np.float32)
        )
