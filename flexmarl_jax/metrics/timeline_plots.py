"""Plots of a `Timeline`: a Gantt chart of resource activity (a window of the last iterations, with each mesh's
utilization over the whole run beneath it) and per-agent rollout load over time."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from matplotlib import colormaps, rc_context
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from flexmarl_jax.metrics.iteration_windows import (
    DEFAULT_GANTT_ITERATIONS,
    iteration_spans,
    last_iterations_window,
    utilization_per_window,
)
from flexmarl_jax.metrics.plot_style import (
    STYLE,
    PathLike,
    agent_colors,
    draw_no_data,
    ensure_dir,
    kind_color,
    save_figure,
)
from flexmarl_jax.metrics.timeline import Timeline
from flexmarl_jax.metrics.timeline_records import (
    INSTANCES,
    KNOWN_KINDS,
    MIGRATION,
    POLICY_VERSION,
    QUEUE_LENGTH,
    REQUESTS,
    resource_group,
)

# --------------------------------------------------------------------------- Gantt chart


def plot_gantt(
    timeline: Timeline | PathLike,
    out_dir: PathLike,
    *,
    color_by: str = "agent",
    t0: float | None = None,
    t1: float | None = None,
    iterations: int | None = None,
    filename: str = "gantt.png",
) -> list[Path]:
    """Writes `gantt_figure(...)` to `out_dir/filename`; returns [its path]."""
    timeline = _as_timeline(timeline)
    out_dir = ensure_dir(out_dir)
    figure = gantt_figure(timeline, color_by=color_by, t0=t0, t1=t1, iterations=iterations)
    return [save_figure(figure, out_dir / filename)]


def gantt_figure(
    timeline: Timeline,
    *,
    color_by: str = "agent",
    t0: float | None = None,
    t1: float | None = None,
    iterations: int | None = None,
) -> Figure:
    """Two panels: busy intervals per resource over a window (top), and each mesh's utilization per
    iteration over the whole run (bottom, the window shaded).

    The window: [t0, t1] when either is given; otherwise the last `iterations` iterations (None: the default,
    `DEFAULT_GANTT_ITERATIONS`; 0: the whole run), or the whole run when the timeline records no iterations.
    Top: rows grouped rollout, then train, ...; bars coloured by `color_by` ("agent" or "kind"); with "agent"
    a thin strip under each bar shows the kind (prefill/decode/train/sync/swap). Migrations are triangles on
    the moved instance's row; policy version changes are dashed vertical lines labelled with the new version.
    """
    if color_by not in ("agent", "kind"):
        raise ValueError(f"color_by={color_by!r} is not allowed; use 'agent' or 'kind'")
    spans = iteration_spans(timeline)
    k = DEFAULT_GANTT_ITERATIONS if iterations is None else iterations
    window = None if t0 is not None or t1 is not None else last_iterations_window(timeline, k)
    low, high = window if window is not None else _plot_window(timeline, t0, t1)
    shown = [span for span in spans if span.start >= low and span.end <= high]
    resources = sorted(timeline.resources, key=_resource_order(timeline))
    with rc_context(STYLE):
        height = min(1.8 + 0.42 * max(len(resources), 1), 14)
        figure = Figure(figsize=(13, height + 3.4), layout="constrained")
        gantt_axes, usage_axes = figure.subplots(2, 1, height_ratios=[height, 3.4])
        _draw_gantt(gantt_axes, timeline, resources, color_by, low, high)
        title = "Resource activity"
        if shown and window is not None:
            first, last = shown[0].iteration, shown[-1].iteration
            which = f"iteration {first}" if first == last else f"iterations {first}-{last}"
            title += f", the last {len(shown)} of {len(spans)} iterations ({which})"
        if resources:
            pooled = ", ".join(f"{g} {timeline.group_utilization(g, low, high):.0%}" for g in timeline.groups())
            title += f"; utilization over [{low:.4g}, {high:.4g}] s: {pooled}"
        gantt_axes.set_title(title)
        _draw_utilization_over_run(usage_axes, timeline, spans, shown, (low, high), color_by)
        return figure


def _resource_order(timeline: Timeline):
    """Rows grouped rollout, then train, then any other group; instances in natural order within a group."""
    group_order = {group: index for index, group in enumerate(["rollout", "train", *timeline.groups()])}
    return lambda resource: (group_order[resource_group(resource)], _natural_key(resource))


def _draw_gantt(axes, timeline: Timeline, resources: list[str], color_by: str, low: float, high: float) -> None:
    intervals = [i for i in timeline.intervals() if i.end >= low and i.start <= high]
    row_of = {resource: index for index, resource in enumerate(resources)}
    agents = sorted({i.agent for i in intervals if i.agent is not None})
    colors = agent_colors(_timeline_agents(timeline))
    kinds = list(
        dict.fromkeys(
            [k for k in KNOWN_KINDS if any(i.kind == k for i in intervals)] + [i.kind for i in intervals]
        )
    )
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    strips: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for interval in intervals:
        row = row_of[interval.resource]
        main = interval.kind if color_by == "kind" else (interval.agent or "(none)")
        bars.setdefault((row, main), []).append((interval.start, interval.duration))
        if color_by == "agent":
            strips.setdefault((row, interval.kind), []).append((interval.start, interval.duration))
    for (row, name), spans in bars.items():
        color = kind_color(name) if color_by == "kind" else colors.get(name, "#737373")
        axes.broken_barh(spans, (row - 0.36, 0.62), facecolors=color, edgecolor="none")
    for (row, kind), spans in strips.items():
        axes.broken_barh(spans, (row + 0.28, 0.14), facecolors=kind_color(kind, strip=True), edgecolor="none")

    legend = []
    if color_by == "agent":
        legend += [Patch(color=colors[a], label=f"agent {a}") for a in agents]
        if any(i.agent is None for i in intervals):
            legend.append(Patch(color="#737373", label="no agent"))
        legend += [Patch(color=kind_color(k, strip=True), label=f"strip: {k}") for k in kinds]
    else:
        legend += [Patch(color=kind_color(k), label=k) for k in kinds]
    palette = colors if color_by == "agent" else None
    legend += _draw_gantt_events(axes, timeline, row_of, palette, low, high)

    for index in range(1, len(resources)):  # a rule between groups (rollout | train)
        if resource_group(resources[index]) != resource_group(resources[index - 1]):
            axes.axhline(index - 0.5, color="#525252", linewidth=1.0)
    axes.set_yticks(range(len(resources)), resources)
    axes.set_ylim(len(resources) - 0.5, -0.9)  # first resource on top; room for version labels
    axes.grid(axis="y", visible=False)
    axes.set_xlim(low, high)
    axes.set_xlabel("time (s)")
    if legend:
        axes.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if not intervals:
        draw_no_data(axes)


# More meshes than this get one line per (group, agent) instead of one each: 60 instance lines are a blur.
MAX_MESH_LINES = 12
_GROUP_LINESTYLES = {"rollout": "-", "train": "--"}
_TIME_BINS = 40  # the bottom panel's bins when the timeline records no iterations


def _draw_utilization_over_run(axes, timeline: Timeline, spans, shown, window, color_by: str) -> None:
    """Each mesh's busy fraction per iteration (or per time bin) over the whole run, the pooled group
    utilization as thick lines, and the top panel's window shaded."""
    if spans:
        windows = [(span.start, span.end) for span in spans]
        x = np.array([span.iteration for span in spans], dtype=float)
        axes.set_xlabel("iteration")
    else:
        start, end = _plot_window(timeline, None, None)
        edges = np.linspace(start, end, _TIME_BINS + 1)
        windows = list(zip(edges[:-1], edges[1:], strict=True))
        x = (edges[:-1] + edges[1:]) / 2
        axes.set_xlabel("time (s)")
    usage = utilization_per_window(timeline, windows)
    resources = sorted(usage, key=_resource_order(timeline))
    dominant = _dominant_agents(timeline)
    colors = agent_colors(_timeline_agents(timeline))
    marker = "o" if len(x) <= 40 else None
    if len(resources) <= MAX_MESH_LINES:
        lines = {resource: (usage[resource], resource) for resource in resources}
    else:
        members: dict[tuple[str, str], list[str]] = {}
        for resource in resources:
            members.setdefault((resource_group(resource), dominant.get(resource) or "(none)"), []).append(resource)
        lines = {f"{group}/{agent}": (np.mean([usage[r] for r in names], axis=0),
                                      f"{group} meshes of {agent} ({len(names)}, mean)")
                 for (group, agent), names in members.items()}
    # Each line in its agent's colour (dashed for training) unless two lines would look alike: then tab20.
    palette = [colors.get(dominant.get(name) or name.split("/")[-1], "#737373") for name in lines]
    looks = {(color, resource_group(name)) for color, name in zip(palette, lines, strict=True)}
    if color_by == "kind" or len(looks) < len(lines):
        palette = [colormaps["tab20"](index % 20) for index in range(len(lines))]
    for (name, (values, label)), color in zip(lines.items(), palette, strict=True):
        axes.plot(x, values, marker=marker, markersize=3, linewidth=1.2, color=color,
                  linestyle=_GROUP_LINESTYLES.get(resource_group(name), ":"), label=label)
    for group in timeline.groups():
        members = [usage[r] for r in resources if resource_group(r) == group]
        if len(members) > 1:
            axes.plot(x, np.mean(members, axis=0), color="black", linewidth=2.6, alpha=0.75,
                      linestyle=_GROUP_LINESTYLES.get(group, ":"), label=f"{group}: all meshes (mean)")
    if shown and len(shown) < len(spans):
        axes.axvspan(shown[0].iteration - 0.5, shown[-1].iteration + 0.5, color="#fee391", alpha=0.5,
                     zorder=0, label="Gantt window above")
    elif not spans and window != _plot_window(timeline, None, None):
        axes.axvspan(*window, color="#fee391", alpha=0.5, zorder=0, label="Gantt window above")
    if spans:
        axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set_ylim(0, 1.02)
    axes.set_ylabel("busy fraction")
    axes.set_title("Utilization per mesh over the whole run" + (", per iteration" if spans else ""))
    if resources:
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), ncols=2 if len(lines) > 10 else 1)
    else:
        draw_no_data(axes)


def _dominant_agents(timeline: Timeline) -> dict[str, str | None]:
    """The agent each resource was busy for longest (instances migrate; the label follows most of the work)."""
    seconds: dict[str, dict[str | None, float]] = {}
    for interval in timeline.intervals():
        per_agent = seconds.setdefault(interval.resource, {})
        per_agent[interval.agent] = per_agent.get(interval.agent, 0.0) + interval.duration
    return {resource: max(per_agent, key=per_agent.get) for resource, per_agent in seconds.items()}


def _draw_gantt_events(axes, timeline: Timeline, row_of: dict[str, int], agent_palette, low, high) -> list:
    """Migration triangles (filled with the receiving agent's colour when `agent_palette` is given) and
    one dashed line per policy-version update instant; returns legend handles."""
    legend = []
    migrations = [e for e in timeline.events(MIGRATION) if low <= e.time <= high and e.resource in row_of]
    if migrations:
        axes.scatter(
            [e.time for e in migrations],
            [row_of[e.resource] - 0.36 for e in migrations],
            marker="v",
            s=60,
            color=[(agent_palette or {}).get(e.agent, "black") for e in migrations],
            edgecolors="black",
            linewidths=0.8,
            zorder=5,
        )
        label = "migration (receiving agent's colour)" if agent_palette else "migration"
        legend.append(
            Line2D(
                [],
                [],
                marker="v",
                linestyle="none",
                markerfacecolor="white" if agent_palette else "black",
                markeredgecolor="black",
                markersize=8,
                label=label,
            )
        )
    versions = [e for e in timeline.events(POLICY_VERSION) if low <= e.time <= high]
    last_line = last_label = None
    for event in versions:
        # All agents usually update together; draw one line per instant, not one per agent.
        if last_line is not None and event.time - last_line < 1e-3:
            continue
        last_line = event.time
        axes.axvline(event.time, color="#525252", linestyle="--", linewidth=0.9, zorder=4)
        if last_label is not None and event.time - last_label < 0.03 * (high - low):
            continue  # labels this close would overprint each other
        last_label = event.time
        axes.text(
            event.time,
            -0.55,
            f" v{event.attrs.get('version', '?')} ",
            fontsize=7,
            color="#252525",
            va="center",
            ha="right" if event.time > low + 0.95 * (high - low) else "left",  # stay inside the axes
        )
    if versions:
        legend.append(Line2D([], [], color="#525252", linestyle="--", label="policy version update"))
    return legend


# --------------------------------------------------------------------------- per-agent load


def plot_load(timeline: Timeline | PathLike, out_dir: PathLike, *, filename: str = "load.png") -> list[Path]:
    """Per-agent load, like the FlexMARL paper's Figs. 8-9: request share, queue lengths and instances
    per agent over time (with migrations marked)."""
    timeline = _as_timeline(timeline)
    out_dir = ensure_dir(out_dir)
    requests = timeline.counter(REQUESTS)
    queues = timeline.gauge(QUEUE_LENGTH)
    instances = timeline.gauge(INSTANCES)
    colors = agent_colors(_timeline_agents(timeline))
    start, end = _plot_window(timeline, None, None)

    with rc_context(STYLE):
        figure = Figure(figsize=(13, 10), layout="constrained")
        grid = figure.add_gridspec(3, 3)
        share_axes = figure.add_subplot(grid[0, 0])
        cumulative_axes = figure.add_subplot(grid[0, 1:])
        queue_axes = figure.add_subplot(grid[1, :])
        instance_axes = figure.add_subplot(grid[2, :], sharex=queue_axes)

        totals = {agent: float(values[-1]) for agent, (_, values) in sorted(requests.items())}
        if totals:
            names = list(totals)
            heights = np.array([totals[name] for name in names])
            bars = share_axes.bar(names, heights, color=[colors[n] for n in names])
            share = heights / max(heights.sum(), 1e-12)
            share_axes.bar_label(bars, labels=[f"{s:.0%}" for s in share], fontsize=8, padding=2)
            share_axes.set_ylim(0, heights.max() * 1.18 if heights.max() > 0 else 1)
            share_axes.tick_params(axis="x", rotation=30 if len(names) > 4 else 0)
        else:
            draw_no_data(share_axes)
        share_axes.set_title("Requests per agent")
        share_axes.set_ylabel("requests")
        share_axes.grid(axis="x", visible=False)

        for axes, series, linewidth, title, ylabel in (
            (cumulative_axes, requests, 1.6, "Cumulative requests", "requests"),
            (queue_axes, queues, 1.4, "Queue length per agent", "waiting requests"),
        ):
            for agent, (times, values) in sorted(series.items()):
                axes.step(np.append(times, end), np.append(values, values[-1]), where="post",
                          color=colors[agent], linewidth=linewidth, label=agent)
            _finish_time_axes(axes, title, ylabel, bool(series), start, end)

        if instances:
            grid_times, stacked = _forward_filled(instances, end)
            names = sorted(instances)
            instance_axes.stackplot(
                grid_times,
                [stacked[n] for n in names],
                step="post",
                alpha=0.85,
                colors=[colors[n] for n in names],
                labels=names,
            )
            instance_axes.yaxis.get_major_locator().set_params(integer=True)
        migrations = timeline.events(MIGRATION)
        for event in migrations:
            instance_axes.axvline(event.time, color="black", linestyle=":", linewidth=0.9)
        if migrations:
            instance_axes.plot([], [], color="black", linestyle=":", label=f"migration ({len(migrations)})")
        _finish_time_axes(
            instance_axes, "Rollout instances per agent (stacked)", "instances", bool(instances), start, end
        )
        instance_axes.set_xlabel("time (s)")
        figure.suptitle("Per-agent rollout load", fontweight="bold")
        return [save_figure(figure, out_dir / filename)]


def _forward_filled(series: dict[str, tuple[np.ndarray, np.ndarray]], end: float):
    """Put gauges on one time grid, each holding its last value (0 before its first sample)."""
    grid = np.unique(np.concatenate([times for times, _ in series.values()] + [np.array([end])]))
    filled = {}
    for name, (times, values) in series.items():
        index = np.searchsorted(times, grid, side="right") - 1
        filled[name] = np.where(index >= 0, values[np.clip(index, 0, None)], 0.0)
    return grid, filled


def _finish_time_axes(axes, title: str, ylabel: str, has_data: bool, start: float, end: float) -> None:
    axes.set_title(title)
    axes.set_ylabel(ylabel)
    axes.set_xlim(start, end)
    axes.set_ylim(bottom=0)
    if not has_data:
        draw_no_data(axes)
    elif axes.get_legend_handles_labels()[0]:
        axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _as_timeline(timeline: Timeline | PathLike) -> Timeline:
    return timeline if isinstance(timeline, Timeline) else Timeline.load(timeline)


def _plot_window(timeline: Timeline, t0: float | None, t1: float | None) -> tuple[float, float]:
    """[t0, t1], defaulting to the recorded span (not time 0: start-up before the first record is empty)."""
    low = timeline.start_time() if t0 is None else t0
    high = timeline.end_time() if t1 is None else t1
    return low, high if high > low else low + 1.0


def _timeline_agents(timeline: Timeline) -> set[str]:
    """Every agent named anywhere in the timeline, so that the Gantt and load plots colour alike."""
    agents = {interval.agent for interval in timeline.intervals() if interval.agent is not None}
    agents |= {event.agent for event in timeline.events() if event.agent is not None}
    for series in (REQUESTS, QUEUE_LENGTH, INSTANCES):
        agents |= set(timeline.counter(series)) | set(timeline.gauge(series))
    return agents


def _natural_key(name: str) -> list:
    """`rollout/a/10` sorts after `rollout/a/9`."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
