"""A run's timeline cut into its iterations: where each iteration starts and ends, the window of the last k
of them that the Gantt chart draws, and each resource's busy fraction per iteration.

Iterations are read from the `ITERATION_SPAN` events the orchestrator records (one per iteration, at its start,
with its `end`). A timeline written before those events existed falls back on the policy-version updates:
every distinct update instant closes one iteration and opens the next. A timeline with neither has no
iterations; the plots then fall back on equal time bins.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from flexmarl_jax.metrics.timeline import Timeline
from flexmarl_jax.metrics.timeline_records import ITERATION_SPAN, POLICY_VERSION

# The Gantt chart's default window: enough iterations to see the pipeline's rhythm (rollout, the training
# that overlaps it, apply, sync, the next rollout) at a glance; a 200-iteration run drawn whole is a wall of
# dashes. `--gantt-iterations=0` draws the whole run.
DEFAULT_GANTT_ITERATIONS = 3
_SAME_INSTANT_S = 1e-3  # policy-version updates of all agents closer than this are one update


class IterationSpan(NamedTuple):
    iteration: int
    start: float
    end: float


def iteration_spans(timeline: Timeline) -> list[IterationSpan]:
    """Every iteration's [start, end] in iteration order (see the module docstring for the sources)."""
    recorded = {}
    for event in timeline.events(ITERATION_SPAN):
        iteration = int(event.attrs["iteration"])
        recorded[iteration] = IterationSpan(iteration, event.time, float(event.attrs["end"]))  # a redo wins
    if recorded:
        return [recorded[iteration] for iteration in sorted(recorded)]
    instants: list[tuple[float, int]] = []
    for event in timeline.events(POLICY_VERSION):
        if not instants or event.time - instants[-1][0] >= _SAME_INSTANT_S:
            instants.append((event.time, int(event.attrs.get("version", len(instants)))))
    return [IterationSpan(version, start, end)
            for (start, version), (end, _) in zip(instants, instants[1:], strict=False)]


def last_iterations_window(timeline: Timeline, k: int | None) -> tuple[float, float] | None:
    """[start of the k-th last iteration, end of the last one]; None when k is None or 0 (the whole run) or
    the timeline has no iterations. ValueError for k < 0."""
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
        raise ValueError(f"gantt iterations={k!r} must be an int >= 0 (0: the whole run)")
    spans = iteration_spans(timeline)
    if not k or not spans:
        return None
    window = spans[-k:]
    return window[0].start, window[-1].end


def busy_fractions(spans: Iterable[tuple[float, float]], windows: Sequence[tuple[float, float]]) -> list[float]:
    """Busy fraction of each window: the length of the union of the busy `spans` inside it / its length.

    One pass over the merged spans and a binary search per window, so a long run's thousands of intervals
    and hundreds of iterations cost milliseconds (0.0 for an empty window)."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    starts = [start for start, _ in merged]
    before = [0.0]  # busy seconds before each merged span starts
    for start, end in merged:
        before.append(before[-1] + end - start)

    def busy_until(t: float) -> float:
        index = bisect.bisect_right(starts, t)  # merged spans starting at or before t
        if index == 0:
            return 0.0
        start, end = merged[index - 1]
        return before[index - 1] + min(t, end) - start

    # Clamped: the difference of two running sums can stray past [0, 1] by a rounding error.
    return [min(1.0, max(0.0, (busy_until(t1) - busy_until(t0)) / (t1 - t0))) if t1 > t0 else 0.0
            for t0, t1 in windows]


def utilization_per_window(timeline: Timeline, windows: Sequence[tuple[float, float]]) -> dict[str, list[float]]:
    """{resource: its busy fraction in each window}, every declared or used resource (idle ones: zeros)."""
    by_resource: dict[str, list[tuple[float, float]]] = {resource: [] for resource in timeline.resources}
    for interval in timeline.intervals(include_open=True):
        by_resource.setdefault(interval.resource, []).append((interval.start, interval.end))
    return {resource: busy_fractions(spans, windows) for resource, spans in by_resource.items()}
