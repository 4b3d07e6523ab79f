"""Where each piece of the store lives in TensorStore (see docs/store.md for the same layout in prose).

All keys below are inside one kvstore: the TensorStore ``memory`` driver, or an OCDBT database over
``file://WORKDIR/store/`` (or ``gs://.../store/``), so that one transaction covers every table atomically.

    schema.json                               store schema: agents, columns and their types
    schema.crc32                              the CRC-32 of schema.json's bytes, 8 hex digits
    tables/<agent>/counters/                  zarr3 int64 [2]: [row_count, next_blob_id]
    tables/<agent>/columns/<name>/            zarr3 [2**40] of the scalar dtype (by-value columns)
    tables/<agent>/columns/<name>/            zarr3 int64 [2**40, 4] (blob_id, offset, length, crc32): by reference
    tables/<agent>/blobs/<name>/<blob_id:012d>  raw little-endian elements; row r's value is
                                              elements[offset : offset + length], whose bytes have CRC-32 crc32

Integrity: every zarr3 array ends its codec chain with TensorStore's ``crc32c`` codec, so a chunk whose bytes
changed fails its read; a blob is raw bytes, so each row's reference carries the CRC-32 of its value, checked
when the value is read back (`values.corrupted_rows`). OCDBT checksums its own manifest and B+tree nodes (values
up to 100 bytes are stored inside the nodes); only its out-of-line values need the two checks above.
"""

from __future__ import annotations

import json
import zlib

import numpy as np
import tensorstore as ts

from flexmarl_jax.store.backends import STORE_BACKENDS
from flexmarl_jax.store.corruption import StoreCorrupted
from flexmarl_jax.store.schema import VERSION_PREFIX, ColumnSpec
from flexmarl_jax.store.values import REF_FIELDS
from flexmarl_jax.workdir_paths import kvstore_url

MAX_ROWS = 2**40  # arrays are sparse: unwritten chunks cost nothing
STORE_DIRNAME = "store"
SCHEMA_KEY = "schema.json"
SCHEMA_CRC_KEY = "schema.crc32"  # 8 hex digits: the CRC-32 of schema.json's bytes, written in the same transaction
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
            # crc32c last: TensorStore appends the checksum to each chunk's bytes and checks it on every read.
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        },
    }


def column_array_spec(base: dict, agent: str, spec: ColumnSpec, rows_per_chunk: int) -> dict:
    """The zarr3 spec of one stored column: [rows] scalar, or [rows, 4] int64 blob references."""
    path = column_key(agent, spec.name)
    if spec.by_reference:
        width = len(REF_FIELDS)
        return _zarr_spec(base, path, [MAX_ROWS, width], [rows_per_chunk, width], "int64", 0)
    return _zarr_spec(base, path, [MAX_ROWS], [rows_per_chunk], spec.dtype.name, fill_value(spec))


def counters_array_spec(base: dict, agent: str) -> dict:
    return _zarr_spec(base, counters_key(agent), [2], [2], "int64", 0)


def open_array_async(spec: dict, context: ts.Context, *, create: bool = True) -> ts.Future:
    """Opens (and with ``create``, creates if missing) an array; the future resolves to the TensorStore."""
    options = {"create": True, "open": True} if create else {"open": True}
    return ts.open({**spec, **options}, context=context)


def open_array(spec: dict, context: ts.Context, *, create: bool) -> ts.TensorStore:
    return open_array_async(spec, context, create=create).result()


def write_schema_json(kvstore: ts.KvStore, payload: bytes) -> None:
    """Writes schema.json and its CRC-32 in one transaction."""
    transaction = ts.Transaction()
    kvstore.with_transaction(transaction).write(SCHEMA_KEY, payload).result()
    kvstore.with_transaction(transaction).write(SCHEMA_CRC_KEY, f"{zlib.crc32(payload):08x}".encode()).result()
    transaction.commit_async().result()


def read_schema_json(kvstore: ts.KvStore) -> dict | None:
    """The stored schema (None: no store here). Raises StoreCorrupted when its bytes fail their CRC-32."""
    result = kvstore.read(SCHEMA_KEY).result()
    if result.state != "value":
        return None
    payload = bytes(result.value)
    crc = kvstore.read(SCHEMA_CRC_KEY).result()
    if crc.state != "value" and b'"flexmarl-store/1"' in payload:
        return json.loads(payload.decode())  # written before checksums: TableSchema.from_json refuses its format
    recorded = bytes(crc.value).decode(errors="replace") if crc.state == "value" else "nothing"
    if recorded != f"{zlib.crc32(payload):08x}":
        raise StoreCorrupted(None, [], f"{SCHEMA_KEY} has CRC-32 {zlib.crc32(payload):08x}, {SCHEMA_CRC_KEY} "
                                      f"holds {recorded!r}; the store cannot be opened")
    return json.loads(payload.decode())


def decode_blob(raw: bytes, dtype: np.dtype) -> np.ndarray:
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<"))
