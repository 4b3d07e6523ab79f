"""The documented on-disk layout (docs/store.md) read back with plain TensorStore matches the store."""

import json
import zlib

import numpy as np
import tensorstore as ts

from flexmarl_jax.store import ExperienceStore
from flexmarl_jax.store.layout import store_url


def test_plain_tensorstore_reads_every_column_as_documented(tmp_path):
    store = ExperienceStore.open(
        tmp_path, agents=["solver", "judge"], backend="file", extra_columns={"tag": "str"}
    )
    rng = np.random.default_rng(0)
    responses = [rng.integers(0, 1000, n).astype(np.int32) for n in (3, 0, 5, 2)]
    ids = store.append_rows(
        "solver",
        input_ids=["a", "a", "b", "b"],
        trajectory_ids=[0, 1, 0, 1],
        turns=[2, 2, 0, 0],
        group_size=2,
        policy_versions={"solver": 4, "judge": [1, 1, 2, 2]},
        columns={"response_tokens": responses, "reward": [0.5, 1.0, 1.5, 2.0], "tag": ["x", "yy", "", "é"]},
    )
    store.set_columns("solver", ids[2:], {"reward": [7.0, 8.0]})  # overwritten values point at a new blob
    store.close()

    base = {"driver": "ocdbt", "base": store_url(tmp_path)}
    kv = ts.KvStore.open(base).result()
    schema = json.loads(kv.read("schema.json").result().value)
    assert schema["agents"] == ["solver", "judge"] and schema["columns"]["tag"] == "str"

    def column(name):
        return ts.open(
            {"driver": "zarr3", "kvstore": {**base, "path": f"tables/solver/columns/{name}/"}}
        ).result()

    counters = ts.open({"driver": "zarr3", "kvstore": {**base, "path": "tables/solver/counters/"}}).result()
    row_count = int(counters[0].read().result())
    assert row_count == 4

    def by_reference(name, dtype):
        values = []
        for blob_id, offset, length, crc32 in column(name)[:row_count].read().result().tolist():
            blob = kv.read(f"tables/solver/blobs/{name}/{blob_id:012d}").result().value if blob_id else b""
            value = np.frombuffer(blob, dtype)[offset : offset + length]
            assert zlib.crc32(value.tobytes()) == crc32  # each value carries the CRC-32 of its bytes
            values.append(value)
        return values

    assert [bytes(v).decode() for v in by_reference("sample_id", "u1")] == [
        "a_2_0",
        "a_2_1",
        "b_0_0",
        "b_0_1",
    ]
    assert [bytes(v).decode() for v in by_reference("tag", "u1")] == ["x", "yy", "", "é"]
    for got, want in zip(by_reference("response_tokens", "<i4"), responses, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(column("reward")[:row_count].read().result(), [0.5, 1.0, 7.0, 8.0])
    np.testing.assert_array_equal(column("version__judge")[:row_count].read().result(), [1, 1, 2, 2])
    np.testing.assert_array_equal(column("turn")[:row_count].read().result(), [2, 2, 0, 0])
    np.testing.assert_array_equal(column("status__reward")[:row_count].read().result(), [True] * 4)
    np.testing.assert_array_equal(column("status__advantage")[:row_count].read().result(), [False] * 4)
    np.testing.assert_array_equal(column("state")[:row_count].read().result(), [1] * 4)  # pending
    assert np.isnan(column("ready_at")[:row_count].read().result()).all()
    assert (column("created_at")[:row_count].read().result() > 1.6e9).all()
