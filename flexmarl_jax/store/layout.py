"""Where each piece of the store lives in TensorStore (see docs/store.md for the same layout in prose).

All keys below are inside one kvstore: the TensorStore ``memory`` driver, or an OCDBT database over
``file://WORKDIR/store/`` (or ``gs://.../store/``), so that one transaction covers every table atomically.

    schema.json                               store schema: agents, columns and their types
    tables/<agent>/counters/                  zarr3 int64 [2]: [row_count, next_blob_id]
    tables/<agent>/columns/<name>/            zarr3 [2**40] of the scalar dtype (by-value columns)
    tables/<agent>/columns/<name>/            zarr3 int64 [2**40, 3] (blob_id, offset, length): by reference
    tables/<agent>/blobs/<name>/<blob_id:012d>  raw little-endian elements; row r's value is
                                              elements[offset : offset + length]
"""

from __future__ import annotations

import json

import numpy as np
import tensorstore as ts

from flexmarl_jax.store.backends import STORE_BACKENDS
from flexmarl_jax.store.schema import VERSION_PREFIX, ColumnSpec
from flexmarl_jax.workdir_paths import kvstore_url

MAX_ROWS = 2**40  # arrays are sparse: unwritten chunks cost nothing
STORE_DIRNAME = "store"
SCHEMA_KEY = "schema.json"
BACKENDS = STORE_BACKENDS


def store_url(workdir: str) -> str:
    """The kvstore URL of a workdir's store: ``WORKDIR/store/`` (a local path or ``gs://bucket/path``)."""
    return kvstore_url(workdir, STORE_DIRNAME)


def base_kvstore_spec(workdir: str | None, backend: str) -> dict:
    """The kvstore holding every key of the store."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "memory":
        return {"driver": "memory"}
    if workdir is None:
        raise ValueError("backend='file' needs a workdir (a local path or gs://bucket/path); got None")
    return {"driver": "ocdbt", "base": store_url(workdir)}


def table_prefix(agent: str) -> str:
    return f"tables/{agent}/"


def column_key(agent: str, column: str) -> str:
    return f"{table_prefix(agent)}columns/{column}/"


def blob_key(agent: str, column: str, blob_id: int) -> str:
    return f"{table_prefix(agent)}blobs/{column}/{blob_id:012d}"


def counters_key(agent: str) -> str:
    return f"{table_prefix(agent)}counters/"


def fill_value(spec: ColumnSpec) -> object:
    if spec.by_reference:
        return 0
    if spec.name.startswith(VERSION_PREFIX):
        return -1
    if spec.dtype.kind == "f":
        return "NaN"
    return False if spec.dtype.kind == "b" else 0


def _zarr_spec(base: dict, path: str, shape: list[int], chunks: list[int], dtype: str, fill: object) -> dict:
    return {
        "driver": "zarr3",
        "kvstore": {**base, "path": path},
        "metadata": {
            "shape": shape,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
            "data_type": dtype,
            "fill_value": fill,
        },
    }


def column_array_spec(base: dict, agent: str, spec: ColumnSpec, rows_per_chunk: int) -> dict:
    """The zarr3 spec of one stored column: [rows] scalar, or [rows, 3] int64 blob references."""
    path = column_key(agent, spec.name)
    if spec.by_reference:
        return _zarr_spec(base, path, [MAX_ROWS, 3], [rows_per_chunk, 3], "int64", 0)
    return _zarr_spec(base, path, [MAX_ROWS], [rows_per_chunk], spec.dtype.name, fill_value(spec))


def counters_array_spec(base: dict, agent: str) -> dict:
    return _zarr_spec(base, counters_key(agent), [2], [2], "int64", 0)


def open_array_async(spec: dict, context: ts.Context, *, create: bool = True) -> ts.Future:
    """Opens (and with ``create``, creates if missing) an array; the future resolves to the TensorStore."""
    options = {"create": True, "open": True} if create else {"open": True}
    return ts.open({**spec, **options}, context=context)


def open_array(spec: dict, context: ts.Context, *, create: bool) -> ts.TensorStore:
    return open_array_async(spec, context, create=create).result()


def read_schema_json(kvstore: ts.KvStore) -> dict | None:
    result = kvstore.read(SCHEMA_KEY).result()
    if result.state != "value":
        return None
    return json.loads(bytes(result.value).decode())


def decode_blob(raw: bytes, dtype: np.dtype) -> np.ndarray:
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<"))
