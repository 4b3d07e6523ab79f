"""Group commit: batches queued together commit in one transaction and later batches win on overlap."""

import threading

import numpy as np
import pytest
import tensorstore as ts
from hypothesis import given, settings
from hypothesis import strategies as st

from flexmarl_jax.store import layout
from flexmarl_jax.store.commit import Committer, WriteBatch

write = st.tuples(
    st.booleans(),  # scattered (oindex) or contiguous (slice)
    st.lists(st.integers(0, 2047), min_size=1, max_size=40, unique=True),
    st.integers(1, 1000),
)


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(write, min_size=1, max_size=4), min_size=1, max_size=8))
def test_one_flush_applies_overlapping_writes_in_queue_order(batches):
    context = ts.Context()
    kvstore = ts.KvStore.open({"driver": "memory"}, context=context).result()
    array = layout.open_array(
        layout._zarr_spec({"driver": "memory"}, "x/", [4096], [512], "int32", 0), context, create=True
    )
    committer = Committer(kvstore)
    model = np.zeros(4096, np.int32)
    for writes in batches:
        batch = WriteBatch()
        for scattered, rows, value in writes:
            if scattered:
                index = np.array(sorted(rows), np.int64)
                model[index] = value
            else:
                index = slice(min(rows), max(rows) + 1)
                model[index] = value
            batch.write(array, index, np.full(len(model[index]), value, np.int32))
        last = committer.enqueue(batch)
    committer.wait(last)
    assert committer.num_transactions == 1
    np.testing.assert_array_equal(array.read().result(), model)


@pytest.mark.timeout(60)
def test_concurrent_writers_share_transactions_and_blobs_stay_readable_until_committed():
    context = ts.Context()
    kvstore = ts.KvStore.open({"driver": "memory"}, context=context).result()
    committer = Committer(kvstore)
    errors = []

    def writer(worker):
        try:
            for i in range(50):
                batch = WriteBatch()
                key = f"blob/{worker}/{i}"
                batch.put_blob(key, key.encode())
                seq = committer.enqueue(batch)
                pending = committer.pending_blob(key)
                committer.wait(seq)
                stored = kvstore.read(key).result().value
                assert stored == key.encode() and pending in (None, key.encode())
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert 1 <= committer.num_transactions <= 200
    assert committer.pending_blob("blob/0/0") is None


@pytest.mark.timeout(60)
def test_write_behind_returns_before_commit_keeps_blobs_readable_and_batches_transactions():
    context = ts.Context()
    kvstore = ts.KvStore.open({"driver": "memory"}, context=context).result()
    committer = Committer(kvstore, write_behind=True)
    keys = []
    for i in range(200):
        batch = WriteBatch()
        key = f"blob/{i}"
        batch.put_blob(key, key.encode())
        seq = committer.enqueue(batch)
        committer.settle(seq)  # never waits for the commit
        # Either still queued (then served from the queue) or already committed by the worker.
        pending = committer.pending_blob(key)
        assert pending == key.encode() or (pending is None and kvstore.read(key).result().value == key.encode())
        keys.append(key)
    committer.flush()
    assert all(kvstore.read(key).result().value == key.encode() for key in keys)
    assert all(committer.pending_blob(key) is None for key in keys)
    assert 1 <= committer.num_transactions < 200  # the worker commits what queued up meanwhile together
    assert committer.commit_cpu_s > 0


@pytest.mark.timeout(60)
def test_write_behind_failure_breaks_every_later_operation():
    from flexmarl_jax.store.commit import StoreBrokenError

    context = ts.Context()
    kvstore = ts.KvStore.open({"driver": "memory"}, context=context).result()
    array = layout.open_array(
        layout._zarr_spec({"driver": "memory"}, "x/", [64], [16], "int32", 0), context, create=True
    )
    committer = Committer(kvstore, write_behind=True)
    bad = WriteBatch()
    bad.write(array, slice(0, 4), np.zeros(3, np.int32))  # shape mismatch: the commit raises
    committer.settle(committer.enqueue(bad))  # returns: the failure happens on the worker
    with pytest.raises(StoreBrokenError):
        committer.flush()
    with pytest.raises(StoreBrokenError):
        committer.enqueue(WriteBatch())
