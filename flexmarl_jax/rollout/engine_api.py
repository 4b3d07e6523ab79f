"""The Engine API types our engines implement, with JetStream 0.2.2's names and packing, without JetStream.

JetStream pulls in seqio and with it TensorFlow (about 4 s per process), so the engines, the rollout loop and
everything that trains build on these plain types; only the JetStream Driver path imports JetStream
(`jetstream_compat.driver_engine` wraps an engine so the Driver sees JetStream's own result type). Only what our
code and the Driver read is here: `ResultTokens` keeps tokens, validity and lengths in one int32 array so a
step's results reach the host in a single copy.
"""

from __future__ import annotations

import abc
import dataclasses

import jax
import numpy as np
from flax import struct


@struct.dataclass
class SlotData:
    """One slot's results: tokens / valid [samples, speculations], lengths [samples]."""

    tokens: jax.Array | np.ndarray
    valid: jax.Array | np.ndarray
    lengths: jax.Array | np.ndarray


@struct.dataclass
class ResultTokens:
    """One generate step's results packed into `data` [slots * samples, columns] int32; the `*_idx` pairs
    are the column ranges of tokens, validity and lengths."""

    data: jax.Array | np.ndarray
    tokens_idx: tuple[int, int] = struct.field(pytree_node=False)
    valid_idx: tuple[int, int] = struct.field(pytree_node=False)
    length_idx: tuple[int, int] = struct.field(pytree_node=False)
    samples_per_slot: int = struct.field(pytree_node=False)

    def copy_to_host_async(self) -> None:
        if not isinstance(self.data, np.ndarray):
            self.data.copy_to_host_async()

    def convert_to_numpy(self) -> ResultTokens:
        return self.replace(data=np.asarray(self.data))

    def get_result_at_slot(self, slot: int) -> SlotData:
        rows = slice(slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot)
        return SlotData(
            tokens=self.data[rows, self.tokens_idx[0]:self.tokens_idx[1]],
            valid=self.data[rows, self.valid_idx[0]:self.valid_idx[1]],
            lengths=self.data[rows, self.length_idx[0]:self.length_idx[1]][:, 0],
        )


class Engine(abc.ABC):  # noqa: B024  (a base class by role: FlexEngine implements the whole API)
    """The base of `FlexEngine` and `EmulatedEngine`: prefill / insert / generate and their settings."""


class Tokenizer(abc.ABC):  # noqa: B024
    """The base of `FlexTokenizer`: encode / decode / pad_id / eos_id / bos_id / stop_tokens."""


@dataclasses.dataclass(frozen=True)
class TokenizerParameters:
    """What `Engine.get_tokenizer` returns (JetStream's is a protobuf message with these fields)."""

    path: str = ""
    extra_ids: int = 0
