"""A small pool of worker processes that run one function, with a deadline on every call.

`concurrent.futures.ProcessPoolExecutor` does not fit: a running call cannot be cancelled, and one dead worker
breaks the whole pool. Here each worker is a process with its own pipe. A caller borrows an idle worker, sends
it the arguments and waits at most `timeout_s`; a worker that misses the deadline or dies is killed and replaced,
and the caller gets an exception at once (it does not wait for the replacement to start). So no call hangs,
and one bad input costs one worker start, not the pool. Workers are reused between calls: starting one (a fresh
interpreter plus the function's imports) costs far more than a call.

Workers are started with 'spawn': the parent runs JAX and rollout threads, and forking a threaded process can
leave the child holding locks no thread will ever release.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

_STOP = None  # the message that ends a worker's loop
MAX_FAILED_STARTS = 3  # workers in a row that die while starting before the pool gives up


class PoolCallError(RuntimeError):
    """A call gave no result. This class itself: the function raised in the worker (the worker lives on)."""


class WorkerLost(PoolCallError):
    """The worker died (or never started) during the call; it was replaced."""


class CallTimeout(WorkerLost):
    """The worker did not answer within the call's deadline; it was killed and replaced."""


class PoolClosed(PoolCallError):
    """The pool was closed before the call could run."""


def _serve(connection: Connection, function: Callable[..., Any], warm_up_args: tuple | None) -> None:
    """A worker's main loop: reply to each argument tuple with (True, result) or (False, error text)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it closes the pool
    try:
        if warm_up_args is not None:
            function(*warm_up_args)  # imports and first-call costs, paid before any call has a deadline
    except Exception as error:
        connection.send((False, f"{type(error).__name__}: {error}"))
        return
    connection.send((True, None))
    while True:
        try:
            args = connection.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if args is _STOP:
            return
        try:
            reply = (True, function(*args))
        except Exception as error:
            reply = (False, f"{type(error).__name__}: {error}")
        connection.send(reply)


class _Worker:
    """One worker process and the parent's end of its pipe. Used by one thread at a time."""

    def __init__(self, context, function: Callable[..., Any], warm_up_args: tuple | None, name: str):
        self.connection, child_end = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_serve, args=(child_end, function, warm_up_args), name=name, daemon=True
        )
        self.process.start()
        child_end.close()  # the worker holds the only other end, so its death reads as EOF here
        self.ready = False

    def wait_ready(self, start_timeout_s: float) -> None:
        """Block until the worker has imported and warmed up; raises WorkerLost, or PoolCallError on a failed
        warm-up (the function cannot run there at all)."""
        try:
            if not self.connection.poll(start_timeout_s):
                raise WorkerLost(f"worker did not start within {start_timeout_s:g} s")
            ok, error = self.connection.recv()
        except (EOFError, OSError):
            self.process.join(timeout=1)  # for its exit code
            raise WorkerLost(f"worker died while starting (exit code {self.process.exitcode})") from None
        if not ok:
            raise PoolCallError(f"worker warm-up failed: {error}")
        self.ready = True

    def call(self, args: tuple, timeout_s: float) -> Any:
        try:
            self.connection.send(args)
            if not self.connection.poll(timeout_s):
                raise CallTimeout(f"no answer within {timeout_s:g} s")
            ok, value = self.connection.recv()
        except (EOFError, OSError):
            self.process.join(timeout=1)
            raise WorkerLost(f"worker died during the call (exit code {self.process.exitcode})") from None
        if not ok:
            raise PoolCallError(value)
        return value

    def kill(self) -> None:
        """Stop the process now: it may be stuck in C code that no signal handler interrupts."""
        self.process.kill()

    def dispose(self) -> None:
        self.kill()
        self.process.join(timeout=10)
        self.connection.close()


class TimedProcessPool:
    """`workers` processes running `function`; `call(*args)` returns `function(*args)` or raises.

    Args:
      function: a module-level function (pickled by reference into each worker).
      workers: how many calls run at once; more callers wait for an idle worker.
      timeout_s: the deadline of one call, counted from when it is sent to its worker.
      start_timeout_s: how long a call waits for a fresh worker to start (import + warm-up).
      warm_up_args: a call each worker makes before it accepts work, so imports and caches are not charged
        to the first call's deadline.

    Workers start on the first call (or on `start()`). Raises from `call`: CallTimeout / WorkerLost (the worker
    was replaced), PoolCallError (the function raised, or the workers cannot start at all), PoolClosed.
    """

    def __init__(
        self,
        function: Callable[..., Any],
        *,
        workers: int = 2,
        timeout_s: float = 5.0,
        start_timeout_s: float = 60.0,
        warm_up_args: tuple | None = None,
        name: str = "pool-worker",
    ):
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        if not timeout_s > 0 or not start_timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} and start_timeout_s={start_timeout_s} must be > 0")
        self.function, self.workers, self.timeout_s = function, workers, timeout_s
        self.start_timeout_s, self.warm_up_args, self.name = start_timeout_s, warm_up_args, name
        self._context = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._idle: queue.Queue[_Worker | None] = queue.Queue()  # None: closed or broken, wake up and leave
        self._live: set[_Worker] = set()  # idle and borrowed
        self._started = self._closed = False
        self._broken: str | None = None  # why workers cannot start at all
        self._failed_starts = 0  # workers in a row that died before they were ready
        self.replaced = 0  # workers killed for a timeout or found dead

    def start(self) -> None:
        """Start the workers now, without waiting for them (they warm up in the background)."""
        with self._lock:
            if self._started or self._closed:
                return
            self._started = True
            for _ in range(self.workers):
                self._add_worker()

    def call(self, *args: Any) -> Any:
        """`function(*args)` run in a worker; waits for an idle worker first if all are busy."""
        self.start()
        worker = self._borrow()
        healthy = False
        try:
            if not worker.ready:
                self._wait_ready(worker)
            result = worker.call(args, self.timeout_s)
            healthy = True
            return result
        except WorkerLost:
            raise
        except PoolCallError:
            healthy = True  # the function raised: the worker itself is fine
            raise
        finally:
            self._give_back(worker, healthy)

    def close(self) -> None:
        """Kill every worker; calls in progress end with WorkerLost, later ones raise PoolClosed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live, self._live = self._live, set()
        idle = set()
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                break
            if worker is not None:
                idle.add(worker)
        for worker in live:
            if worker in idle:
                worker.dispose()
            else:  # a borrowed worker's pipe belongs to its caller, which disposes of it on return
                worker.kill()
        self._idle.put(None)

    def _wait_ready(self, worker: _Worker) -> None:
        """Wait for a fresh worker; WorkerLost if it cannot serve. A failed warm-up, or several workers in a row
        dying at start (an import error; a main script that does work at import without a
        `if __name__ == "__main__":` guard, which 'spawn' re-runs in every worker), breaks the pool for good
        rather than restarting a doomed worker on every call."""
        try:
            worker.wait_ready(self.start_timeout_s)
        except PoolCallError as error:
            with self._lock:
                self._failed_starts += 1
                if not isinstance(error, WorkerLost) or self._failed_starts >= MAX_FAILED_STARTS:
                    self._broken = str(error)
            raise WorkerLost(str(error)) from None
        with self._lock:
            self._failed_starts = 0

    def _add_worker(self) -> None:
        worker = _Worker(self._context, self.function, self.warm_up_args, self.name)
        self._live.add(worker)
        self._idle.put(worker)

    def _borrow(self) -> _Worker:
        worker = None if self._closed or self._broken is not None else self._idle.get()
        if worker is None:  # closed or broken: close() and _give_back put None to wake waiting callers
            self._idle.put(None)  # ... and each woken caller wakes the next
            if self._closed:
                raise PoolClosed(f"{self.name} pool is closed")
            raise PoolCallError(f"{self.name} workers cannot start: {self._broken}")
        return worker

    def _give_back(self, worker: _Worker, healthy: bool) -> None:
        with self._lock:
            if healthy and not self._closed:
                self._idle.put(worker)
                return
            self._live.discard(worker)
            replace = not self._closed and self._broken is None
            if replace:
                self.replaced += 1
                self._add_worker()
        worker.dispose()
        if replace:
            logger.warning("%s: replaced a worker that timed out or died", self.name)
        elif self._broken is not None:
            self._idle.put(None)
