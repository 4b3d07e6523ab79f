"""Checks and normalises the arguments of an append before the table takes its lock, so that a bad call
raises (TypeError / ValueError naming the argument) having changed nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from flexmarl_jax.store.schema import ColumnSpec, TableSchema
from flexmarl_jax.store.values import coerce_column, coerce_scalar


@dataclasses.dataclass(frozen=True)
class AppendInput:
    num_rows: int
    group_size: int  # rows each row's GRPO group will hold in total
    input_ids: list[str]
    turns: np.ndarray  # [rows] int32
    trajectory_ids: np.ndarray  # [rows] int32
    sample_ids: list[str]  # f"{input_id}_{turn}_{trajectory_id}"
    group_keys: list[str]
    versions: np.ndarray  # [rows, agents] int64, -1 where a row does not depend on that agent
    values: dict[str, object]  # data column -> coerced values


def check_append(agent: str, schema: TableSchema, data_specs: Mapping[str, ColumnSpec], *,
                 input_ids, trajectory_ids, group_size, policy_versions, turns, group_ids,
                 columns) -> AppendInput | None:
    """The checked rows of one `append_rows` call, or None when it appends no rows."""
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, (Sequence, np.ndarray)):
        raise TypeError(f"input_ids must be a list of str or int, got {type(input_ids).__name__}")
    num_rows = len(input_ids)
    if num_rows == 0:
        return None
    for input_id in input_ids:
        if isinstance(input_id, bool) or not isinstance(input_id, (str, int, np.integer)):
            raise TypeError(f"input_id {input_id!r} must be a str or an int")
    input_ids = [str(x) for x in input_ids]
    turns = coerce_scalar(ColumnSpec("turns", "int32", "meta"), turns, num_rows)
    trajectory_ids = coerce_scalar(ColumnSpec("trajectory_ids", "int32", "meta"), trajectory_ids, num_rows)
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive int (rows per GRPO group)")
    sample_ids = [f"{i}_{t}_{j}" for i, t, j in zip(input_ids, turns.tolist(), trajectory_ids.tolist(), strict=True)]
    if group_ids is None:
        group_keys = [f"{i}_{t}" for i, t in zip(input_ids, turns.tolist(), strict=True)]
    else:
        group_keys = coerce_column(ColumnSpec("group_ids", "str", "meta"), group_ids, num_rows)
    return AppendInput(
        num_rows=num_rows, group_size=int(group_size), input_ids=input_ids, turns=turns, trajectory_ids=trajectory_ids,
        sample_ids=sample_ids, group_keys=group_keys,
        versions=coerce_versions(agent, schema, policy_versions, num_rows),
        values=coerce_data(agent, data_specs, columns or {}, num_rows))


def coerce_versions(agent: str, schema: TableSchema, policy_versions: Mapping[str, object],
                    num_rows: int) -> np.ndarray:
    """[rows, agents] int64, -1 for agents the rows do not depend on."""
    if not isinstance(policy_versions, Mapping):
        raise TypeError(f"policy_versions must be a dict agent -> version, got {type(policy_versions).__name__}")
    position = {name: i for i, name in enumerate(schema.agents)}
    unknown = sorted(set(policy_versions) - set(position))
    if unknown:
        raise ValueError(f"policy_versions names unknown agent(s) {unknown}; agents: {list(schema.agents)}")
    if agent not in policy_versions:
        raise ValueError(
            f"policy_versions must include the row's own agent {agent!r} (the version it was "
            f"generated under); got {sorted(policy_versions)}"
        )
    versions = np.full((num_rows, len(position)), -1, np.int64)
    for name, value in policy_versions.items():
        column = coerce_scalar(ColumnSpec(f"policy_versions[{name!r}]", "int64", "meta"), value, num_rows)
        if (column < 0).any():
            raise ValueError(f"policy_versions[{name!r}] has a negative version {column.min()}; versions are >= 0")
        versions[:, position[name]] = column
    return versions


def coerce_data(agent: str, data_specs: Mapping[str, ColumnSpec], columns: Mapping[str, object],
                num_rows: int) -> dict[str, object]:
    """Data column -> values coerced to the column's type (declared columns only)."""
    if not isinstance(columns, Mapping):
        raise TypeError(f"columns must be a dict name -> values, got {type(columns).__name__}")
    unknown = [name for name in columns if name not in data_specs]
    if unknown:
        raise ValueError(
            f"column(s) {unknown} are not declared for agent {agent!r}; data columns: "
            f"{list(data_specs)} (declare more with extra_columns=...)"
        )
    return {name: coerce_column(data_specs[name], values, num_rows) for name, values in columns.items()}
