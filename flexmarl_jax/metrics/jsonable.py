"""Turning metric values (numpy / JAX scalars, nested dicts) into plain JSON and flat tag dicts.

Metric records come from numerical code, so their leaves are often `np.float32`, 0-d `jax.Array`s or
small arrays. JSON knows none of these; `to_jsonable` converts them without importing JAX (anything with
`__array__` is read through numpy). Non-finite floats become `None` so that the files stay standard JSON
(`NaN` is not JSON, and `jq` and browsers reject it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

FLAT_SEPARATOR = "/"


def to_jsonable(value: Any) -> Any:
    """Return `value` as plain Python (dict / list / str / int / float / bool / None), recursively.

    numpy and JAX scalars and 0-d arrays become Python numbers; arrays become (nested) lists; mapping keys
    become strings; NaN and +-inf become None.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # also normalises IntEnum-like subclasses
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): to_jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(item) for item in value]
    if isinstance(value, np.generic):
        return to_jsonable(value.item())
    if hasattr(value, "__array__"):  # np.ndarray, jax.Array, torch tensors on CPU
        array = np.asarray(value)
        return to_jsonable(array.item() if array.ndim == 0 else array.tolist())
    if hasattr(value, "item") and callable(value.item):
        return to_jsonable(value.item())
    raise TypeError(
        f"metric value {value!r} of type {type(value).__name__} is not JSON-serialisable; "
        "allowed: numbers, strings, bools, None, numpy/JAX scalars or arrays, lists and dicts of these"
    )


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts into `/`-joined keys.

    `{"agent": {"solver": {"reward": 1}}}` -> `{"agent/solver/reward": 1}`.

    Leaves are converted with `to_jsonable`; lists stay lists (they are not tags).
    """
    flat: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{FLAT_SEPARATOR}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, name))
        else:
            flat[name] = to_jsonable(value)
    return flat


def numeric_items(record: Mapping[str, Any]) -> dict[str, float]:
    """The flattened entries of `record` that are finite numbers (bools excluded), as floats."""
    numbers: dict[str, float] = {}
    for name, value in flatten(record).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        numbers[name] = float(value)
    return numbers
