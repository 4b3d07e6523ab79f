"""Liveness of a run: when anything last made progress, and waits that end when nothing does.

A run is alive while something moves: a rollout row reaches the store, a micro-batch is trained, an
iteration phase ends, an engine instance finishes a decode step. `ProgressBeacon` keeps the time of the
latest such event (its own beats plus sources it polls, such as each instance's step counter, read without
any lock). `Liveness` is what every wait of the pipeline consults: instead of blocking for good on a thread
or an event, a wait blocks in short slices and, between them, gives up with `PipelineStalled` once the beacon
has been quiet for `stall_timeout_s`, or with `IterationAbandoned` once a stop asked to give up the current
iteration. So no wait in the pipeline outlasts the last sign of progress by more than the stall timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class PipelineStalled(RuntimeError):
    """Nothing made progress for the stall timeout while the pipeline waited; the message says for what."""


class IterationAbandoned(RuntimeError):
    """A stop (SIGTERM/SIGINT with `run.stop_mode=abandon`, or a second signal) gave up the iteration."""


class ProgressBeacon:
    """The time (monotonic seconds) and kind of the latest progress of a run.

    `beat(what)` is cheap and lock-free (two attribute writes), so hot paths may call it; `add_source` adds a
    callable returning another component's last progress time (an engine instance's last decode step)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._last, self._what = clock(), "start"
        self._sources: list[tuple[str, Callable[[], float]]] = []

    def beat(self, what: str) -> None:
        self._last, self._what = self.clock(), what

    def add_source(self, name: str, last_progress: Callable[[], float]) -> None:
        self._sources.append((name, last_progress))

    def last(self) -> tuple[float, str]:
        """(time, what) of the latest progress over the beats and every source."""
        latest = (self._last, self._what)
        for name, source in list(self._sources):
            at = source()
            if at > latest[0]:
                latest = (at, name)
        return latest

    def idle_s(self) -> float:
        return self.clock() - self.last()[0]


class Liveness:
    """What a pipeline wait checks between slices: the beacon against `stall_timeout_s` (None: never stalls)
    and the `abandon` event."""

    def __init__(self, beacon: ProgressBeacon, stall_timeout_s: float | None, *,
                 abandon: threading.Event | None = None, slice_s: float = 0.25):
        self.beacon, self.stall_timeout_s, self.slice_s = beacon, stall_timeout_s, slice_s
        self.abandon = abandon if abandon is not None else threading.Event()

    def check(self, waiting_for: str, *, abandonable: bool = True) -> None:
        """Raises IterationAbandoned (when `abandonable`) or PipelineStalled (naming `waiting_for`) when the wait
        must end."""
        if abandonable and self.abandon.is_set():
            raise IterationAbandoned(f"the iteration was abandoned while waiting for {waiting_for}")
        if self.stall_timeout_s is None:
            return
        at, what = self.beacon.last()
        idle = self.beacon.clock() - at
        if idle > self.stall_timeout_s:
            raise PipelineStalled(f"no progress for {idle:.0f} s (run.stall_timeout_s={self.stall_timeout_s:g}) "
                                  f"while waiting for {waiting_for}; the last progress was: {what}")

    def wait_until(self, done: Callable[[float], bool], waiting_for: str, *, abandonable: bool = True) -> None:
        """Calls `done(slice_s)` (wait up to that long; True once finished) until it is True, checking in between.
        A wait that is not `abandonable` (a thread that ends soon once the iteration is abandoned, and must have
        ended before its claims are given back) ends only by finishing or stalling."""
        while not done(self.slice_s):
            self.check(waiting_for, abandonable=abandonable)

    def wait_event(self, event: threading.Event, waiting_for: str) -> None:
        self.wait_until(event.wait, waiting_for)

    def join(self, thread: threading.Thread, waiting_for: str | None = None, *, abandonable: bool = True) -> None:
        def joined(timeout: float) -> bool:
            thread.join(timeout)
            return not thread.is_alive()

        self.wait_until(joined, waiting_for or f"thread {thread.name}", abandonable=abandonable)
