"""Reopening a table: its index rebuilt from the committed arrays, every chunk's checksum checked on the way.

`ReopenedRows` is the half of `AgentTable` (table.py) that runs once, when a file store is opened again; it reads
the table's arrays, blobs and index, which `AgentTable.__init__` sets up.
"""

from __future__ import annotations

import numpy as np
import tensorstore as ts

from flexmarl_jax.store.corruption import CorruptedPositions, StoreCorrupted
from flexmarl_jax.store.schema import STATUS_PREFIX, VERSION_PREFIX, RowState


class ReopenedRows:
    def _loaded(self, name: str, future: ts.Future, row_count: int) -> np.ndarray:
        """A column read at load; a chunk that fails TensorStore's crc32c check (or cannot be decoded) raises
        StoreCorrupted naming the column and its rows."""
        try:
            return future.result()
        except ValueError as error:
            raise StoreCorrupted(self.agent, [], f"column {name!r} (rows 0..{row_count - 1}, chunks of "
                                 f"{self._arrays[name].chunk_layout.read_chunk.shape[0]} rows) fails its "
                                 f"checksum: {error}; the store cannot be opened") from None

    def load(self) -> None:
        """Rebuilds the index from the committed arrays (rows 0 .. row_count-1)."""
        row_count, next_blob_id = self._counters.read().result().tolist()
        self._blobs.next_blob_id = max(1, next_blob_id)
        if row_count == 0:
            return
        futures = {name: array[:row_count].read() for name, array in self._arrays.items()}
        arrays = {name: self._loaded(name, future, row_count) for name, future in futures.items()}
        try:
            strings = self._blobs.read({name: arrays[name] for name in ("sample_id", "group_id")})
        except CorruptedPositions as corrupted:
            raise StoreCorrupted(self.agent, [], f"rows {corrupted.positions()[:8]} ... fail their CRC-32 in the "
                                 f"ids that name them ({corrupted}); the store cannot be opened") from None
        state = arrays["state"].astype(np.int32)
        state[state == RowState.CLAIMED] = RowState.READY  # never written, but a lease is never durable
        names = list(self.data_specs)
        self._index.add_rows(
            sample_ids=strings["sample_id"],
            group_keys=strings["group_id"],
            group_size=arrays["group_size"].astype(np.int64),
            versions=np.stack([arrays[VERSION_PREFIX + a] for a in self.schema.agents], axis=1),
            status=np.stack([arrays[STATUS_PREFIX + n] for n in names], axis=1),
            scalars={n: arrays[n] for n in names if not self.data_specs[n].by_reference},
            refs={n: arrays[n] for n in names if self.data_specs[n].by_reference},
            state=state,
        )
        self._index.settle_loaded_groups()
        finished = np.isin(self._index.state[:row_count], (RowState.CONSUMED, RowState.DROPPED))
        for name, refs in self._index.refs.items():
            if self._free_consumed_values:
                refs[:row_count][finished] = 0  # their blobs were deleted when they finished
            self._blobs.count_loaded(name, refs[:row_count, 0])
