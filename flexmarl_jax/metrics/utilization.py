"""Accounting over a recorded timeline: busy seconds, utilization, the wall-time split and counter rates.

Utilization of a resource over a window [t0, t1] is the length of the union of its busy intervals clipped
to the window, divided by t1 - t0 (overlapping intervals on one resource count once). A group's pooled
utilization is the mean over the group's resources (= busy resource-seconds / (resources x wall time)),
so an idle resource that was `declare`d counts as 0 and pulls the pool down, as idle hardware should.

This is a mixin of `Timeline` (timeline.py) rather than part of it: it only derives figures from what the
recorder exposes (`intervals`, `resources`, `groups`, `end_time`, `counter_total`), so recording (and its
locking) stays in one place and the arithmetic in another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flexmarl_jax.metrics.timeline_records import BusyInterval, resource_group

# Priority order for `Timeline.time_split`: which activity an instant of wall time is charged to.
DEFAULT_TIME_SPLIT: Mapping[str, Callable[[BusyInterval], bool]] = {
    "sync_s": lambda interval: interval.kind == "sync",
    "rollout_s": lambda interval: interval.group == "rollout",
    "train_s": lambda interval: interval.group == "train",
}


def union_length(intervals: Iterable[tuple[float, float]], t0: float, t1: float) -> float:
    """Length of the union of `(start, end)` intervals after clipping each to [t0, t1]."""
    clipped = sorted((max(start, t0), min(end, t1)) for start, end in intervals)
    total = 0.0
    current_start = current_end = None
    for start, end in clipped:
        if end <= start:
            continue
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


class TimelineAccounting:
    """Utilization and time accounting for `Timeline` (see the module docstring for the definitions).

    Reads only through the recorder's public queries: `intervals`, `resources`, `groups`, `end_time` and
    `counter_total`. A window defaults to [0, end_time()]; an empty one (t1 <= t0) raises ValueError.
    """

    def busy_seconds(self, resource: str, t0: float | None = None, t1: float | None = None) -> float:
        """Seconds in [t0, t1] during which `resource` was busy (overlaps counted once; open blocks count)."""
        t0, t1 = self._window(t0, t1)
        spans = [(interval.start, interval.end)
                 for interval in self.intervals(resource, include_open=True, overlapping=(t0, t1))]
        return union_length(spans, t0, t1)

    def utilization(self, resource: str, t0: float | None = None, t1: float | None = None) -> float:
        """Busy fraction of `resource` over [t0, t1] (default: [0, end_time()]); in [0, 1]."""
        t0, t1 = self._window(t0, t1)
        return self.busy_seconds(resource, t0, t1) / (t1 - t0)

    def group_utilization(self, group: str, t0: float | None = None, t1: float | None = None) -> float:
        """Pooled utilization of a group: mean busy fraction over its resources; 0.0 if it has none."""
        t0, t1 = self._window(t0, t1)
        members = [resource for resource in self.resources if resource_group(resource) == group]
        if not members:
            return 0.0
        return sum(self.utilization(resource, t0, t1) for resource in members) / len(members)

    def utilization_report(self, t0: float | None = None, t1: float | None = None) -> dict[str, Any]:
        """Utilization over [t0, t1] for the metrics record.

        Returns `{<group>: pooled fraction for each group, "all": pooled over every resource,
        "resources": {resource: fraction}}`, e.g. `{"rollout": 0.62, "train": 0.31, "all": 0.5, ...}`.
        """
        t0, t1 = self._window(t0, t1)
        per_resource = {resource: self.utilization(resource, t0, t1) for resource in self.resources}
        report: dict[str, Any] = {}
        for group in self.groups():
            members = [value for resource, value in per_resource.items() if resource_group(resource) == group]
            report[group] = sum(members) / len(members)
        report["all"] = sum(per_resource.values()) / len(per_resource) if per_resource else 0.0
        report["resources"] = per_resource
        return report

    def iteration_timing(self, t0: float, t1: float, generated_tokens: int) -> dict[str, Any]:
        """The wall-clock fields of an iteration's metrics record over [t0, t1]: `e2e_s`, its split
        (`rollout_s`, `train_s`, `sync_s`, `other_s`), `tokens_per_s` and `utilization`."""
        return {"e2e_s": t1 - t0, **self.time_split(t0, t1),
                "tokens_per_s": generated_tokens / max(t1 - t0, 1e-9),
                "utilization": self.utilization_report(t0, t1)}

    def time_split(
        self,
        t0: float,
        t1: float,
        categories: Mapping[str, Callable[[BusyInterval], bool]] | None = None,
    ) -> dict[str, float]:
        """Split the wall time [t0, t1] into categories that sum exactly to t1 - t0.

        Each instant goes to the first category (in `categories` order) with a matching interval active
        then; instants with none go to `other_s`. The default order is `DEFAULT_TIME_SPLIT`: weight sync,
        then rollout, then training, so `train_s` is the training time *not* hidden behind rollout (the part
        that lengthens an iteration) and `rollout_s + train_s + sync_s + other_s == e2e_s`.
        """
        t0, t1 = self._window(t0, t1)
        categories = DEFAULT_TIME_SPLIT if categories is None else categories
        intervals = self.intervals(include_open=True, overlapping=(t0, t1))
        split: dict[str, float] = {}
        covered: list[tuple[float, float]] = []
        covered_length = 0.0
        for name, matches in categories.items():
            covered += [(i.start, i.end) for i in intervals if matches(i)]
            now_covered = union_length(covered, t0, t1)
            split[name] = now_covered - covered_length
            covered_length = now_covered
        split["other_s"] = (t1 - t0) - covered_length
        return split

    def counter_rate(self, series: str, t0: float, t1: float, key: str | None = None) -> float:
        """Counter increase per second over [t0, t1], e.g. generated tokens/s."""
        t0, t1 = self._window(t0, t1)
        return self.counter_total(series, key, t0, t1) / (t1 - t0)

    def _window(self, t0: float | None, t1: float | None) -> tuple[float, float]:
        t0 = 0.0 if t0 is None else float(t0)
        t1 = self.end_time() if t1 is None else float(t1)
        if not t1 > t0:
            raise ValueError(f"utilization window [t0={t0}, t1={t1}] is empty; need t1 > t0")
        return t0, t1
