"""``ExperienceStore``: per-agent experience tables between rollout and training.

Rollout threads ``append_rows`` (and later ``set_columns`` as values complete); trainer threads
``claim_micro_batch`` whole GRPO groups that are complete and fresh enough, then ``mark_consumed`` (durable)
or ``release`` (the trainer failed; the rows become claimable again). Every method is thread-safe and a claim
hands each row to exactly one trainer. A claim is a lease: it is not persisted, so after a crash the
reopened store offers claimed-but-unconsumed rows again, while consumed rows are never offered again.

Backends: ``"memory"`` (TensorStore memory driver, the default) and ``"file"`` (an OCDBT database at
``WORKDIR/store/``; a ``gs://bucket/path`` workdir uses GCS through the same spec). docs/store.md describes
the layout. The file backend's writes are durable when a call returns; the memory backend commits them on a
background thread (nothing of it outlives the process, so callers need not wait).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import tensorstore as ts

from flexmarl_jax.store import layout
from flexmarl_jax.store.append_input import check_append
from flexmarl_jax.store.batch import ClaimedRows
from flexmarl_jax.store.commit import Committer
from flexmarl_jax.store.schema import RowState, TableSchema
from flexmarl_jax.store.table import AgentTable

logger = logging.getLogger(__name__)


class ExperienceStore:
    """One table per agent; see the module docstring. Create with ``ExperienceStore.open``."""

    def __init__(
        self,
        schema: TableSchema,
        tables: dict[str, AgentTable],
        committer: Committer,
        location: str,
        kvstore: ts.KvStore,
    ):
        self.schema = schema
        self.kvstore = kvstore  # holds every key of docs/store.md (also for the memory backend)
        self._tables = tables
        self._committer = committer
        self.location = location

    @classmethod
    def open(
        cls,
        workdir: str | None = None,
        *,
        agents: Sequence[str] | None = None,
        backend: str = "memory",
        extra_columns: Mapping[str, object] | None = None,
        rows_per_chunk: int = 1024,
        must_exist: bool = False,
        free_consumed_values: bool | None = None,
    ) -> ExperienceStore:
        """Opens (or creates) a store.

        Args:
          workdir: run directory; the file backend keeps its database in ``WORKDIR/store/``. Ignored (may be
            None) for the memory backend.
          agents: agent names; required to create a store, checked against the schema when reopening.
          backend: "memory" or "file".
          extra_columns: user data columns, name -> type ("float32", "int32[]", "str", ... see schema.py),
            the same for every agent; checked against the schema when reopening.
          rows_per_chunk: rows per zarr chunk of every column (only used when creating).
          must_exist: raise FileNotFoundError instead of creating a missing store.
          free_consumed_values: delete the by-reference data values (tokens, log-probs, ...) of rows once
            they are consumed or dropped, so a long run does not grow without bound; ``read_rows`` then
            shows None for them. Default: True for the memory backend, False for the file backend (a
            durable store keeps its experience for later analysis).
        """
        base_spec = layout.base_kvstore_spec(workdir, backend)
        context = ts.Context()
        kvstore = ts.KvStore.open(base_spec, context=context).result()
        stored = layout.read_schema_json(kvstore)
        location = "memory" if backend == "memory" else layout.store_url(workdir)
        if stored is None:
            if must_exist:
                raise FileNotFoundError(f"no experience store at {location} (no {layout.SCHEMA_KEY})")
            if agents is None:
                raise ValueError(f"creating a store at {location} needs agents=[...]")
            schema = TableSchema.build(agents, extra_columns)
            payload = json.dumps(schema.to_json(rows_per_chunk), indent=1).encode()
            layout.write_schema_json(kvstore, payload)
        else:
            schema = TableSchema.from_json(stored)
            rows_per_chunk = int(stored["rows_per_chunk"])
            if agents is not None and tuple(agents) != schema.agents:
                raise ValueError(f"store at {location} has agents {list(schema.agents)}, not {list(agents)}")
            if extra_columns is not None:
                wanted = TableSchema.build(schema.agents, extra_columns).extra_columns
                if wanted != schema.extra_columns:
                    raise ValueError(
                        f"store at {location} has extra columns {schema.extra_columns}, not {wanted}"
                    )
        # Nothing of the memory backend outlives the process, so its operations need not wait for commits.
        committer = Committer(kvstore, write_behind=backend == "memory")
        free = backend == "memory" if free_consumed_values is None else bool(free_consumed_values)
        tables = {
            agent: AgentTable(
                agent,
                schema,
                base_spec=base_spec,
                context=context,
                kvstore=kvstore,
                committer=committer,
                rows_per_chunk=rows_per_chunk,
                free_consumed_values=free,
            )
            for agent in schema.agents
        }
        if stored is not None:
            for table in tables.values():
                table.load()
        logger.info("experience store at %s: agents %s", location, list(schema.agents))
        return cls(schema, tables, committer, location, kvstore)

    # ---- helpers ----------
    @property
    def agents(self) -> tuple[str, ...]:
        return self.schema.agents

    def _table(self, agent: str) -> AgentTable:
        table = self._tables.get(agent)
        if table is None:
            raise ValueError(f"agent {agent!r} is not in this store; agents: {list(self.schema.agents)}")
        return table

    def _current(self, current_versions: Mapping[str, int] | int) -> np.ndarray:
        """[agents] int64 current policy versions."""
        agents = self.schema.agents
        if isinstance(current_versions, (int, np.integer)) and not isinstance(current_versions, bool):
            return np.full(len(agents), int(current_versions), np.int64)
        if not isinstance(current_versions, Mapping):
            raise TypeError(
                f"current_versions must be an int or a dict agent -> int, got {current_versions!r}"
            )
        unknown = sorted(set(current_versions) - set(agents))
        missing = [a for a in agents if a not in current_versions]
        if unknown or missing:
            raise ValueError(
                f"current_versions must name every agent {list(agents)}; unknown {unknown}, missing {missing}"
            )
        for agent, version in current_versions.items():
            if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
                raise TypeError(f"current_versions[{agent!r}]={version!r} must be an int")
        return np.array([current_versions[a] for a in agents], np.int64)

    @staticmethod
    def _check_staleness(max_staleness: int) -> int:
        if (
            isinstance(max_staleness, bool)
            or not isinstance(max_staleness, (int, np.integer))
            or max_staleness < 0
        ):
            raise ValueError(f"max_staleness={max_staleness!r} must be an int >= 0")
        return int(max_staleness)

    # ---- writing ----------
    def append_rows(
        self,
        agent: str,
        *,
        input_ids: Sequence[str | int],
        trajectory_ids: Sequence[int] | np.ndarray,
        group_size: int,
        policy_versions: Mapping[str, int | Sequence[int]],
        turns: int | Sequence[int] | np.ndarray = 0,
        group_ids: Sequence[str] | None = None,
        columns: Mapping[str, object] | None = None,
    ) -> list[str]:
        """Appends one row per ``input_ids`` entry; returns their sample ids. The rows are claimable when this
        returns, and durable too with the file backend (the memory backend commits them in the background).

        Args:
          agent: the table.
          input_ids, trajectory_ids, turns: [rows]; ``sample_id = f"{input_id}_{turn}_{trajectory_id}"``.
          group_size: rows the GRPO group of each row will hold in total (may arrive over several appends).
          policy_versions: agent -> int or [rows] ints: the versions the rows depend on. Must include
            ``agent`` itself (the version the rows were generated under); agents left out are stored as -1.
          group_ids: [rows] GRPO group of each row; defaults to ``f"{input_id}_{turn}"``.
          columns: data column -> [rows] values (scalars: array [rows]; sequences: a list of 1-D arrays or an
            array [rows, length]; str: list of str). Given columns are complete; others stay pending.
        Raises ValueError/TypeError (and writes nothing) for an unknown agent or column, a wrong dtype, a
        duplicate sample id or a group that would exceed its size.
        """
        table = self._table(agent)
        rows = check_append(agent, self.schema, table.data_specs, input_ids=input_ids,
                            trajectory_ids=trajectory_ids, group_size=group_size,
                            policy_versions=policy_versions, turns=turns, group_ids=group_ids, columns=columns)
        return [] if rows is None else table.append(rows)

    def set_columns(
        self, agent: str, rows: Sequence[str] | np.ndarray, columns: Mapping[str, object]
    ) -> None:
        """Sets data values of existing rows (by sample id, or an int array of row numbers) and marks those
        columns complete; rows whose every column is then complete become READY. Rows already claimed or
        consumed raise ValueError (their values can no longer change)."""
        self._table(agent).set_columns(rows, columns)

    # ---- claiming ----------
    def claim_micro_batch(
        self,
        agent: str,
        size: int,
        *,
        current_versions: Mapping[str, int] | int,
        max_staleness: int = 0,
        columns: Sequence[str] | None = None,
        allow_partial: bool = False,
        min_rows: int | None = None,
        timeout: float | None = 0.0,
        until: threading.Event | None = None,
        since: int | None = None,
    ) -> ClaimedRows | None:
        """Atomically claims ``size`` rows of ``agent`` made of whole GRPO groups, oldest groups first.

        A group is claimable when all of its ``group_size`` rows exist and are READY and every version a row
        depends on lies in ``[current - max_staleness, current]`` (with 0: exactly the current versions).
        ``size`` counts rows and, unless ``allow_partial``, must be a multiple of every group size of the
        agent's live groups (ValueError otherwise). When the claimable groups cannot fill exactly ``size``
        rows the call returns None (claiming nothing), or with ``allow_partial`` the whole groups that fit
        (at least one group, and at least ``min_rows`` rows when given; groups may then differ in size).
        ``timeout``: seconds to wait for enough rows (0: do not wait; None: wait forever).
        ``until``: a blocking claim also returns None once this event is set and ``wake_claims`` was called
        (a consumer's "no more rows are coming" signal, so it need not poll).
        ``since``: an earlier claim's ``ClaimedRows.table_changes``: select only once rows were appended, set
        or released after that claim (its ``claimable_after`` said too few were left).
        ``columns``: data columns to read (default all).
        """
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"size={size!r} must be a positive int (rows)")
        if min_rows is not None and (
            isinstance(min_rows, bool) or not isinstance(min_rows, (int, np.integer)) or not 1 <= min_rows <= size
        ):
            raise ValueError(f"min_rows={min_rows!r} must be an int in [1, size={size}]")
        table = self._table(agent)
        return table.claim(
            int(size),
            self._current(current_versions),
            self._check_staleness(max_staleness),
            columns=columns,
            allow_partial=allow_partial,
            min_rows=1 if min_rows is None else int(min_rows),
            timeout=timeout,
            until=until,
            since=since,
        )

    def wake_claims(self) -> None:
        """Wakes every blocked claim so that it re-checks its ``until`` event (set the event first)."""
        for table in self._tables.values():
            table.wake()

    def mark_consumed(self, batch: ClaimedRows | Sequence[ClaimedRows]) -> int:
        """Marks claimed batches trained on (durable when this returns, file backend); returns their row count.
        Several batches of one agent are marked in one operation."""
        batches = [batch] if isinstance(batch, ClaimedRows) else list(batch)
        by_agent: dict[str, list[int]] = {}
        for one in batches:
            if not isinstance(one, ClaimedRows):
                raise TypeError(f"mark_consumed takes ClaimedRows objects, got {type(one).__name__}")
            by_agent.setdefault(one.agent, []).append(one.claim_id)
        return sum(self._table(agent).consume(claim_ids) for agent, claim_ids in by_agent.items())

    def consume_rows(self, agent: str, sample_ids: Sequence[str]) -> int:
        """Marks rows CONSUMED without a claim: recovery of rows whose training a checkpoint already holds
        (a crash between the checkpoint and ``mark_consumed``). Whole groups only; rows already consumed and ids
        the store does not hold (a memory store does not outlive its process) are skipped; returns the number of
        rows newly consumed. Raises ValueError (changing nothing) for a partial group, or rows that are claimed,
        dropped or not READY."""
        return self._table(agent).consume_rows(list(sample_ids))

    def drop_rows(self, agent: str, sample_ids: Sequence[str]) -> int:
        """Marks the whole groups of ``sample_ids`` DROPPED (durably), whether they are READY, pending or CONSUMED:
        recovery of rows whose training was discarded with the update that held it (a checkpoint that failed
        verification, so the run goes back to an older one). Ids the store does not hold are skipped (a memory
        store does not outlive its process). Returns the number of rows newly dropped. Raises ValueError
        (changing nothing) for claimed rows."""
        return self._table(agent).drop_rows(list(sample_ids))

    def release(self, batch: ClaimedRows) -> int:
        """Gives a claimed batch back (e.g. its trainer failed): its groups become claimable again."""
        return self._table(batch.agent).release(batch.claim_id)

    def drop_stale_rows(
        self, *, current_versions: Mapping[str, int] | int, max_staleness: int = 0, agent: str | None = None
    ) -> int:
        """Marks DROPPED (durably, never trained) every unclaimed group holding a row that depends on a
        version older than ``current - max_staleness``; rows appended later to such a group are dropped too.
        Returns the number of rows dropped."""
        current = self._current(current_versions)
        max_staleness = self._check_staleness(max_staleness)
        agents = self.schema.agents if agent is None else [agent]
        return sum(self._table(a).drop_stale(current, max_staleness) for a in agents)

    # ---- queries ----------
    def complete_groups(
        self, agent: str, *, current_versions: Mapping[str, int] | int | None = None, max_staleness: int = 0
    ) -> list[str]:
        """Ids of the groups that a claim could take now (all rows READY; within the bound when
        ``current_versions`` is given), oldest first."""
        current = None if current_versions is None else self._current(current_versions)
        return self._table(agent).complete_groups(current, self._check_staleness(max_staleness))

    def counters(self, agent: str | None = None) -> dict:
        """Rows per state: {"pending", "ready", "claimed", "consumed", "dropped", "total"} for ``agent``, or
        {agent: that dict} for every agent when ``agent`` is None."""
        if agent is not None:
            return self._table(agent).counters()
        return {a: table.counters() for a, table in self._tables.items()}

    def read_rows(
        self, agent: str, sample_ids: Sequence[str] | None = None, *, columns: Sequence[str] | None = None
    ) -> dict[str, object]:
        """Current values of rows (all rows when ``sample_ids`` is None), for inspection and tests.

        Returns {"sample_id", "group_id": lists; "state", "group_size": [rows]; "policy_versions":
        {agent: [rows]}; "complete": {column: [rows] bool}} plus one entry per data column (a by-reference
        value never set is None)."""
        return self._table(agent).read_rows(sample_ids, columns)

    def row_states(self, agent: str, sample_ids: Sequence[str]) -> list[RowState]:
        return self._table(agent).row_states(sample_ids)

    def flush(self) -> None:
        """Waits for every queued write (with the file backend every public call already waits for its own)."""
        self._committer.flush()

    def close(self) -> None:
        """Commits every queued write."""
        self.flush()

    @property
    def commit_cpu_seconds(self) -> float:
        """CPU seconds spent committing to TensorStore so far, on whichever thread (for overhead reports)."""
        return self._committer.commit_cpu_s

    def __enter__(self) -> ExperienceStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
