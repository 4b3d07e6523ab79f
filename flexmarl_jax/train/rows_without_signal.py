"""Rows whose gradient is exactly zero, found before the step so that it need not compute them.

A GRPO group whose samples all got the same reward has advantage 0 on every token. With the clipped
surrogate, `pg = -min(ratio * A, clip(ratio) * A)`, such a row's loss and gradient are exactly 0 whatever the
parameters, so a pass of such rows adds exactly +0 to the accumulated gradient. Early in a run most groups are
like that (a hard problem: all wrong; later, an easy one: all right), and computing them was most of a
training step's time.

It is exact only while nothing else in the loss reads the row: no KL term (`kl_coef` 0), no truncated IS (its
token statistics would miss the row), no critic (PPO's value loss), and the PPO ratio's denominator taken in
the step (`old_logprobs_in_step`: then the ratio is exactly 1, so the one metric a row without signal adds,
the weighted ratio sum, is known without computing it). `skips_rows_without_signal` says when, and whether
`train.skip_rows_without_signal` is on (the emulation's calibration turns it off: the paper's system computes
every row). tests/train/test_rows_without_signal.py checks that gradients and metrics are the ones of computing
every row.
"""

from __future__ import annotations

import numpy as np

from flexmarl_jax.train.batch import MicroBatch
from flexmarl_jax.train.trainer_config import TrainerConfig


def skips_rows_without_signal(config: TrainerConfig) -> bool:
    """Whether a row with advantage 0 on all its trained tokens contributes exactly nothing (see above)."""
    loss = config.loss
    return (config.skip_rows_without_signal and loss.name == "grpo" and loss.kl_coef == 0 and loss.tis_cap is None
            and config.old_logprobs_in_step)


def rows_with_signal(batch: MicroBatch) -> np.ndarray:
    """[rows] bool: whether the row (or packed bin) has a trained token with a nonzero advantage."""
    advantages = np.asarray(batch.advantages)
    return np.any(np.asarray(batch.loss_mask) & (advantages != 0), axis=1)


def metrics_of_rows(batch: MicroBatch, rows: np.ndarray) -> dict[str, float]:
    """What the step's metrics (train/losses.py) would have summed over `rows` of `batch` without signal: their
    trained tokens and their weighted ratio (each ratio exactly 1); every other metric of theirs is 0."""
    mask = np.asarray(batch.loss_mask)[rows]
    weights = np.asarray(batch.token_weights)[rows]
    return {"num_tokens": float(mask.sum()), "ratio": float(np.where(mask, weights, 0.0).sum())}


def without_rows(batch: MicroBatch, rows: np.ndarray) -> MicroBatch:
    """`batch` with `rows` emptied (no input token, nothing trained), as a short micro-batch's padding rows are:
    packing (train/packing.py) drops them."""
    rows = np.asarray(rows, bool)
    emptied = {}
    for name in ("attention_mask", "loss_mask", "token_weights"):
        values = np.array(getattr(batch, name))
        values[rows] = 0
        emptied[name] = values
    return batch.replace(**emptied)
