"""Column types and the table schema of the experience store.

Every agent's table has the same three kinds of columns:

* meta: ``sample_id`` / ``input_id`` / ``group_id`` (strings), ``turn``, ``trajectory_id``, ``group_size``,
  ``state``, ``created_at`` / ``ready_at`` / ``consumed_at`` and one ``version__<agent>`` column per agent of
  the run (the policy version of that agent the row depends on, -1 where it does not depend on it);
* data: ``prompt_tokens``, ``response_tokens``, ``behaviour_logprobs``, ``reward``, ``advantage`` and the
  user-declared ``extra_columns``;
* status: one ``status__<data column>`` bool per data column, True once that value is complete.

A column type is a string: ``"int32" | "int64" | "float32" | "float64" | "bool"`` are scalars stored by value
in a columnar array; ``"<scalar>[]"`` (e.g. ``"int32[]"``) is a variable-length 1-D sequence and ``"str"`` a
UTF-8 string, both stored by reference (the table holds a key into a blob in the kvstore).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
from collections.abc import Mapping, Sequence

import numpy as np

FORMAT_VERSION = "flexmarl-store/2"  # /2: checksums (crc32c chunks, a CRC-32 per by-reference value)

SCALAR_TYPES: dict[str, np.dtype] = {
    name: np.dtype(name) for name in ("int32", "int64", "float32", "float64", "bool")
}
SEQUENCE_TYPES: dict[str, np.dtype] = {
    f"{name}[]": np.dtype(name) for name in ("int32", "int64", "float32", "float64", "uint8")
}
ALLOWED_TYPES = (*SCALAR_TYPES, *SEQUENCE_TYPES, "str")

_NAME_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_AGENT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class RowState(enum.IntEnum):
    """Life cycle of a row. ABSENT is the fill value of the on-disk ``state`` column (no row there)."""

    ABSENT = 0
    GENERATING = 1  # some data column is not complete yet ("pending")
    READY = 2  # every data column complete; claimable when its whole group is ready and fresh enough
    CLAIMED = 3  # leased to a trainer; in memory only, a reopened store shows it READY again
    CONSUMED = 4  # trained on; durable, never claimable again
    DROPPED = 5  # beyond the staleness bound; durable, never claimable


@dataclasses.dataclass(frozen=True)
class ColumnSpec:
    """One column: ``kind`` is "scalar" (by value), "sequence" or "str" (both by reference)."""

    name: str
    type_name: str
    role: str  # "meta" | "data" | "status"

    @functools.cached_property
    def kind(self) -> str:
        if self.type_name == "str":
            return "str"
        return "sequence" if self.type_name.endswith("[]") else "scalar"

    @functools.cached_property
    def by_reference(self) -> bool:
        return self.kind != "scalar"

    @functools.cached_property
    def dtype(self) -> np.dtype:
        """Element dtype: the value's dtype for scalars, the sequence element dtype, uint8 for str."""
        if self.kind == "scalar":
            return SCALAR_TYPES[self.type_name]
        if self.kind == "str":
            return np.dtype("uint8")
        return SEQUENCE_TYPES[self.type_name]


BUILTIN_DATA_COLUMNS: dict[str, str] = {
    "prompt_tokens": "int32[]",
    "response_tokens": "int32[]",
    "behaviour_logprobs": "float32[]",
    "reward": "float32",
    "advantage": "float32",
}
STRING_META_COLUMNS = ("sample_id", "input_id", "group_id")
SCALAR_META_COLUMNS: dict[str, str] = {
    "state": "int32",
    "turn": "int32",
    "trajectory_id": "int32",
    "group_size": "int32",
    "created_at": "float64",
    "ready_at": "float64",
    "consumed_at": "float64",
}
VERSION_PREFIX = "version__"
STATUS_PREFIX = "status__"


def parse_column_type(name: str, type_name: object) -> str:
    """Returns the canonical type string of a declared column or raises naming what is allowed."""
    if isinstance(type_name, np.dtype) or (isinstance(type_name, type) and issubclass(type_name, np.generic)):
        type_name = np.dtype(type_name).name
    if not isinstance(type_name, str) or type_name not in ALLOWED_TYPES:
        raise TypeError(f"column {name!r} has type {type_name!r}; allowed types: {', '.join(ALLOWED_TYPES)}")
    return type_name


def check_agent_names(agents: Sequence[str]) -> tuple[str, ...]:
    agents = tuple(agents)
    if not agents:
        raise ValueError("agents=() is empty; the store needs at least one agent name")
    for agent in agents:
        if not isinstance(agent, str) or not _AGENT_PATTERN.match(agent):
            raise ValueError(f"agent name {agent!r} is not allowed; allowed: letters, digits, '_', '.', '-'")
    if len(set(agents)) != len(agents):
        raise ValueError(f"agents={list(agents)} contains duplicates")
    return agents


@dataclasses.dataclass(frozen=True)
class TableSchema:
    """The columns shared by every agent's table. ``data_columns`` maps name -> type string."""

    agents: tuple[str, ...]
    data_columns: dict[str, str]

    @classmethod
    def build(cls, agents: Sequence[str], extra_columns: Mapping[str, object] | None) -> TableSchema:
        agents = check_agent_names(agents)
        data_columns = dict(BUILTIN_DATA_COLUMNS)
        reserved = set(BUILTIN_DATA_COLUMNS) | set(STRING_META_COLUMNS) | set(SCALAR_META_COLUMNS)
        for name, type_name in (extra_columns or {}).items():
            if not isinstance(name, str) or not _NAME_PATTERN.match(name) or "__" in name:
                raise ValueError(
                    f"extra column name {name!r} is not allowed; use a Python identifier without '__'"
                )
            if name in reserved:
                raise ValueError(f"extra column {name!r} clashes with a built-in column ({sorted(reserved)})")
            data_columns[name] = parse_column_type(name, type_name)
        return cls(agents=agents, data_columns=data_columns)

    @property
    def extra_columns(self) -> dict[str, str]:
        return {k: v for k, v in self.data_columns.items() if k not in BUILTIN_DATA_COLUMNS}

    def data_specs(self) -> list[ColumnSpec]:
        return [ColumnSpec(name, type_name, "data") for name, type_name in self.data_columns.items()]

    def all_specs(self) -> list[ColumnSpec]:
        """Every stored column of one table, meta first, then data, then status."""
        specs = [ColumnSpec(name, "str", "meta") for name in STRING_META_COLUMNS]
        specs += [ColumnSpec(name, type_name, "meta") for name, type_name in SCALAR_META_COLUMNS.items()]
        specs += [ColumnSpec(VERSION_PREFIX + agent, "int64", "meta") for agent in self.agents]
        specs += self.data_specs()
        specs += [ColumnSpec(STATUS_PREFIX + name, "bool", "status") for name in self.data_columns]
        return specs

    def to_json(self, rows_per_chunk: int) -> dict:
        return {
            "format": FORMAT_VERSION,
            "agents": list(self.agents),
            "data_columns": dict(self.data_columns),
            "columns": {spec.name: spec.type_name for spec in self.all_specs()},
            "rows_per_chunk": rows_per_chunk,
        }

    @classmethod
    def from_json(cls, payload: Mapping) -> TableSchema:
        if payload.get("format") != FORMAT_VERSION:
            raise ValueError(f"store format {payload.get('format')!r} is not {FORMAT_VERSION!r}")
        return cls(agents=tuple(payload["agents"]), data_columns=dict(payload["data_columns"]))
