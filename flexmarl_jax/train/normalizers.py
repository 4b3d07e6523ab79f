"""Iteration-wide loss normalisers, fixed before any micro-batch runs so accumulation is exact.

A mean over an iteration only splits into micro-batches if every micro-batch divides by the *iteration's*
count, not its own. So the counts are taken from the whole iteration up front, and each micro-batch
carries per-token weights ``w`` such that the iteration loss is ``sum_over_micro_batches(sum(w * l))``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from flexmarl_jax.train.registry import Registry


@dataclasses.dataclass(frozen=True)
class IterationNormalizers:
    """Counts of one agent's whole iteration.

    total_tokens: response tokens trained on in the iteration (token-mean denominator).
    num_sequences: samples in the iteration (sequence-mean denominator).
    norm_length: constant length for Dr.GRPO's length-unbiased aggregation (usually max response length).
    """

    total_tokens: int
    num_sequences: int
    norm_length: int

    def __post_init__(self):
        for name in ("total_tokens", "num_sequences", "norm_length"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"IterationNormalizers.{name}={getattr(self, name)} must be > 0")

    @classmethod
    def from_response_lengths(cls, lengths: Sequence[int], norm_length: int | None = None):
        """From the response lengths of every sample of the iteration (before any micro-batch runs)."""
        lengths = [int(n) for n in lengths]
        if not lengths:
            raise ValueError("an iteration needs at least one sample to normalise over")
        return cls(total_tokens=sum(lengths), num_sequences=len(lengths),
                   norm_length=int(norm_length or max(lengths)))


WeightFn = Callable[[np.ndarray, IterationNormalizers], np.ndarray]
AGGREGATIONS: Registry[WeightFn] = Registry("loss aggregation")


@AGGREGATIONS.register("token_mean")
def _token_mean(loss_mask: np.ndarray, norm: IterationNormalizers) -> np.ndarray:
    """Every trained token of the iteration counts equally (DAPO's token-level loss)."""
    return loss_mask / np.float32(norm.total_tokens)


@AGGREGATIONS.register("seq_mean")
def _seq_mean(loss_mask: np.ndarray, norm: IterationNormalizers) -> np.ndarray:
    """Mean over each sequence's tokens, then mean over the iteration's sequences (original GRPO)."""
    lengths = loss_mask.sum(axis=-1, keepdims=True).astype(np.float32)
    return loss_mask / np.maximum(lengths, 1.0) / np.float32(norm.num_sequences)


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def _seq_sum_constant(loss_mask: np.ndarray, norm: IterationNormalizers) -> np.ndarray:
    """Dr.GRPO: token sums divided by a constant length, so long answers are not down-weighted."""
    return loss_mask / np.float32(norm.norm_length) / np.float32(norm.num_sequences)


def token_weights_for(aggregation: str, loss_mask: np.ndarray, norm: IterationNormalizers) -> np.ndarray:
    """Per-token weights ``[batch, seq]`` float32 for ``aggregation`` (zero where ``loss_mask`` is False)."""
    weights = AGGREGATIONS.get(aggregation)(np.asarray(loss_mask, np.bool_), norm)
    return np.asarray(weights, np.float32)
