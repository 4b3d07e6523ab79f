"""Group commit: every store operation's writes go into one atomic TensorStore transaction.

Operations enqueue their ``WriteBatch`` while holding their table's lock (so the queue order is the order
in which they changed the in-memory index) and then wait until it is committed. Whichever waiter finds no
flush running commits *everything* queued so far in one transaction, so concurrent writers share commits
(batched transactions) and an OCDBT database sees one new manifest per flush rather than per call.
A transaction is atomic: after a crash either all of a batch's rows/columns are there or none.

With ``write_behind`` (the memory backend, where nothing survives the process anyway) an operation does not
wait: a background thread commits the queue, so the commit's cost leaves the callers' critical paths (rollout
appending, trainers claiming). Reads of blobs still in flight are served from the queue
(``pending_blob``), and a failed commit breaks the store for every later call, as it does without it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time

import numpy as np
import tensorstore as ts

from flexmarl_jax import faults

logger = logging.getLogger(__name__)

_worker: concurrent.futures.ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def _commit_worker() -> concurrent.futures.ThreadPoolExecutor:
    """The thread that runs write-behind commits of every store in the process. An executor, not a thread of
    each store: it finishes queued commits at interpreter exit and keeps no store alive once it is idle."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-commit")
        return _worker


class StoreBrokenError(RuntimeError):
    """A commit failed; the in-memory index no longer matches the durable store, so the store refuses work."""


@dataclasses.dataclass
class WriteBatch:
    """Array slice writes and blob writes that must become visible together."""

    array_writes: list[tuple[ts.TensorStore, object, np.ndarray]] = dataclasses.field(default_factory=list)
    blob_writes: list[tuple[str, bytes | None]] = dataclasses.field(default_factory=list)  # None: delete

    def write(self, array: ts.TensorStore, index: object, values: np.ndarray) -> None:
        """``index`` is a slice (contiguous rows) or an int64 array of rows (scattered, via ``oindex``)."""
        self.array_writes.append((array, index, values))

    def put_blob(self, key: str, data: bytes) -> None:
        self.blob_writes.append((key, data))

    def delete_blob(self, key: str) -> None:
        self.blob_writes.append((key, None))

    def __bool__(self) -> bool:
        return bool(self.array_writes or self.blob_writes)


class Committer:
    """Commits queued write batches in order, several per transaction."""

    def __init__(self, kvstore: ts.KvStore, *, write_behind: bool = False):
        self._kvstore = kvstore
        self.write_behind = write_behind
        self._cond = threading.Condition(threading.Lock())
        self._queue: list[tuple[int, WriteBatch]] = []
        # Blobs queued but not yet committed: a claim may read a row whose append is still in flight.
        self._pending_blobs: dict[str, bytes] = {}
        self._next_seq = 1
        self._committed_seq = 0
        self._flushing = False
        self._error: BaseException | None = None
        self.num_transactions = 0
        self.commit_cpu_s = 0.0  # CPU seconds spent committing, whichever thread did it
        self._drain_scheduled = False  # write-behind: a commit worker task will pick up the queue

    def enqueue(self, batch: WriteBatch) -> int:
        """Queues a batch; returns its sequence number for ``wait``. Call with the table lock held."""
        with self._cond:
            self._raise_if_broken()
            seq = self._next_seq
            self._next_seq += 1
            self._queue.append((seq, batch))
            for key, data in batch.blob_writes:
                if data is not None:
                    self._pending_blobs[key] = data
            if self.write_behind and not self._drain_scheduled:
                self._drain_scheduled = True
                _commit_worker().submit(self._drain_queue)
            return seq

    def settle(self, seq: int) -> None:
        """What an operation does after queueing batch ``seq``: waits for its commit (durable backends), or
        only checks that earlier commits succeeded (``write_behind``)."""
        if self.write_behind:
            with self._cond:
                self._raise_if_broken()
            return
        self.wait(seq)

    def pending_blob(self, key: str) -> bytes | None:
        with self._cond:
            return self._pending_blobs.get(key)

    def wait(self, seq: int) -> None:
        """Returns once batch ``seq`` is committed, committing the queue itself when no one else is."""
        while True:
            with self._cond:
                while self._flushing and self._committed_seq < seq and self._error is None:
                    self._cond.wait()
                if self._committed_seq >= seq:
                    return
                self._raise_if_broken()
                self._flushing = True
                batches, self._queue = self._queue, []
            error = None
            cpu_start = time.thread_time()
            try:
                self._commit([batch for _, batch in batches])
            except BaseException as exc:  # noqa: BLE001 - re-raised below and to every other waiter
                error = exc
            with self._cond:
                self.commit_cpu_s += time.thread_time() - cpu_start
                self._flushing = False
                if error is not None:
                    logger.error("experience store commit failed; the store is now unusable: %s", error)
                    self._error = error
                else:
                    self._committed_seq = (
                        max(self._committed_seq, batches[-1][0]) if batches else self._committed_seq
                    )
                    for _, batch in batches:
                        for key, _ in batch.blob_writes:
                            self._pending_blobs.pop(key, None)
                self._cond.notify_all()

    def flush(self) -> None:
        with self._cond:
            last = self._next_seq - 1
        if last:
            self.wait(last)

    def _drain_queue(self) -> None:
        """Write-behind: commits until the queue is empty (batches queued meanwhile share the next commit)."""
        while True:
            with self._cond:
                if not self._queue or self._error is not None:
                    self._drain_scheduled = False
                    return
                last = self._next_seq - 1
            try:
                self.wait(last)
            except StoreBrokenError:
                pass  # logged by the commit that failed; callers see it on their next operation

    def _raise_if_broken(self) -> None:
        if self._error is not None:
            raise StoreBrokenError(f"an earlier commit failed: {self._error!r}") from self._error

    def _commit(self, batches: list[WriteBatch]) -> None:
        if not any(batches):
            return
        faults.raise_if_fired("store_commit")
        txn = ts.Transaction(atomic=True)
        futures = []
        # Within one transaction TensorStore does not order overlapping writes that are in flight together
        # (measured: oindex writes issued back to back may land out of order). Later batches must win, so
        # a write waits for the previous write to the same array; different arrays still write in parallel.
        in_flight: dict[int, ts.Future] = {}
        kvstore = self._kvstore.with_transaction(txn)
        for batch in batches:
            for array, index, values in batch.array_writes:
                previous = in_flight.get(id(array))
                if previous is not None:
                    previous.result()
                target = array.with_transaction(txn)
                view = target.oindex[index] if isinstance(index, np.ndarray) else target[index]
                in_flight[id(array)] = view.write(values)
                futures.append(in_flight[id(array)])
            for key, data in batch.blob_writes:  # a key is written once, maybe deleted later (in order)
                futures.append(kvstore.write(key, data))
        for future in futures:
            future.result()
        txn.commit_async().result()
        self.num_transactions += 1
