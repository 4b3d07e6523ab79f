"""`TimedStore`: the experience-store proxy behind the pipeline benchmark's `store_time_fraction`."""

from __future__ import annotations

import threading
import time


class TimedStore:
    """A proxy over an ExperienceStore recording the interval of every call that does store work.

    `claim_micro_batch(timeout>0)` becomes non-blocking claims (timed) and waits (not timed) for a write
    through this proxy that can make the agent's rows claimable, or for its `until` event: waiting for
    rollout to produce rows is idle time, not store time. Every store call of the orchestrator goes through
    the proxy, so no write that could make rows ready is missed.

    Args:
      clock: seconds; pass the run's `Timeline.now` so that intervals share the timeline's clock.
    """

    def __init__(self, store, clock=time.perf_counter):
        self._store, self._clock = store, clock
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        # agent -> writes so far that can make its rows claimable; a failed claim waits for its agent's to move
        self._writes: dict[str, int] = {}
        # (agent, ClaimedRows.table_changes) -> this proxy's write count before that claim: a later claim
        # `since` it waits for a newer write before asking the store again.
        self._writes_at_claim: dict[tuple[str, int], int] = {}
        self.intervals: list[tuple[float, float]] = []
        # method -> [calls, wall seconds, CPU seconds of the calling thread]; wall >> CPU means the call
        # waited (for the GIL, a core, the committer), not that the store worked that long.
        self.calls: dict[str, list] = {}

    def _timed(self, name: str, fn, *args, **kwargs):
        start, cpu_start = self._clock(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            end, cpu = self._clock(), time.thread_time() - cpu_start
            with self._lock:
                self.intervals.append((start, end))
                counts = self.calls.setdefault(name, [0, 0.0, 0.0])
                counts[0] += 1
                counts[1] += end - start
                counts[2] += cpu

    def __getattr__(self, name: str):
        attribute = getattr(self._store, name)
        if not callable(attribute) or name.startswith("_"):
            return attribute
        return lambda *args, **kwargs: self._timed(name, attribute, *args, **kwargs)

    def _wrote(self, agent: str) -> None:
        """Rows of `agent` may have become claimable: wake its waiting claims."""
        with self._changed:
            self._writes[agent] = self._writes.get(agent, 0) + 1
            self._changed.notify_all()

    def append_rows(self, agent: str, **kwargs):
        try:
            return self._timed("append_rows", self._store.append_rows, agent, **kwargs)
        finally:
            self._wrote(agent)

    def set_columns(self, agent: str, rows, columns):
        try:
            return self._timed("set_columns", self._store.set_columns, agent, rows, columns)
        finally:
            self._wrote(agent)

    def release(self, batch):
        try:
            return self._timed("release", self._store.release, batch)
        finally:
            self._wrote(batch.agent)

    def wake_claims(self) -> None:
        """Waiting claims re-check their `until` event (no rows changed: they need not claim again)."""
        self._timed("wake_claims", self._store.wake_claims)
        with self._changed:
            self._changed.notify_all()

    def claim_micro_batch(self, agent: str, size: int, *, timeout: float | None = 0.0,
                          until: threading.Event | None = None, since: int | None = None, **kwargs):
        deadline = None if timeout is None else time.monotonic() + timeout
        writes_seen = self._writes_at_claim.get((agent, since)) if since is not None else None
        while True:
            # The store said nothing changed since `since`: wait for a write first.
            if writes_seen is not None and not self._wait_for_write(agent, writes_seen, deadline, until):
                return None
            with self._changed:
                writes_seen = self._writes.setdefault(agent, 0)
            rows = self._timed("claim_micro_batch", self._store.claim_micro_batch, agent, size, timeout=0,
                               **kwargs)
            if rows is not None:
                with self._changed:
                    self._writes_at_claim[(agent, getattr(rows, "table_changes", None))] = writes_seen
                return rows
            if not self._wait_for_write(agent, writes_seen, deadline, until):
                return None  # nothing of this agent changed since the failed attempt

    def _wait_for_write(self, agent: str, writes_seen: int, deadline: float | None,
                        until: threading.Event | None) -> bool:
        """Waits until `agent` has a write after `writes_seen` (True) or the deadline / `until` comes (False)."""
        with self._changed:
            while self._writes.get(agent, 0) == writes_seen:
                remaining = None if deadline is None else deadline - time.monotonic()
                if (remaining is not None and remaining <= 0) or (until is not None and until.is_set()):
                    return False
                self._changed.wait(remaining)
        return True

    def cpu_seconds(self) -> float:
        """CPU seconds of store work so far: inside the calls, plus the store's background commits."""
        with self._lock:
            in_calls = sum(counts[2] for counts in self.calls.values())
        return in_calls + getattr(self._store, "commit_cpu_seconds", 0.0)

    def call_totals(self) -> dict[str, tuple[int, float, float]]:
        """method -> (calls, wall seconds, CPU seconds) so far."""
        with self._lock:
            return {name: tuple(counts) for name, counts in self.calls.items()}

    def busy_seconds(self, t0: float, t1: float) -> float:
        """Seconds of [t0, t1] during which at least one store call was working (overlaps count once)."""
        from flexmarl_jax.metrics import union_length

        with self._lock:
            return union_length(list(self.intervals), t0, t1)

    def summed_seconds(self, t0: float, t1: float) -> float:
        """Seconds of store calls clipped to [t0, t1], summed over threads."""
        with self._lock:
            return sum(max(0.0, min(end, t1) - max(start, t0)) for start, end in self.intervals)
