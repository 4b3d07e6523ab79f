"""One agent's table: validates input, updates the in-memory index under a lock, mirrors it to TensorStore.

Every public method is thread-safe. Values are checked before the lock is taken and before anything
changes, so a bad call writes nothing. Writes are queued to the shared ``Committer`` while the lock is held
(their order is the index's order) and awaited after it is released, so slow commits do not block claims.
Claims and releases touch memory only: a claim is a lease, and a reopened store shows claimed rows READY.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np
import tensorstore as ts

from flexmarl_jax.store import layout
from flexmarl_jax.store.append_input import AppendInput, coerce_data
from flexmarl_jax.store.batch import ClaimedRows
from flexmarl_jax.store.blobs import Blobs
from flexmarl_jax.store.commit import Committer, WriteBatch
from flexmarl_jax.store.corruption import CorruptedPositions, StoreCorrupted
from flexmarl_jax.store.index import RowIndex
from flexmarl_jax.store.reopening import ReopenedRows
from flexmarl_jax.store.schema import (
    STATUS_PREFIX,
    VERSION_PREFIX,
    RowState,
    TableSchema,
)
from flexmarl_jax.store.values import pack_blob


def _as_index(rows: np.ndarray) -> slice | np.ndarray:
    """A slice when ``rows`` (sorted) are contiguous: cheaper to write than a scattered index."""
    if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows


class AgentTable(ReopenedRows):
    """The table of one agent (see ``ExperienceStore`` for the meaning of each operation)."""

    def __init__(
        self,
        agent: str,
        schema: TableSchema,
        *,
        base_spec: dict,
        context: ts.Context,
        kvstore: ts.KvStore,
        committer: Committer,
        rows_per_chunk: int,
        free_consumed_values: bool,
    ):
        self.agent = agent
        self.schema = schema
        self.specs = {spec.name: spec for spec in schema.all_specs()}
        self.data_specs = {spec.name: spec for spec in schema.data_specs()}
        self._agent_position = {name: i for i, name in enumerate(schema.agents)}
        self._kvstore = kvstore
        self._committer = committer
        # Opened together (TensorStore opens in parallel), created where missing.
        futures = {
            name: layout.open_array_async(layout.column_array_spec(base_spec, agent, spec, rows_per_chunk), context)
            for name, spec in self.specs.items()
        }
        self._counters = layout.open_array_async(layout.counters_array_spec(base_spec, agent), context).result()
        self._arrays = {name: future.result() for name, future in futures.items()}
        self._index = RowIndex(schema)
        self._cond = threading.Condition(threading.Lock())
        self._changes = 0  # appends, value updates and releases so far: what can make rows claimable
        self._blobs = Blobs(agent, self.specs, kvstore, committer)
        self._free_consumed_values = free_consumed_values

    # ---- append ----------
    def append(self, rows_in: AppendInput) -> list[str]:
        """Appends rows checked by ``check_append`` (see ``ExperienceStore.append_rows``)."""
        num_rows, group_size, input_ids, turns, trajectory_ids = (
            rows_in.num_rows, rows_in.group_size, rows_in.input_ids, rows_in.turns, rows_in.trajectory_ids)
        sample_ids, group_keys, versions, values = (
            rows_in.sample_ids, rows_in.group_keys, rows_in.versions, rows_in.values)
        packed = self._pack_sequences(values)
        for name, strings in (("sample_id", sample_ids), ("input_id", input_ids), ("group_id", group_keys)):
            packed[name] = pack_blob(self.specs[name], strings, 0)
        status = np.zeros((num_rows, len(self.data_specs)), bool)
        for name in values:
            status[:, self._index.data_position[name]] = True
        group_size_rows = np.full(num_rows, group_size, np.int64)
        now = time.time()
        ready_at = np.where(status.all(axis=1), now, np.nan)

        with self._cond:
            self._index.check_new_rows(sample_ids, group_keys, group_size_rows)
            refs = self._blobs.assign_ids(packed)
            start = self._index.num_rows
            state = self._index.add_rows(
                sample_ids=sample_ids,
                group_keys=group_keys,
                group_size=group_size_rows,
                versions=versions,
                status=status,
                scalars={k: v for k, v in values.items() if not isinstance(v, list)},
                refs={k: v for k, v in refs.items() if k in self.data_specs},
                state=None,
            )
            rows = slice(start, start + num_rows)
            batch = WriteBatch()
            self._write_blobs(batch, packed, refs, rows)
            self._blobs.track(refs, num_rows, packed)
            # Rows joining a group that was dropped are dropped too: their values go as a drop's would.
            self._free_values(batch, start + np.flatnonzero(state == RowState.DROPPED))
            columns_out = {
                "state": state,
                "turn": turns,
                "trajectory_id": trajectory_ids,
                "group_size": group_size_rows.astype(np.int32),
                "created_at": np.full(num_rows, now),
                "ready_at": ready_at,
            }
            for agent, position in self._agent_position.items():
                columns_out[VERSION_PREFIX + agent] = versions[:, position]
            for name, value in values.items():
                if not isinstance(value, list):
                    columns_out[name] = value
                columns_out[STATUS_PREFIX + name] = np.ones(num_rows, bool)
            for name, value in columns_out.items():
                batch.write(self._arrays[name], rows, np.asarray(value))
            batch.write(self._counters, slice(0, 2), np.array([start + num_rows, self._blobs.next_blob_id]))
            seq = self._committer.enqueue(batch)
            self._note_change()
        self._committer.settle(seq)
        return sample_ids

    def _data_names(self, columns: Sequence[str] | None) -> list[str]:
        """The data columns asked for (all when None); unknown names raise ValueError."""
        names = list(self.data_specs) if columns is None else list(columns)
        unknown = [name for name in names if name not in self.data_specs]
        if unknown:
            raise ValueError(
                f"column(s) {unknown} are not data columns of {self.agent!r}: {list(self.data_specs)}"
            )
        return names

    def _pack_sequences(self, values: Mapping[str, object]) -> dict[str, tuple[bytes, np.ndarray]]:
        """One blob per by-reference column given (refs still with blob id 0)."""
        return {name: pack_blob(self.specs[name], v, 0) for name, v in values.items() if isinstance(v, list)}

    def _free_values(self, batch: WriteBatch, rows: np.ndarray) -> None:
        """Consumed/dropped rows give up their sequence values when the store frees them (memory default);
        otherwise the values stay stored and only leave the read cache."""
        if not len(rows):
            return
        if not self._free_consumed_values:
            for name, refs in self._index.refs.items():
                self._blobs.forget(name, refs[rows, 0])
            return
        for name, refs in self._index.refs.items():
            self._blobs.release(batch, name, refs[rows, 0])
            refs[rows] = 0

    def _write_blobs(self, batch: WriteBatch, packed: dict, refs: dict, rows: slice | np.ndarray) -> None:
        for name, (data, _) in packed.items():
            batch.put_blob(layout.blob_key(self.agent, name, int(refs[name][0, 0])), data)
            batch.write(self._arrays[name], rows, refs[name])

    # ---- set columns ------------------------------------------------------------------------------------
    def set_columns(self, rows: Sequence[str] | np.ndarray, columns: Mapping[str, object]) -> None:
        by_id = not isinstance(rows, np.ndarray)
        if by_id and (isinstance(rows, str) or not isinstance(rows, Sequence)):
            raise TypeError(
                f"rows must be a list of sample ids or an int array of rows, got {type(rows).__name__}"
            )
        num_rows = len(rows)
        values = coerce_data(self.agent, self.data_specs, columns, num_rows)
        if not values or num_rows == 0:
            return
        packed = self._pack_sequences(values)
        now = time.time()
        with self._cond:
            row_ids = self._index.rows_of(list(rows)) if by_id else self._check_rows(rows)
            if len(np.unique(row_ids)) != num_rows:
                raise ValueError("set_columns got the same row twice")
            held = np.isin(self._index.state[row_ids], (RowState.CLAIMED, RowState.CONSUMED))
            if held.any():
                row = int(row_ids[held][0])
                raise ValueError(
                    f"row {self._index.sample_ids[row]!r} is {RowState(self._index.state[row]).name}; "
                    "its values can no longer change"
                )
            order = np.argsort(row_ids)
            row_ids = row_ids[order]
            index = _as_index(row_ids)
            refs = self._blobs.assign_ids(packed)
            batch = WriteBatch()
            for name in packed:
                refs[name] = refs[name][order]
                self._blobs.release(batch, name, self._index.refs[name][row_ids, 0])
                self._index.refs[name][row_ids] = refs[name]
            self._blobs.track(refs, num_rows, packed)
            self._write_blobs(batch, packed, refs, index)
            self._free_values(batch, row_ids[self._index.state[row_ids] == RowState.DROPPED])
            for name, value in values.items():
                if not isinstance(value, list):
                    value = value[order]
                    self._index.scalars[name][row_ids] = value
                    batch.write(self._arrays[name], index, value)
                batch.write(self._arrays[STATUS_PREFIX + name], index, np.ones(num_rows, bool))
            became_ready = np.sort(self._index.mark_complete(row_ids, list(values)))
            if len(became_ready):
                ready_index = _as_index(became_ready)
                batch.write(
                    self._arrays["state"], ready_index, np.full(len(became_ready), RowState.READY, np.int32)
                )
                batch.write(self._arrays["ready_at"], ready_index, np.full(len(became_ready), now))
            if packed:
                batch.write(self._counters, slice(1, 2), np.array([self._blobs.next_blob_id]))
            seq = self._committer.enqueue(batch)
            self._note_change()
        self._committer.settle(seq)

    def _check_rows(self, rows: np.ndarray) -> np.ndarray:
        if rows.dtype.kind not in "iu" or rows.ndim != 1:
            raise TypeError(f"rows must be a 1-D int array, got dtype {rows.dtype} shape {rows.shape}")
        if len(rows) and (rows.min() < 0 or rows.max() >= self._index.num_rows):
            raise ValueError(f"rows must be in [0, {self._index.num_rows}); got [{rows.min()}, {rows.max()}]")
        return rows.astype(np.int64)

    # ---- claims ----------
    def claim(
        self,
        size: int,
        current: np.ndarray,
        max_staleness: int,
        *,
        columns: Sequence[str] | None,
        allow_partial: bool,
        min_rows: int = 1,
        timeout: float | None,
        until: threading.Event | None = None,
        since: int | None = None,
    ) -> ClaimedRows | None:
        names = self._data_names(columns)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if since is None or self._changes > since:  # else: nothing changed since the caller looked
                    groups, claimable_rows = self._select_groups(size, current, max_staleness, allow_partial,
                                                                 min_rows)
                    if groups is not None:
                        break
                    since = self._changes  # select again only after a change
                remaining = None if deadline is None else deadline - time.monotonic()
                # `until` is read under the lock and `wake` notifies under it: a wake-up cannot be missed.
                if (remaining is not None and remaining <= 0) or (until is not None and until.is_set()):
                    return None
                self._cond.wait(remaining)
            claim_id, claim = self._index.claim(groups)
            changes = self._changes
            rows = claim.rows
            index = self._index
            sample_ids = tuple(index.sample_ids[r] for r in rows.tolist())
            group_ids = tuple(index.group_ids[g] for g in groups.tolist())
            group_index = np.repeat(np.arange(len(groups), dtype=np.int32), index.group_size[groups])
            versions = index.versions[rows]
            scalars = {n: index.scalars[n][rows] for n in names if n in index.scalars}
            refs = {n: index.refs[n][rows] for n in names if n in index.refs}
        # Blobs are immutable once written, so reading them needs no lock.
        values: dict[str, object] = dict(scalars)
        try:
            values.update(self._blobs.read(refs))
        except CorruptedPositions as corrupted:
            raise self._fail_corrupted_claim(claim_id, rows[corrupted.positions()], corrupted) from None
        return ClaimedRows(
            agent=self.agent,
            claim_id=claim_id,
            rows=rows,
            sample_ids=sample_ids,
            group_ids=group_ids,
            group_index=group_index,
            policy_versions={a: versions[:, i] for a, i in self._agent_position.items()},
            columns={name: values[name] for name in names},
            claimable_after=claimable_rows - len(rows),
            table_changes=changes,
        )

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _note_change(self) -> None:
        """Rows may have become claimable (call with the lock held): wake claims waiting for a change."""
        self._changes += 1
        self._cond.notify_all()

    def _select_groups(
        self, size: int, current: np.ndarray, max_staleness: int, allow_partial: bool, min_rows: int = 1
    ) -> tuple[np.ndarray | None, int]:
        """(the groups a claim takes, or None; rows claimable in all)."""
        # An exact claim must be fillable by whole groups; a partial one takes whole groups up to `size`
        # (agents with conditional calls have groups of varying sizes).
        for group_size in [] if allow_partial else sorted(self._index.live_group_sizes()):
            if size % group_size:
                raise ValueError(
                    f"size={size} is not a multiple of group_size={group_size} of agent {self.agent!r}; "
                    "claims take whole groups, so size must be a multiple of every group size of the table"
                )
        groups = self._index.claimable_groups(current, max_staleness)
        sizes = self._index.group_size[groups]
        total = np.cumsum(sizes)
        take = int(np.searchsorted(total, size, side="right"))
        chosen, filled = list(groups[:take]), int(total[take - 1]) if take else 0
        for group, group_size in zip(
            groups[take:].tolist(), sizes[take:].tolist(), strict=True
        ):  # mixed group sizes
            if filled == size:
                break
            if filled + group_size <= size:
                chosen.append(group)
                filled += group_size
        claimable = int(total[-1]) if len(total) else 0
        if filled == size or (allow_partial and filled >= min_rows and filled > 0):
            return np.asarray(chosen, np.int64), claimable
        return None, claimable

    def consume(self, claim_ids: Sequence[int]) -> int:
        with self._cond:
            for claim_id in claim_ids:  # every id is checked before any claim changes
                self._index.check_claim(claim_id, self.agent)
            if len(set(claim_ids)) != len(claim_ids):
                raise ValueError(f"claim ids {list(claim_ids)} of {self.agent!r} repeat a claim")
            claims = [self._index.take_claim(claim_id, self.agent) for claim_id in claim_ids]
            now = time.time()
            for claim in claims:
                self._index.consume(claim)
            rows = np.sort(np.concatenate([claim.rows for claim in claims]))
            index = _as_index(rows)
            batch = WriteBatch()
            batch.write(self._arrays["state"], index, np.full(len(rows), RowState.CONSUMED, np.int32))
            batch.write(self._arrays["consumed_at"], index, np.full(len(rows), now))
            self._free_values(batch, rows)
            seq = self._committer.enqueue(batch)
        self._committer.settle(seq)
        return len(rows)

    def consume_rows(self, sample_ids: list[str]) -> int:
        with self._cond:
            index = self._index
            rows = index.rows_of([sample_id for sample_id in sample_ids if sample_id in index.row_of_sample])
            rows = rows[index.state[rows] != RowState.CONSUMED]
            if not len(rows):
                return 0
            bad = rows[index.state[rows] != RowState.READY]
            if len(bad):
                raise ValueError(f"row {index.sample_ids[int(bad[0])]!r} of {self.agent!r} is "
                                 f"{RowState(index.state[bad[0]]).name}, not READY: it cannot be consumed")
            groups = np.array(sorted(set(index.group[rows].tolist())), np.int64)
            whole = np.array(sorted(r for g in groups.tolist() for r in index.group_rows[g]), np.int64)
            if len(whole) != len(rows):
                raise ValueError(f"consume_rows of {self.agent!r} must name whole groups "
                                 f"({len(rows)} rows given of {len(whole)} in their groups)")
            claim_id, _ = index.claim(groups)  # through a claim, so group and row states change together
        return self.consume([claim_id])

    def drop_rows(self, sample_ids: list[str]) -> int:
        with self._cond:
            index = self._index
            rows = index.rows_of([sample_id for sample_id in sample_ids if sample_id in index.row_of_sample])
            groups = np.array(sorted(set(index.group[rows].tolist())), np.int64)
            whole = np.array(sorted(r for g in groups.tolist() for r in index.group_rows[g]), np.int64)
            claimed = whole[index.state[whole] == RowState.CLAIMED]
            if len(claimed):
                raise ValueError(f"row {index.sample_ids[int(claimed[0])]!r} of {self.agent!r} is claimed: "
                                 "release its claim before dropping it")
            seq, dropped = self._drop_groups_locked(groups)
        if seq is not None:
            self._committer.settle(seq)
        return dropped

    def _drop_groups_locked(self, groups: np.ndarray) -> tuple[int | None, int]:
        """Drops whole groups (none claimed), with the lock held; returns (commit to settle, rows newly dropped)."""
        index = self._index
        whole = np.array(sorted(r for g in groups.tolist() for r in index.group_rows[g]), np.int64)
        before = index.state[whole].copy()
        if not (before != RowState.DROPPED).any():
            return None, 0
        rows = np.sort(index.drop_groups(groups))
        before = before[np.searchsorted(whole, rows)]
        batch = WriteBatch()
        batch.write(self._arrays["state"], _as_index(rows), np.full(len(rows), RowState.DROPPED, np.int32))
        # Consumed rows gave up their values when they were consumed; the others give them up now.
        self._free_values(batch, rows[(before != RowState.CONSUMED) & (before != RowState.DROPPED)])
        seq = self._committer.enqueue(batch)
        self._note_change()
        return seq, int(np.count_nonzero(before != RowState.DROPPED))

    def _fail_corrupted_claim(self, claim_id: int, bad_rows: np.ndarray, corrupted: CorruptedPositions
                              ) -> StoreCorrupted:
        """A claim read values that fail their checksum: the claim is given back, the groups of the damaged rows
        are dropped (durably: they are never trained), and the error naming them is returned for raising."""
        with self._cond:
            index = self._index
            self._index.release(self._index.take_claim(claim_id, self.agent))
            sample_ids = [index.sample_ids[r] for r in bad_rows.tolist()]
            groups = np.array(sorted(set(index.group[bad_rows].tolist())), np.int64)
            seq, dropped = self._drop_groups_locked(groups)
        if seq is not None:
            self._committer.settle(seq)
        return StoreCorrupted(self.agent, sample_ids, f"{corrupted}; the {dropped} rows of their groups were "
                                                      "dropped, never trained")

    def release(self, claim_id: int) -> int:
        with self._cond:
            claim = self._index.take_claim(claim_id, self.agent)
            self._index.release(claim)
            self._note_change()
        return len(claim.rows)

    def drop_stale(self, current: np.ndarray, max_staleness: int) -> int:
        with self._cond:
            rows = np.sort(self._index.drop_stale(current, max_staleness))
            if not len(rows):
                return 0
            batch = WriteBatch()
            batch.write(
                self._arrays["state"], _as_index(rows), np.full(len(rows), RowState.DROPPED, np.int32)
            )
            self._free_values(batch, rows)
            seq = self._committer.enqueue(batch)
        self._committer.settle(seq)
        return len(rows)

    # ---- queries ----------
    def counters(self) -> dict[str, int]:
        with self._cond:
            counts = self._index.state_counts()
        return {
            "pending": int(counts[RowState.GENERATING]),
            "ready": int(counts[RowState.READY]),
            "claimed": int(counts[RowState.CLAIMED]),
            "consumed": int(counts[RowState.CONSUMED]),
            "dropped": int(counts[RowState.DROPPED]),
            "total": int(counts.sum()),
        }

    def complete_groups(self, current: np.ndarray | None, max_staleness: int) -> list[str]:
        with self._cond:
            if current is None:
                # "Any version": a huge current version and a bound that reaches below zero.
                current, max_staleness = np.full(len(self._agent_position), 2**40), 2**61
            groups = self._index.claimable_groups(current, max_staleness)
            return [self._index.group_ids[g] for g in groups.tolist()]

    def read_rows(self, sample_ids: Sequence[str] | None, columns: Sequence[str] | None) -> dict[str, object]:
        names = self._data_names(columns)
        with self._cond:
            index = self._index
            if sample_ids is None:
                rows = np.arange(index.num_rows)
            else:
                rows = index.rows_of(list(sample_ids))
            out: dict[str, object] = {
                "sample_id": [index.sample_ids[r] for r in rows.tolist()],
                "group_id": [index.group_ids[g] for g in index.group[rows].tolist()],
                "state": index.state[rows].copy(),
                "group_size": index.group_size[index.group[rows]].copy(),
                "policy_versions": {a: index.versions[rows, i] for a, i in self._agent_position.items()},
                "complete": {n: index.status[rows, index.data_position[n]] for n in names},
            }
            out.update({n: index.scalars[n][rows] for n in names if n in index.scalars})
            refs = {n: index.refs[n][rows] for n in names if n in index.refs}
        try:
            out.update(self._blobs.read(refs, missing_ok=True))
        except CorruptedPositions as corrupted:
            raise StoreCorrupted(self.agent, [out["sample_id"][p] for p in corrupted.positions()],
                                 str(corrupted)) from None
        return out

    def row_states(self, sample_ids: Sequence[str]) -> list[RowState]:
        with self._cond:
            rows = self._index.rows_of(list(sample_ids))
            return [RowState(s) for s in self._index.state[rows].tolist()]
