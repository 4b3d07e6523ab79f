"""By-reference values of one agent's table: blob ids, how many rows point at each blob, ranged reads.

One write (an append or a ``set_columns`` call) puts each by-reference column's values of all its rows into
one blob; rows hold (blob_id, offset, length). A blob that no row points at any more (values overwritten,
or rows consumed/dropped when the store frees them) is deleted in the same transaction. The caller holds
the table lock for everything except ``read``: blobs are immutable once written, so reads need no lock.

Blobs written by this process are also kept decoded in memory until no unconsumed row points at them, so a
claim (which reads rows appended moments earlier) does not go back to TensorStore for them. Every value read
back from TensorStore is checked against the CRC-32 in its row's reference; rows that fail raise
``CorruptedPositions`` (the table names them and fails them).
"""

from __future__ import annotations

import collections

import numpy as np
import tensorstore as ts

from flexmarl_jax.store import layout
from flexmarl_jax.store.commit import Committer, WriteBatch
from flexmarl_jax.store.corruption import CorruptedPositions
from flexmarl_jax.store.schema import ColumnSpec
from flexmarl_jax.store.values import corrupted_rows, unpack_rows


class Blobs:
    def __init__(self, agent: str, specs: dict[str, ColumnSpec], kvstore: ts.KvStore, committer: Committer):
        self.agent = agent
        self._specs = specs
        self._kvstore = kvstore
        self._committer = committer
        self.next_blob_id = 1  # blob id 0 means "no value"
        self._rows: dict[tuple[str, int], int] = {}  # (data column, blob id) -> rows pointing at it
        # (data column, blob id) -> decoded blob, and how many rows not yet consumed point at it
        self._cache: dict[tuple[str, int], np.ndarray | bytes] = {}
        self._cached_rows: dict[tuple[str, int], int] = {}

    def assign_ids(self, packed: dict[str, tuple[bytes, np.ndarray]]) -> dict[str, np.ndarray]:
        """Gives each packed column's blob the next id; returns the refs [rows, 3] per column."""
        refs = {}
        for name, (_, column_refs) in packed.items():
            column_refs[:, 0] = self.next_blob_id
            self.next_blob_id += 1
            refs[name] = column_refs
        return refs

    def track(self, refs: dict[str, np.ndarray], num_rows: int, packed: dict[str, tuple[bytes, np.ndarray]]) -> None:
        """New blobs of data columns, each pointed at by ``num_rows`` rows (meta strings are never freed);
        ``packed`` holds their bytes, cached decoded for reads."""
        for name, column_refs in refs.items():
            spec = self._specs[name]
            if spec.role == "data" and num_rows:
                key = name, int(column_refs[0, 0])
                self._rows[key] = num_rows
                raw = packed[name][0]
                self._cache[key] = raw if spec.kind == "str" else layout.decode_blob(raw, spec.dtype)
                self._cached_rows[key] = num_rows

    def forget(self, name: str, blob_ids: np.ndarray) -> None:
        """Rows pointing at ``blob_ids`` [rows] are done (consumed, dropped or overwritten): blobs no longer
        needed by any live row leave the cache (the stored blob is untouched)."""
        for blob_id in _decrement(self._cached_rows, name, _counts(blob_ids)):
            self._cache.pop((name, blob_id), None)

    def count_loaded(self, name: str, blob_ids: np.ndarray) -> None:
        for blob_id, count in _counts(blob_ids).items():
            self._rows[name, blob_id] = count

    def release(self, batch: WriteBatch, name: str, blob_ids: np.ndarray) -> None:
        """``blob_ids`` [rows] no longer hold these rows' values; deletes blobs left without rows."""
        counts = _counts(blob_ids)
        for blob_id in _decrement(self._cached_rows, name, counts):
            self._cache.pop((name, blob_id), None)
        for blob_id in _decrement(self._rows, name, counts):
            batch.delete_blob(layout.blob_key(self.agent, name, blob_id))

    def read(self, refs: dict[str, np.ndarray], *, missing_ok: bool = False) -> dict[str, list]:
        """Values of by-reference columns (None where never set): one ranged read per (column, blob).

        ``missing_ok``: a deleted blob (its rows were consumed and freed) reads as None instead of raising.
        Raises CorruptedPositions when values read from TensorStore fail their CRC-32 (positions into ``refs``).
        """
        reads = {}
        # Blob ids per column, in first-seen order (dict.fromkeys: cheaper than np.unique for a few ids).
        blob_ids = {name: [b for b in dict.fromkeys(column_refs[:, 0].tolist()) if b != 0]
                    for name, column_refs in refs.items()}
        for name, column_refs in refs.items():
            itemsize = self._specs[name].dtype.itemsize
            for blob_id in blob_ids[name]:
                cached = self._cache.get((name, blob_id))
                if cached is not None:
                    reads[name, blob_id] = (0, cached, True)
                    continue
                in_blob = column_refs[column_refs[:, 0] == blob_id]
                low = int(in_blob[:, 1].min())
                high = int((in_blob[:, 1] + in_blob[:, 2]).max())
                byte_range = slice(low * itemsize, high * itemsize)
                key = layout.blob_key(self.agent, name, blob_id)
                pending = self._committer.pending_blob(key)  # queued, maybe not committed yet
                if pending is not None:
                    read = pending[byte_range]
                elif high == low:
                    read = b""
                else:
                    read = self._kvstore.read(key, byte_range=byte_range)
                reads[name, blob_id] = (low, read, False)
        out = {}
        corrupted: dict[str, list[int]] = {}
        corrupted_keys = []
        for name, column_refs in refs.items():
            spec = self._specs[name]
            values: list = [None] * len(column_refs)
            for blob_id in blob_ids[name]:
                low, raw, decoded = reads[name, blob_id]
                positions = np.flatnonzero(column_refs[:, 0] == blob_id)
                local_refs = column_refs[positions] - np.array([0, low, 0, 0])
                if not isinstance(raw, bytes) and not decoded:
                    result = raw.result()
                    if result.state != "value":
                        if missing_ok:
                            continue
                        raise RuntimeError(f"blob {layout.blob_key(self.agent, name, blob_id)} is missing")
                    raw = result.value
                    # Bytes from disk (not this process's memory): each row's value must match its CRC-32.
                    bad = corrupted_rows(spec, raw, local_refs)
                    if len(bad):
                        corrupted.setdefault(name, []).extend(positions[bad].tolist())
                        corrupted_keys.append(layout.blob_key(self.agent, name, blob_id))
                        continue
                blob = raw if decoded or spec.kind == "str" else layout.decode_blob(raw, spec.dtype)
                for position, value in zip(
                    positions.tolist(), unpack_rows(spec, blob, local_refs), strict=True
                ):
                    values[position] = value
            out[name] = values
        if corrupted:
            raise CorruptedPositions(corrupted, corrupted_keys)
        return out


def _counts(blob_ids: np.ndarray) -> collections.Counter:
    """Rows per blob id (0, "no value", left out)."""
    return collections.Counter(blob_ids[blob_ids > 0].tolist())


def _decrement(rows: dict[tuple[str, int], int], name: str, counts: collections.Counter) -> list[int]:
    """Takes ``counts`` off ``rows[name, blob_id]``; returns the blob ids left with none (removed)."""
    emptied = []
    for blob_id, count in counts.items():
        left = rows.get((name, blob_id), 0) - count
        if left > 0:
            rows[name, blob_id] = left
        else:
            rows.pop((name, blob_id), None)
            emptied.append(blob_id)
    return emptied
