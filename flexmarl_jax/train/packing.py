"""Packed micro-batches: several sequences per row, so a long-tailed batch stops paying for its padding.

A micro-batch (train/batch.py) pads every row to the length bucket of its longest row: with one 1,000-token
response among fifteen of 100, 84% of the `[16, 1024]` batch is padding, and the step computes all of it.
Packing lays the rows end to end into bins of that same length, first-fit by decreasing length, and the step
runs on the bins only: here 3 bins, rounded up to 4 (`packed_bin_counts`), a quarter of the work.

Nothing else changes. Every per-token array moves with its token; `positions` restart at 0 for each sequence
and `segment_ids` (1, 2, ... within a bin, 0 on padding) keep its attention inside the sequence
(`models.functional.segment_causal_mask`). The token weights were computed per row before packing (the
iteration's normalisers, `token_weights_for`), and a row's last input predicts its own last target, never the
next sequence's first token, so the loss is the same per-token sum and its gradient the same (float32, to
rounding: tests/train/test_packing.py). PPO's GAE runs on the unpacked rows before packing (orchestrator/
dispatch.py), so it never crosses a segment.

Compiles stay bounded: a bin has a length bucket's length, and the number of bins is one of
`packed_bin_counts` (powers of two up to the pass size, then multiples of it).
"""

from __future__ import annotations

import numpy as np

from flexmarl_jax.train.batch import ARRAY_FIELDS, MicroBatch


def packed_bin_counts(micro_batch_size: int, pass_rows: int, row_multiple: int = 1) -> tuple[int, ...]:
    """The numbers of bins a packed micro-batch may have: powers of two (each a multiple of `row_multiple`, the
    data-parallel split of a pass) below `pass_rows`, then every multiple of `pass_rows` up to the micro-batch
    size. A trainer runs up to `pass_rows` bins in one pass and more in passes of `pass_rows`."""
    counts = set()
    count = row_multiple
    while count < pass_rows:
        counts.add(count)
        count *= 2
    counts.update(range(pass_rows, micro_batch_size + 1, pass_rows))
    return tuple(sorted(counts))


def first_fit_bins(lengths, capacity: int) -> list[list[int]]:
    """Row indices grouped into bins of at most `capacity` tokens: first fit by decreasing length (ties in row
    order; at most 11/9 of the fewest bins, plus one), deterministic for a given batch."""
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda index: (-lengths[index], index)):
        length = int(lengths[row])
        if length > capacity:
            raise ValueError(f"row {row} has {length} tokens, more than a bin's {capacity}")
        for index, left in enumerate(room):
            if length <= left:
                bins[index].append(row)
                room[index] -= length
                break
        else:
            bins.append([row])
            room.append(capacity - length)
    return bins


def _bin_layout(attention_mask, bin_counts: tuple[int, ...]) -> tuple[list[list[int]], np.ndarray, int]:
    """(bins as lists of row indices, each row's token count, the number of bins allowed to hold them) of an
    unpacked batch's [rows, L] attention mask: its non-empty rows first-fit into bins of length L."""
    mask = np.asarray(attention_mask)
    lengths = mask.sum(axis=1)
    real = [row for row in range(mask.shape[0]) if lengths[row] > 0]
    groups = [[real[member] for member in group]
              for group in first_fit_bins([int(lengths[row]) for row in real], mask.shape[1])]
    fitting = [count for count in bin_counts if count >= max(len(groups), 1)]
    if not fitting:
        raise ValueError(f"{len(groups)} bins do not fit any allowed bin count {bin_counts}")
    return groups, lengths, fitting[0]


def packed_shape(batch: MicroBatch, bin_counts: tuple[int, ...]) -> tuple[int, int]:
    """(bins, length) that `pack_micro_batch` gives `batch`, without copying anything (the emulated trainer's
    charge)."""
    return _bin_layout(batch.attention_mask, bin_counts)[2], int(np.shape(batch.attention_mask)[1])


def pack_micro_batch(batch: MicroBatch, bin_counts: tuple[int, ...]) -> MicroBatch:
    """`batch` (unpacked: one right-padded sequence per row) with its sequences packed into bins of the batch's
    length; the number of bins is the smallest of `bin_counts` that holds them (a ValueError when none does).
    All-padding rows (a short last micro-batch) are dropped; they carry no weight."""
    if batch.segment_ids is not None:
        raise ValueError("the micro-batch is packed already")
    groups, lengths, bins = _bin_layout(batch.attention_mask, bin_counts)
    shape = (bins, int(np.shape(batch.attention_mask)[1]))
    source = {name: np.asarray(getattr(batch, name)) for name in ARRAY_FIELDS}
    out = {name: np.zeros(shape, values.dtype) for name, values in source.items()}
    # Padding positions hold 0 everywhere: no query sees them (segment 0) and they weigh nothing.
    segment_ids = np.zeros(shape, np.int32)
    for bin_index, group in enumerate(groups):
        offset = 0
        for segment, row in enumerate(group, start=1):
            n = int(lengths[row])
            for name, values in source.items():
                out[name][bin_index, offset:offset + n] = values[row, :n]
            segment_ids[bin_index, offset:offset + n] = segment
            offset += n
    return MicroBatch(**out, segment_ids=segment_ids, agent=batch.agent)


def padding_fraction(batch: MicroBatch) -> float:
    """The share of the batch's positions that hold no token (packed or not)."""
    mask = np.asarray(batch.attention_mask)
    return 1.0 - float(mask.sum()) / mask.size
