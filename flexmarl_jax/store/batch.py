"""What a trainer claims from the store: whole GRPO groups of one agent, with their values (the trainer turns
them into a `train.batch.MicroBatch` of padded arrays)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ClaimedRows:
    """Rows claimed together by ``ExperienceStore.claim_micro_batch``.

    Rows of one group are contiguous; ``group_index`` numbers the groups 0..num_groups-1 in batch order.
    Scalar columns are arrays [rows]; sequence columns are lists of 1-D read-only arrays (ragged), see
    ``padded``; str columns are lists of str. ``policy_versions[agent]`` is [rows] int64, -1 where the row
    does not depend on that agent.
    """

    agent: str
    claim_id: int
    rows: np.ndarray  # [rows] int64 row numbers in the agent's table
    sample_ids: tuple[str, ...]
    group_ids: tuple[str, ...]  # [groups]
    group_index: np.ndarray  # [rows] int32
    policy_versions: dict[str, np.ndarray]
    columns: dict[str, object]
    # Rows of the agent still claimable right after this claim, and the table's change count then: a
    # consumer for whom `claimable_after` is too few passes `since=table_changes` to its next claim, which
    # then waits for new rows instead of looking again at the same ones.
    claimable_after: int = 0
    table_changes: int = 0

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_groups(self) -> int:
        return len(self.group_ids)

    def padded(
        self, column: str, *, pad_value: float = 0, length: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """A sequence column as ([rows, length] array right-padded with ``pad_value``, lengths [rows] int32).

        ``length`` defaults to the longest row; a row longer than ``length`` raises ValueError."""
        sequences = self.columns[column]
        if not isinstance(sequences, list) or (sequences and not isinstance(sequences[0], np.ndarray)):
            raise ValueError(f"column {column!r} is not a sequence column")
        lengths = np.fromiter((len(s) for s in sequences), np.int32, len(sequences))
        longest = int(lengths.max()) if len(lengths) else 0
        length = longest if length is None else length
        if longest > length:
            raise ValueError(f"column {column!r} has a row of length {longest} > length={length}")
        dtype = sequences[0].dtype if sequences else np.float32
        out = np.full((len(sequences), length), pad_value, dtype=dtype)
        for i, sequence in enumerate(sequences):
            out[i, : len(sequence)] = sequence
        return out, lengths
