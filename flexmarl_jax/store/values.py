"""Checking user values against a column's type, and packing by-reference values into one blob.

Each packed row carries the CRC-32 of its own bytes in its reference, so a value read back from disk is checked
row by row (`corrupted_rows`): a damaged blob fails exactly the rows whose bytes changed.

Rules (a violation raises TypeError naming the column, the given dtype and what is allowed):
int columns take integers (bool is not an integer here) that fit the column's range; float columns take
floats or integers; bool columns take bools; str columns take ``str``; sequence columns take a list of
1-D array-likes (or a 2-D array [rows, length]) whose elements follow the scalar rule above.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from flexmarl_jax.store.schema import ColumnSpec

_ALLOWED_KINDS = {"i": "iu", "u": "iu", "f": "iuf", "b": "b"}
REF_FIELDS = ("blob_id", "offset", "length", "crc32")  # a by-reference row's entry, int64 [rows, 4]


def _check_kind(spec: ColumnSpec, array: np.ndarray) -> None:
    _check_dtype(spec, array.dtype)
    _check_range(spec, array)


def _check_dtype(spec: ColumnSpec, dtype: np.dtype) -> None:
    allowed = _ALLOWED_KINDS[spec.dtype.kind]
    if dtype.kind not in allowed:
        raise TypeError(
            f"column {spec.name!r} is {spec.type_name}; got values of dtype {dtype} "
            f"(allowed dtype kinds: {', '.join(_kind_names(allowed))})"
        )


def _check_range(spec: ColumnSpec, array: np.ndarray) -> None:
    """Integers must fit the column's integer type (a cast would silently wrap them)."""
    target = spec.dtype
    if target.kind not in "iu" or not array.size or np.can_cast(array.dtype, target, "safe"):
        return
    info = np.iinfo(target)
    low, high = array.min(), array.max()
    if low < info.min or high > info.max:
        raise TypeError(
            f"column {spec.name!r} is {spec.type_name}; values range [{low}, {high}] does not fit "
            f"[{info.min}, {info.max}]"
        )


def _kind_names(kinds: str) -> list[str]:
    names = {"i": "signed int", "u": "unsigned int", "f": "float", "b": "bool"}
    return [names[k] for k in kinds]


def coerce_scalar(spec: ColumnSpec, values: object, num_rows: int) -> np.ndarray:
    """[num_rows] array of the column's dtype; a single value is broadcast to every row."""
    array = np.asarray(values)
    _check_kind(spec, array)
    if array.ndim == 0:
        array = np.broadcast_to(array, (num_rows,))
    if array.shape != (num_rows,):
        raise ValueError(
            f"column {spec.name!r} needs {num_rows} values (shape [{num_rows}]), got {array.shape}"
        )
    return array.astype(spec.dtype, copy=False)


def coerce_sequences(spec: ColumnSpec, values: object, num_rows: int) -> list[np.ndarray]:
    """``num_rows`` 1-D arrays of the column's element dtype."""
    if isinstance(values, np.ndarray):
        if values.ndim != 2 or values.shape[0] != num_rows:
            raise ValueError(
                f"column {spec.name!r} needs {num_rows} sequences or an array [{num_rows}, length]; "
                f"got an array of shape {values.shape}"
            )
        _check_kind(spec, values)
        return list(values.astype(spec.dtype, copy=False))
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(
            f"column {spec.name!r} ({spec.type_name}) needs a list of sequences; got {type(values)}"
        )
    if len(values) != num_rows:
        raise ValueError(f"column {spec.name!r} needs {num_rows} sequences, got {len(values)}")
    sequences = [value if isinstance(value, np.ndarray) else np.asarray(value) for value in values]
    dtypes = set()
    for array in sequences:
        if array.ndim != 1:
            raise ValueError(f"column {spec.name!r} holds 1-D sequences; got one of shape {array.shape}")
        if array.size:  # an empty list comes out float64; it fits any column
            dtypes.add(array.dtype)
    for dtype in dtypes:
        _check_dtype(spec, dtype)
    if spec.dtype.kind in "iu" and any(not np.can_cast(dtype, spec.dtype, "safe") for dtype in dtypes):
        _check_range(spec, np.concatenate([a for a in sequences if a.size]))
    if dtypes != {spec.dtype}:
        sequences = [array.astype(spec.dtype, copy=False) for array in sequences]
    return sequences


def coerce_strings(spec: ColumnSpec, values: object, num_rows: int) -> list[str]:
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise TypeError(f"column {spec.name!r} (str) needs a list of {num_rows} str; got {type(values)}")
    if len(values) != num_rows:
        raise ValueError(f"column {spec.name!r} needs {num_rows} strings, got {len(values)}")
    for value in values:
        if not isinstance(value, str):
            raise TypeError(
                f"column {spec.name!r} is str; got a value of type {type(value).__name__}: {value!r}"
            )
    return list(values)


def coerce_column(spec: ColumnSpec, values: object, num_rows: int) -> np.ndarray | list:
    if spec.kind == "scalar":
        return coerce_scalar(spec, values, num_rows)
    if spec.kind == "str":
        return coerce_strings(spec, values, num_rows)
    return coerce_sequences(spec, values, num_rows)


def pack_blob(spec: ColumnSpec, values: list, blob_id: int) -> tuple[bytes, np.ndarray]:
    """One blob holding every row's value; returns (bytes, refs [rows, 4] = (blob_id, offset, length, crc32)).

    Offsets and lengths count elements (bytes for str columns); crc32 is the CRC-32 of the row's bytes."""
    if spec.kind == "str":
        parts = [value.encode() for value in values]
        data = b"".join(parts)
        lengths = np.fromiter((len(p) for p in parts), np.int64, len(parts))
    else:
        lengths = np.fromiter((len(v) for v in values), np.int64, len(values))
        joined = np.concatenate(values) if values else np.zeros(0, spec.dtype)
        data = joined.astype(spec.dtype.newbyteorder("<"), copy=False).tobytes()
    refs = np.empty((len(values), len(REF_FIELDS)), np.int64)
    refs[:, 0] = blob_id
    refs[:, 2] = lengths
    refs[:, 1] = np.cumsum(lengths) - lengths
    itemsize = 1 if spec.kind == "str" else spec.dtype.itemsize
    view = memoryview(data)
    refs[:, 3] = [zlib.crc32(view[o * itemsize:(o + n) * itemsize]) for o, n in refs[:, 1:3].tolist()]
    return data, refs


def corrupted_rows(spec: ColumnSpec, raw: bytes, refs: np.ndarray) -> np.ndarray:
    """Positions (into ``refs`` [rows, 4], offsets relative to ``raw``) of the rows whose bytes in ``raw`` do not
    have the CRC-32 their reference recorded, or that reach past its end."""
    itemsize = 1 if spec.kind == "str" else spec.dtype.itemsize
    view = memoryview(raw)
    bad = [position for position, (offset, length, crc) in enumerate(refs[:, 1:4].tolist())
           if (offset + length) * itemsize > len(raw)
           or zlib.crc32(view[offset * itemsize:(offset + length) * itemsize]) != crc]
    return np.asarray(bad, np.int64)


def unpack_rows(spec: ColumnSpec, blob: np.ndarray | bytes, refs: np.ndarray) -> list:
    """Row values from one blob given their refs [rows, 4]."""
    if spec.kind == "str":
        return [bytes(blob[o : o + n]).decode() for o, n in refs[:, 1:3].tolist()]
    return [blob[o : o + n] for o, n in refs[:, 1:3].tolist()]
