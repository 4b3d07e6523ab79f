"""In-memory index of one agent's table: numpy arrays of row state, groups, versions and status.

The index decides every state change (claims, readiness, staleness) with vectorised numpy; the TensorStore
arrays are its durable mirror. It does no I/O and no locking: ``AgentTable`` holds its lock around every call.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flexmarl_jax.store.schema import RowState, TableSchema
from flexmarl_jax.store.values import REF_FIELDS

_NO_DEPENDENCY_MIN = np.iinfo(np.int64).max  # group minimum version when no row depends on that agent


class GroupState:
    OPEN = 0  # collecting rows / waiting to become ready or fresh enough
    CLAIMED = 1
    CONSUMED = 2
    DROPPED = 3


def _grow(array: np.ndarray, capacity: int, fill: object) -> np.ndarray:
    grown = np.full((capacity, *array.shape[1:]), fill, dtype=array.dtype)
    grown[: len(array)] = array
    return grown


@dataclasses.dataclass
class Claim:
    groups: np.ndarray  # [num_groups] int64 group indices
    rows: np.ndarray  # [num_rows] int64, rows of a group contiguous, groups in claim order


class RowIndex:
    """Rows ``0 .. num_rows-1`` of one agent. Scalar data values and blob references live here too."""

    def __init__(self, schema: TableSchema):
        self.agents = schema.agents
        self.data_specs = schema.data_specs()
        self.data_names = [spec.name for spec in self.data_specs]
        self.data_position = {name: i for i, name in enumerate(self.data_names)}
        self.num_rows = 0
        capacity = 256
        self.state = np.zeros(capacity, np.int32)
        self.group = np.zeros(capacity, np.int64)
        self.versions = np.full((capacity, len(self.agents)), -1, np.int64)  # [rows, agents]
        self.status = np.zeros((capacity, len(self.data_specs)), bool)  # [rows, data columns]
        self.scalars = {s.name: np.zeros(capacity, s.dtype) for s in self.data_specs if not s.by_reference}
        self.refs = {s.name: np.zeros((capacity, len(REF_FIELDS)), np.int64) for s in self.data_specs if s.by_reference}
        self.sample_ids: list[str] = []
        self.row_of_sample: dict[str, int] = {}
        # Groups, in order of their first row (claims go oldest group first).
        self.group_ids: list[str] = []
        self.group_of_id: dict[str, int] = {}
        self.group_rows: list[list[int]] = []
        group_capacity = 64
        self.group_size = np.zeros(group_capacity, np.int64)  # declared rows per group
        self.group_present = np.zeros(group_capacity, np.int64)
        self.group_ready = np.zeros(group_capacity, np.int64)
        self.group_state = np.zeros(group_capacity, np.int8)
        self.group_min_version = np.full((group_capacity, len(self.agents)), _NO_DEPENDENCY_MIN, np.int64)
        self.group_max_version = np.full((group_capacity, len(self.agents)), -1, np.int64)
        self.first_live_group = 0  # every group before it is consumed or dropped
        self.claims: dict[int, Claim] = {}
        self.next_claim_id = 1

    # ---- capacity ----------
    def _reserve_rows(self, needed: int) -> None:
        capacity = len(self.state)
        if needed <= capacity:
            return
        capacity = max(needed, 2 * capacity)
        self.state = _grow(self.state, capacity, 0)
        self.group = _grow(self.group, capacity, 0)
        self.versions = _grow(self.versions, capacity, -1)
        self.status = _grow(self.status, capacity, False)
        self.scalars = {k: _grow(v, capacity, 0) for k, v in self.scalars.items()}
        self.refs = {k: _grow(v, capacity, 0) for k, v in self.refs.items()}

    def _reserve_groups(self, needed: int) -> None:
        capacity = len(self.group_size)
        if needed <= capacity:
            return
        capacity = max(needed, 2 * capacity)
        self.group_size = _grow(self.group_size, capacity, 0)
        self.group_present = _grow(self.group_present, capacity, 0)
        self.group_ready = _grow(self.group_ready, capacity, 0)
        self.group_state = _grow(self.group_state, capacity, GroupState.OPEN)
        self.group_min_version = _grow(self.group_min_version, capacity, _NO_DEPENDENCY_MIN)
        self.group_max_version = _grow(self.group_max_version, capacity, -1)

    # ---- appending ----------
    def check_new_rows(self, sample_ids: list[str], group_keys: list[str], group_size: np.ndarray) -> None:
        """Raises ValueError (before anything changes) for duplicate ids or groups that would overflow."""
        if len(set(sample_ids)) != len(sample_ids):
            seen: set[str] = set()
            duplicate = next(s for s in sample_ids if s in seen or seen.add(s))
            raise ValueError(f"sample_id {duplicate!r} appears twice in one append")
        for sample_id in sample_ids:
            if sample_id in self.row_of_sample:
                raise ValueError(
                    f"sample_id {sample_id!r} is already in the table; sample ids must be unique"
                )
        added: dict[str, int] = {}
        for key, size in zip(group_keys, group_size.tolist(), strict=True):
            added[key] = added.get(key, 0) + 1
            group = self.group_of_id.get(key)
            declared = int(self.group_size[group]) if group is not None else size
            if declared != size:
                raise ValueError(f"group {key!r} was declared with group_size={declared}, now {size}")
            present = int(self.group_present[group]) if group is not None else 0
            if present + added[key] > declared:
                raise ValueError(
                    f"group {key!r} would have {present + added[key]} rows but group_size={declared}"
                )

    def add_rows(
        self,
        *,
        sample_ids: list[str],
        group_keys: list[str],
        group_size: np.ndarray,
        versions: np.ndarray,
        status: np.ndarray,
        scalars: dict[str, np.ndarray],
        refs: dict[str, np.ndarray],
        state: np.ndarray | None = None,
    ) -> np.ndarray:
        """Adds ``n`` rows ([n] per-row arrays, versions [n, agents], status [n, data columns]).

        Without ``state`` each row is READY when every status flag is set, else GENERATING; rows joining a
        dropped group are DROPPED. Returns the new rows' states [n]."""
        n = len(sample_ids)
        start, stop = self.num_rows, self.num_rows + n
        self._reserve_rows(stop)
        groups = np.empty(n, np.int64)
        for i, key in enumerate(group_keys):
            group = self.group_of_id.get(key)
            if group is None:
                group = len(self.group_ids)
                self._reserve_groups(group + 1)
                self.group_ids.append(key)
                self.group_of_id[key] = group
                self.group_rows.append([])
                self.group_size[group] = group_size[i]
            self.group_rows[group].append(start + i)
            groups[i] = group
        if state is None:
            state = np.where(status.all(axis=1), RowState.READY, RowState.GENERATING).astype(np.int32)
            state[self.group_state[groups] == GroupState.DROPPED] = RowState.DROPPED
        rows = slice(start, stop)
        self.state[rows] = state
        self.group[rows] = groups
        self.versions[rows] = versions
        self.status[rows] = status
        for name, values in scalars.items():
            self.scalars[name][rows] = values
        for name, values in refs.items():
            self.refs[name][rows] = values
        self.sample_ids.extend(sample_ids)
        self.row_of_sample.update(zip(sample_ids, range(start, stop), strict=True))
        self.num_rows = stop
        # Per-group reductions over the new rows (ufunc.at is slow on the 2-D version bounds).
        order = np.argsort(groups, kind="stable")
        sorted_groups = groups[order]
        starts = np.flatnonzero(np.r_[True, sorted_groups[1:] != sorted_groups[:-1]])
        touched = sorted_groups[starts]
        self.group_present[touched] += np.diff(np.append(starts, n))
        self.group_ready[touched] += np.add.reduceat((state == RowState.READY)[order].astype(np.int64), starts)
        # Group version bounds ignore -1 ("does not depend on that agent").
        depends = versions >= 0
        low = np.minimum.reduceat(np.where(depends, versions, _NO_DEPENDENCY_MIN)[order], starts, axis=0)
        high = np.maximum.reduceat(np.where(depends, versions, -1)[order], starts, axis=0)
        self.group_min_version[touched] = np.minimum(self.group_min_version[touched], low)
        self.group_max_version[touched] = np.maximum(self.group_max_version[touched], high)
        return state

    def rows_of(self, sample_ids: list[str]) -> np.ndarray:
        try:
            return np.fromiter((self.row_of_sample[s] for s in sample_ids), np.int64, len(sample_ids))
        except KeyError as missing:
            raise ValueError(f"sample_id {missing.args[0]!r} is not in the table") from None

    # ---- setting values --------------------------------------------------------------------------------
    def mark_complete(self, rows: np.ndarray, columns: list[str]) -> np.ndarray:
        """Sets status flags; returns the rows that thereby become READY."""
        positions = [self.data_position[name] for name in columns]
        was_generating = self.state[rows] == RowState.GENERATING
        self.status[np.ix_(rows, positions)] = True
        became_ready = rows[was_generating & self.status[rows].all(axis=1)]
        self.state[became_ready] = RowState.READY
        np.add.at(self.group_ready, self.group[became_ready], 1)
        return became_ready

    # ---- claims ----------
    def _advance_first_live_group(self) -> None:
        num_groups = len(self.group_ids)
        done = (GroupState.CONSUMED, GroupState.DROPPED)
        while self.first_live_group < num_groups and self.group_state[self.first_live_group] in done:
            self.first_live_group += 1

    def _fresh(self, groups: np.ndarray, current: np.ndarray, max_staleness: int) -> np.ndarray:
        low = current - max_staleness
        within = (self.group_min_version[groups] >= low) & (self.group_max_version[groups] <= current)
        return within.all(axis=1)

    def claimable_groups(self, current: np.ndarray, max_staleness: int) -> np.ndarray:
        """Open groups, oldest first, whose declared rows all exist and are READY and fresh enough."""
        self._advance_first_live_group()
        groups = np.arange(self.first_live_group, len(self.group_ids))
        size = self.group_size[groups]
        ok = (self.group_state[groups] == GroupState.OPEN) & (self.group_ready[groups] == size)
        ok &= self.group_present[groups] == size
        groups = groups[ok]
        return groups[self._fresh(groups, current, max_staleness)]

    def live_group_sizes(self) -> set[int]:
        groups = np.arange(self.first_live_group, len(self.group_ids))
        return set(self.group_size[groups].tolist())

    def claim(self, groups: np.ndarray) -> tuple[int, Claim]:
        rows = np.fromiter((row for group in groups.tolist() for row in self.group_rows[group]), np.int64)
        self.group_state[groups] = GroupState.CLAIMED
        self.state[rows] = RowState.CLAIMED
        claim_id = self.next_claim_id
        self.next_claim_id += 1
        self.claims[claim_id] = Claim(groups=groups, rows=rows)
        return claim_id, self.claims[claim_id]

    def check_claim(self, claim_id: int, agent: str) -> None:
        if claim_id not in self.claims:
            raise ValueError(
                f"claim {claim_id} of agent {agent!r} is not held (never made, already consumed or released)"
            )

    def take_claim(self, claim_id: int, agent: str) -> Claim:
        self.check_claim(claim_id, agent)
        return self.claims.pop(claim_id)

    def consume(self, claim: Claim) -> None:
        self.group_state[claim.groups] = GroupState.CONSUMED
        self.state[claim.rows] = RowState.CONSUMED

    def release(self, claim: Claim) -> None:
        self.group_state[claim.groups] = GroupState.OPEN
        self.state[claim.rows] = RowState.READY

    # ---- staleness ----------
    def drop_stale(self, current: np.ndarray, max_staleness: int) -> np.ndarray:
        """Drops open groups holding a row older than ``current - max_staleness``; returns their rows."""
        self._advance_first_live_group()
        groups = np.arange(self.first_live_group, len(self.group_ids))
        groups = groups[self.group_state[groups] == GroupState.OPEN]
        stale = (self.group_min_version[groups] < current - max_staleness).any(axis=1)
        groups = groups[stale]
        self.group_state[groups] = GroupState.DROPPED
        rows = np.fromiter((r for g in groups.tolist() for r in self.group_rows[g]), np.int64)
        self.state[rows] = RowState.DROPPED
        return rows

    def drop_groups(self, groups: np.ndarray) -> np.ndarray:
        """Drops whole groups, open or consumed (not claimed: the caller checks); returns their rows."""
        self.group_state[groups] = GroupState.DROPPED
        rows = np.fromiter((r for g in groups.tolist() for r in self.group_rows[g]), np.int64)
        self.state[rows] = RowState.DROPPED
        return rows

    # ---- after loading from disk ---------------------------------------------------------------------------
    def settle_loaded_groups(self) -> None:
        """Group states from loaded row states (claims are leases: nothing loads as CLAIMED)."""
        groups = self.group[: self.num_rows]
        state = self.state[: self.num_rows]
        consumed = np.zeros(len(self.group_ids), bool)
        dropped = np.zeros(len(self.group_ids), bool)
        consumed[groups[state == RowState.CONSUMED]] = True
        dropped[groups[state == RowState.DROPPED]] = True
        self.group_state[: len(self.group_ids)][dropped] = GroupState.DROPPED
        self.group_state[: len(self.group_ids)][consumed] = GroupState.CONSUMED

    def state_counts(self) -> np.ndarray:
        """[len(RowState)] number of rows in each state."""
        return np.bincount(self.state[: self.num_rows], minlength=len(RowState))
