"""A thread-safe record of what every resource was doing when: busy intervals, point events, samples.

Resources are named `<group>/<...>`; the first path component is the group used for pooled utilization:
`rollout/solver/0` (instance 0 serving agent solver) and `train/slice1` both work, giving the groups
`rollout` and `train`.

Times are seconds since the timeline was created (its clock's origin). Every recording method also takes
an explicit `time=` / `start=, end=` so that a simulator or a test can write a timeline without waiting.

This module records and persists; the records themselves and the series names live in timeline_records.py,
and utilization, the wall-time split and counter rates are computed by `TimelineAccounting`
(utilization.py), which `Timeline` inherits. The package (`flexmarl_jax.metrics`) exports all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import threading
import time as time_module
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from flexmarl_jax import workdir_paths
from flexmarl_jax.metrics.jsonable import to_jsonable
from flexmarl_jax.metrics.timeline_records import (
    ITERATION_SPAN,
    MIGRATION,
    POLICY_VERSION,
    BusyInterval,
    PointEvent,
    Sample,
    resource_group,
)
from flexmarl_jax.metrics.utilization import TimelineAccounting

TIMELINE_FILENAME = "timeline.json"
_FORMAT = "flexmarl-timeline"
_FORMAT_VERSION = 1


class Timeline(TimelineAccounting):
    """Thread-safe recorder of busy intervals, point events, gauges and counters (and, through
    `TimelineAccounting`, their utilization and time split).

    Args:
      clock: returns seconds (monotonic); the timeline's time 0 is the clock's value at construction.
        Tests and simulators pass a fake clock or explicit times.
    """

    def __init__(self, clock: Callable[[], float] = time_module.perf_counter):
        self._clock = clock
        self._origin = clock()
        self.origin_unix = time_module.time()
        self._lock = threading.RLock()
        self._resources: dict[str, None] = {}  # insertion-ordered set
        self._intervals: dict[str, list[BusyInterval]] = {}
        self._open: dict[int, BusyInterval] = {}  # busy() blocks still running; end is unused
        self._open_ids = itertools.count()
        self._events: list[PointEvent] = []
        self._gauges: list[Sample] = []
        self._counters: list[Sample] = []

    # ------------------------------------------------------------------ recording

    def now(self) -> float:
        """Seconds since this timeline was created."""
        return self._clock() - self._origin

    def declare(self, *resources: str) -> None:
        """Register resources up front so that idle ones count (as 0) in pooled utilization."""
        with self._lock:
            for resource in resources:
                _check_resource(resource)
                self._resources.setdefault(resource, None)

    @contextlib.contextmanager
    def busy(self, resource: str, kind: str = "busy", agent: str | None = None) -> Iterator[None]:
        """Record `resource` as busy for the duration of the `with` block.

        Block on asynchronous work (`jax.block_until_ready`) inside the block, or the interval measures
        dispatch instead of compute. The interval is recorded even if the block raises.
        """
        _check_resource(resource)
        start = self.now()
        with self._lock:
            self._resources.setdefault(resource, None)
            token = next(self._open_ids)
            self._open[token] = BusyInterval(resource, start, start, kind, agent)
        try:
            yield
        finally:
            end = self.now()
            with self._lock:
                del self._open[token]
                self._intervals.setdefault(resource, []).append(
                    BusyInterval(resource, start, end, kind, agent)
                )

    def add_interval(
        self, resource: str, start: float, end: float, kind: str = "busy", agent: str | None = None
    ) -> BusyInterval:
        """Record a busy interval with explicit times (seconds on this timeline)."""
        _check_resource(resource)
        if not end >= start:
            raise ValueError(
                f"busy interval on {resource!r} has end={end} before start={start}; need end >= start"
            )
        interval = BusyInterval(resource, float(start), float(end), kind, agent)
        with self._lock:
            self._resources.setdefault(resource, None)
            self._intervals.setdefault(resource, []).append(interval)
        return interval

    def event(
        self,
        name: str,
        *,
        agent: str | None = None,
        resource: str | None = None,
        time: float | None = None,
        **attrs: Any,
    ) -> PointEvent:
        """Record a point event; `attrs` must be JSON-serialisable (numpy scalars are fine)."""
        event = PointEvent(self._time_or_now(time), name, agent, resource, to_jsonable(attrs))
        with self._lock:
            self._events.append(event)
        return event

    def record_migration(
        self, resource: str, from_agent: str, to_agent: str, *, time: float | None = None
    ) -> PointEvent:
        """Instance `resource` moved from serving `from_agent` to serving `to_agent`."""
        return self.event(
            MIGRATION, agent=to_agent, resource=resource, time=time, from_agent=from_agent, to_agent=to_agent
        )

    def record_policy_version(self, agent: str, version: int, *, time: float | None = None) -> PointEvent:
        """`agent`'s policy is now at `version`."""
        return self.event(POLICY_VERSION, agent=agent, time=time, version=int(version))

    def record_iteration(self, iteration: int, start: float, end: float) -> PointEvent:
        """Iteration `iteration` ran from `start` to `end` (what the plots cut a run into)."""
        return self.event(ITERATION_SPAN, time=start, iteration=int(iteration), end=float(end))

    def sample(self, series: str, key: str, value: float, *, time: float | None = None) -> None:
        """Record a gauge value, e.g. `sample(QUEUE_LENGTH, "solver", 7)`."""
        self._append_sample(self._gauges, series, key, value, time)

    def increment(self, series: str, key: str, amount: float = 1.0, *, time: float | None = None) -> None:
        """Add `amount` to a counter, e.g. `increment(GENERATED_TOKENS, "solver", 128)`."""
        self._append_sample(self._counters, series, key, amount, time)

    # ------------------------------------------------------------------ reading

    @property
    def resources(self) -> list[str]:
        """All declared or used resources, in first-seen order."""
        with self._lock:
            return list(self._resources)

    def groups(self) -> list[str]:
        """Resource groups in first-seen order (e.g. `["rollout", "train"]`)."""
        return list(dict.fromkeys(resource_group(resource) for resource in self.resources))

    def intervals(self, resource: str | None = None, *, include_open: bool = False,
                  overlapping: tuple[float, float] | None = None) -> list[BusyInterval]:
        """Finished busy intervals (of one resource, or all), sorted by start.

        With `include_open`, blocks still inside `busy()` are included as ending now. With `overlapping`
        (t0, t1), only intervals that overlap that window (a run's history need not be sorted per iteration).
        """
        with self._lock:
            if resource is None:
                found = [interval for group in self._intervals.values() for interval in group]
            else:
                found = list(self._intervals.get(resource, ()))
            if include_open:
                now = self.now()
                found += [
                    dataclasses.replace(interval, end=max(now, interval.start))
                    for interval in self._open.values()
                    if resource is None or interval.resource == resource
                ]
        if overlapping is not None:
            t0, t1 = overlapping
            found = [interval for interval in found if interval.end >= t0 and interval.start <= t1]
        return sorted(found, key=lambda interval: (interval.start, interval.resource))

    def events(self, name: str | None = None) -> list[PointEvent]:
        """Point events (all, or those called `name`), sorted by time."""
        with self._lock:
            found = [event for event in self._events if name is None or event.name == name]
        return sorted(found, key=lambda event: event.time)

    def gauge(self, series: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """`{key: (times [n], values [n])}` of a gauge series, each sorted by time."""
        with self._lock:
            samples = [sample for sample in self._gauges if sample.series == series]
        return _by_key(samples, cumulative=False)

    def counter(self, series: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """`{key: (times [n], running totals [n])}` of a counter series, each sorted by time."""
        with self._lock:
            samples = [sample for sample in self._counters if sample.series == series]
        return _by_key(samples, cumulative=True)

    def counter_total(
        self, series: str, key: str | None = None, t0: float | None = None, t1: float | None = None
    ) -> float:
        """Sum of a counter's increments with time in [t0, t1] (all keys when `key` is None)."""
        low = -np.inf if t0 is None else t0
        high = np.inf if t1 is None else t1
        with self._lock:
            return float(
                sum(
                    sample.value
                    for sample in self._counters
                    if sample.series == series
                    and (key is None or sample.key == key)
                    and low <= sample.time <= high
                )
            )

    def counter_keys(self, series: str) -> list[str]:
        """Keys of a counter series in first-seen order."""
        with self._lock:
            return list(dict.fromkeys(sample.key for sample in self._counters if sample.series == series))

    def start_time(self) -> float:
        """The earliest recorded time (interval start, event or sample); 0.0 for an empty timeline."""
        with self._lock:
            times = [interval.start for group in self._intervals.values() for interval in group]
            times += [interval.start for interval in self._open.values()]
            times += [event.time for event in self._events]
            times += [sample.time for sample in itertools.chain(self._gauges, self._counters)]
        return min(times, default=0.0)

    def end_time(self) -> float:
        """The latest recorded time (interval end, event or sample); now() while a busy() block is open."""
        with self._lock:
            times = [interval.end for group in self._intervals.values() for interval in group]
            times += [event.time for event in self._events]
            times += [sample.time for sample in itertools.chain(self._gauges, self._counters)]
            if self._open:
                times.append(self.now())
        return max(times, default=0.0)

    # ------------------------------------------------------------------ persistence

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready snapshot (finished intervals only; open busy() blocks are still running)."""
        with self._lock:
            return {
                "format": _FORMAT,
                "version": _FORMAT_VERSION,
                "origin_unix": self.origin_unix,
                "resources": list(self._resources),
                "interval_fields": ["resource", "start", "end", "kind", "agent"],
                "intervals": [
                    [i.resource, _round(i.start), _round(i.end), i.kind, i.agent] for i in self.intervals()
                ],
                "events": [
                    {
                        "time": _round(e.time),
                        "name": e.name,
                        "agent": e.agent,
                        "resource": e.resource,
                        "attrs": dict(e.attrs),
                    }
                    for e in self.events()
                ],
                "sample_fields": ["series", "key", "time", "value"],
                "gauges": [[s.series, s.key, _round(s.time), s.value] for s in self._gauges],
                "counters": [[s.series, s.key, _round(s.time), s.value] for s in self._counters],
            }

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], clock: Callable[[], float] = time_module.perf_counter
    ) -> Timeline:
        """Rebuild a timeline from `to_dict()` output; its clock keeps running from the last recorded time."""
        if data.get("format") != _FORMAT or data.get("version") != _FORMAT_VERSION:
            raise ValueError(
                f"not a flexmarl timeline: format={data.get('format')!r} version={data.get('version')!r}; "
                f"expected format={_FORMAT!r} version={_FORMAT_VERSION}"
            )
        timeline = cls(clock)
        timeline.origin_unix = float(data["origin_unix"])
        timeline.declare(*data["resources"])
        for resource, start, end, kind, agent in data["intervals"]:
            timeline.add_interval(resource, start, end, kind, agent)
        for event in data["events"]:
            timeline._events.append(
                PointEvent(event["time"], event["name"], event["agent"], event["resource"], event["attrs"])
            )
        for target, rows in ((timeline._gauges, data["gauges"]), (timeline._counters, data["counters"])):
            target.extend(Sample(time, series, key, value) for series, key, time, value in rows)
        # Continue the clock after the loaded data, so that new records never precede old ones.
        timeline._origin -= timeline.end_time()
        return timeline

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the timeline as JSON (a directory gets `timeline.json`); atomic: tmp file + rename."""
        path = workdir_paths.path(path)
        if path.is_dir():
            path = path / TIMELINE_FILENAME
        workdir_paths.write_atomically(path, json.dumps(self.to_dict(), separators=(",", ":")))
        return path

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], clock: Callable[[], float] = time_module.perf_counter
    ) -> Timeline:
        """Read a timeline written by `save` (a file, or a workdir holding `timeline.json`).

        A resumed run loads its old timeline and keeps recording: new times continue after the old ones.
        """
        path = workdir_paths.path(path)
        if path.is_dir():
            path = path / TIMELINE_FILENAME
        return cls.from_dict(json.loads(path.read_text()), clock)

    # ------------------------------------------------------------------ helpers

    def _time_or_now(self, time: float | None) -> float:
        return self.now() if time is None else float(time)

    def _append_sample(self, target: list[Sample], series: str, key: str, value: float, time: float | None):
        sample = Sample(self._time_or_now(time), series, str(key), float(to_jsonable(value)))
        with self._lock:
            target.append(sample)


def _check_resource(resource: str) -> None:
    if not isinstance(resource, str) or not resource or resource.startswith("/"):
        raise ValueError(
            f"resource name {resource!r} is not allowed; use '<group>/<name>', "
            "e.g. 'rollout/instance0' or 'train/slice1'"
        )


def _round(seconds: float) -> float:
    return round(seconds, 6)


def _by_key(samples: list[Sample], *, cumulative: bool) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    grouped: dict[str, list[Sample]] = {}
    for sample in samples:
        grouped.setdefault(sample.key, []).append(sample)
    result = {}
    for key, rows in grouped.items():
        rows.sort(key=lambda sample: sample.time)
        times = np.array([sample.time for sample in rows], dtype=np.float64)
        values = np.array([sample.value for sample in rows], dtype=np.float64)
        result[key] = (times, np.cumsum(values) if cumulative else values)
    return result
