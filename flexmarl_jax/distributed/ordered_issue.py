"""Issuing the computations on meshes that span processes in one order on every process, from one thread.

With several processes, a jitted computation on a mesh that spans them runs only when every process issues
it, and its collectives pair up by issue order: two spanning computations issued in different orders on two
processes exchange each other's buffers and return wrong numbers, without any error (measured with JAX 0.10.2
on CPU over gloo). The pipeline's threads (one dispatcher per agent, one apply thread per agent) finish in
whatever order each host's timing gives, so they must not issue such computations themselves.

`OrderedIssuer` takes the computations from any thread, each under a key, and runs them on its own single
thread in the order of a schedule; the schedule is a pure function of the config and the iteration (agents in
first-call order, micro-batches in group-id order: `pipeline.deterministic`), so every process computes the
same one without exchanging a message (docs/architecture.md, "Several hosts").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from typing import Any


class OrderedIssuer:
    """Runs `submit`ted callables one at a time, in the order `expect` lists their keys.

    A key may be submitted before or after it is expected; the issuer waits for the next expected key and
    never runs a later one first. `close()` ends the thread; keys expected but never submitted are an error
    then (a schedule that differs from what the threads did)."""

    def __init__(self, name: str = "ordered-issue"):
        self._cond = threading.Condition()
        self._order: list[Hashable] = []  # every key expected so far, in schedule order
        self._next = 0  # index in _order of the next key to run
        self._pending: dict[Hashable, tuple[Callable[[], Any], Future]] = {}
        self._issued: list[Hashable] = []  # keys run, in order: what tests compare across processes
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def expect(self, keys: Iterable[Hashable]) -> None:
        """Appends ``keys`` to the schedule (each key once over the issuer's life)."""
        with self._cond:
            for key in keys:
                if key in self._order:
                    raise ValueError(f"key {key!r} is already in the schedule")
                self._order.append(key)
            self._cond.notify_all()

    def submit(self, key: Hashable, computation: Callable[[], Any]) -> Future:
        """Queues ``computation`` under ``key``; its result (or error) arrives in the returned future."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"the issuer is closed; {key!r} was submitted after close()")
            if key in self._pending or key in self._issued:
                raise ValueError(f"key {key!r} was submitted twice")
            self._pending[key] = (computation, future)
            self._cond.notify_all()
        return future

    def run(self, key: Hashable, computation: Callable[[], Any]) -> Any:
        """`submit` and wait for the result in the calling thread."""
        return self.submit(key, computation).result()

    @property
    def issued(self) -> list[Hashable]:
        with self._cond:
            return list(self._issued)

    def close(self, timeout: float | None = 60.0) -> None:
        """Stops the thread after every expected key that was submitted ran; raises if the schedule still
        expects keys that nobody submitted."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            missing = self._order[self._next:]
            unexpected = [key for key in self._pending if key not in self._order]
        if missing or unexpected:
            raise RuntimeError(f"the ordered issuer closed with scheduled keys never submitted {missing} and "
                               f"submitted keys never scheduled {unexpected}")

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._ready() and not self._closed:
                    self._cond.wait()
                if not self._ready():
                    return  # closed, and the next expected key was never submitted
                key = self._order[self._next]
                computation, future = self._pending.pop(key)
            try:  # outside the lock: threads keep submitting while a computation runs
                result = computation()
            except BaseException as error:  # noqa: BLE001 - handed to the submitter
                future.set_exception(error)
            else:
                future.set_result(result)
            with self._cond:
                self._issued.append(key)
                self._next += 1

    def _ready(self) -> bool:
        return self._next < len(self._order) and self._order[self._next] in self._pending
