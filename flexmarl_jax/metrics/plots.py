"""PNG plots of a run: learning and held-out eval curves, time breakdown, a Gantt chart of resource activity,
per-agent load.

Every function takes data (records / a `Timeline`) or paths, writes PNGs into `out_dir` and returns the
paths it wrote. `plot_all(workdir)` replots a run from its `metrics.jsonl` and `timeline.json`.

Per-agent metrics are found under `agent/<name>/<metric>` (or `agents/...`) after flattening, i.e. either
`{"agent": {"solver": {"reward": 0.5}}}` or `{"agent/solver/reward": 0.5}` in a record.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import rc_context
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from flexmarl_jax import workdir_paths
from flexmarl_jax.metrics.iteration_windows import DEFAULT_GANTT_ITERATIONS
from flexmarl_jax.metrics.jsonable import flatten
from flexmarl_jax.metrics.plot_style import (
    STYLE,
    PathLike,
    agent_colors,
    draw_no_data,
    ensure_dir,
    kind_color,
    save_figure,
)
from flexmarl_jax.metrics.progress import print_summary
from flexmarl_jax.metrics.timeline import TIMELINE_FILENAME, Timeline
from flexmarl_jax.metrics.timeline_plots import plot_gantt, plot_load
from flexmarl_jax.metrics.writer import METRICS_FILENAME, eval_records, iteration_records, read_metrics

__all__ = ["agent_colors", "kind_color", "plot_all", "plot_curves", "plot_gantt", "plot_load"]

_AGENT_KEY = re.compile(r"^agents?/([^/]+)/(.+)$")
_TIME_PARTS = (
    ("rollout_s", "rollout", "#41ab5d"),
    ("train_s", "train", "#2171b5"),
    ("sync_s", "weight sync", "#fd8d3c"),
    ("other_s", "other", "#bdbdbd"),
)


def plot_curves(metrics: PathLike | Sequence[Mapping[str, Any]], out_dir: PathLike) -> list[Path]:
    """Reward/accuracy curves (team + per agent) beside the held-out eval curves, KL/clip/entropy per agent, and
    the E2E time split.

    Args:
      metrics: a `metrics.jsonl`, a workdir holding one, or the records themselves (training iterations and
        evaluations, `writer.iteration_records` / `writer.eval_records`).
      out_dir: where `curves.png`, `train_stats.png` and `time_breakdown.png` go (each only if it has data).

    The x axis is the iteration, i.e. the policy version: an eval at x evaluates the policies that generated
    training iteration x's rollouts.
    """
    records = read_metrics(metrics) if isinstance(metrics, (str, os.PathLike)) else list(metrics)
    out_dir = ensure_dir(out_dir)
    rows = sorted((flatten(record) for record in iteration_records(records)), key=lambda row: row.get("iteration", 0))
    evals = sorted((flatten(record) for record in eval_records(records)), key=lambda row: row.get("iteration", 0))
    if not rows and not evals:
        return []
    iterations = np.array([row.get("iteration", index) for index, row in enumerate(rows)], dtype=float)
    agents = sorted({match.group(1) for row in (*rows, *evals) for key in row if (match := _AGENT_KEY.match(key))})
    colors = agent_colors(agents)
    written = []

    panels = [("reward", "team_reward", "Reward"), ("accuracy", "team_accuracy", "Accuracy")]
    if evals or any(
        _series(rows, team) is not None or _agent_series(rows, agents, metric) for metric, team, _ in panels
    ):
        with rc_context(STYLE):
            figure = Figure(figsize=(18 if evals else 12, 4.2), layout="constrained")
            all_axes = figure.subplots(1, 3 if evals else 2)
            if evals:  # training and held-out accuracy on one scale, one iteration axis
                all_axes[2].sharex(all_axes[1])
                all_axes[2].sharey(all_axes[1])
            for axes, (metric, team_key, title) in zip(all_axes, panels, strict=False):
                _draw_metric(axes, iterations, rows, agents, colors, metric, team_key)
                axes.set_title(f"{title} per iteration" + (" (training rollouts)" if evals else ""))
                axes.set_xlabel("iteration")
                axes.set_ylabel(metric)
            if evals:
                _draw_eval(all_axes[2], evals, iterations, rows, agents, colors)
            figure.suptitle("Learning curves", fontweight="bold")
            written.append(save_figure(figure, out_dir / "curves.png"))

    stats = [
        (metric, title)
        for metric, title in (("kl", "KL divergence"), ("clip_frac", "Clip fraction"), ("entropy", "Entropy"))
        if _agent_series(rows, agents, metric)
    ]
    if stats:
        with rc_context(STYLE):
            figure = Figure(figsize=(4.2 * len(stats), 3.8), layout="constrained")
            for axes, (metric, title) in zip(
                np.atleast_1d(figure.subplots(1, len(stats))), stats, strict=True
            ):
                _draw_metric(axes, iterations, rows, agents, colors, metric, team_key=None)
                axes.set_title(title)
                axes.set_xlabel("iteration")
                axes.set_ylabel(metric)
            figure.suptitle("Policy statistics per agent", fontweight="bold")
            written.append(save_figure(figure, out_dir / "train_stats.png"))

    if any(_series(rows, key) is not None for key, _, _ in _TIME_PARTS):
        written.append(_plot_time_breakdown(iterations, rows, out_dir / "time_breakdown.png"))
    return written


def _draw_metric(axes, iterations, rows, agents, colors, metric: str, team_key: str | None) -> None:
    marker = "o" if len(iterations) <= 40 else None
    for agent, values in _agent_series(rows, agents, metric).items():
        axes.plot(
            iterations, values, marker=marker, markersize=3, linewidth=1.4, color=colors[agent], label=agent
        )
    team = _series(rows, team_key) if team_key else None
    if team is not None:
        axes.plot(iterations, team, marker=marker, markersize=4, linewidth=2.4, color="black", label="team")
    if axes.has_data():
        axes.legend(loc="best")
    else:
        draw_no_data(axes)
    axes.xaxis.get_major_locator().set_params(integer=True)


def _draw_eval(axes, evals: list[dict], iterations, rows: list[dict], agents, colors) -> None:
    """Held-out eval per evaluation: greedy team accuracy, pass@k and sampled accuracy, each agent's greedy
    accuracy, and the training rollouts' team accuracy for comparison."""
    steps = np.array([row.get("iteration", index) for index, row in enumerate(evals)], dtype=float)
    k = next((int(row["eval_k"]) for row in evals if isinstance(row.get("eval_k"), (int, float))), None)
    for agent, values in _agent_series(evals, agents, "eval_accuracy").items():
        axes.plot(steps, values, marker="o", markersize=3, linewidth=1.2, color=colors[agent], label=agent)
    for key, label, style in (("eval_pass_at_k", f"team pass@{k}", "--"),
                              ("eval_sampled_accuracy", "team sampled", ":"),
                              ("eval_team_accuracy", "team greedy", "-")):
        values = _series(evals, key)
        if values is not None:
            axes.plot(steps, values, style, marker="o", markersize=4, linewidth=2.4, color="black", label=label)
    train = _series(rows, "team_accuracy")
    if train is not None:
        axes.plot(iterations, train, linewidth=1.0, color="#969696", alpha=0.8, label="team (training rollouts)")
    axes.set_title("Held-out eval")
    axes.set_xlabel("iteration (policy version)")
    axes.set_ylabel("accuracy")
    if axes.has_data():
        axes.legend(loc="best")
    else:
        draw_no_data(axes)
    axes.xaxis.get_major_locator().set_params(integer=True)


def _plot_time_breakdown(iterations: np.ndarray, rows: list[dict], path: Path) -> Path:
    with rc_context(STYLE):
        figure = Figure(figsize=(12, 4), layout="constrained")
        axes = figure.subplots()
        bottom = np.zeros(len(rows))
        for key, label, color in _TIME_PARTS:
            values = _series(rows, key)
            if values is None:
                continue
            values = np.nan_to_num(values)
            axes.bar(iterations, values, bottom=bottom, color=color, label=label, width=0.8)
            bottom += values
        e2e = _series(rows, "e2e_s")
        if e2e is not None:
            axes.plot(iterations, e2e, "k_", markersize=14, markeredgewidth=2, label="E2E (wall)")
        axes.set_xlabel("iteration")
        axes.set_ylabel("seconds")
        axes.set_title("Time per iteration")
        axes.xaxis.get_major_locator().set_params(integer=True)
        handles, labels = axes.get_legend_handles_labels()
        tokens = _series(rows, "tokens_per_s")
        if tokens is not None:
            twin = axes.twinx()
            twin.plot(iterations, tokens, color="#d62728", marker="o", markersize=3, linewidth=1.5)
            twin.set_ylabel("generated tokens / s", color="#d62728")
            twin.set_ylim(bottom=0)
            twin.tick_params(axis="y", colors="#d62728")
            twin.grid(False)
            twin.spines["right"].set_visible(True)
            handles.append(Line2D([], [], color="#d62728", marker="o", markersize=3))
            labels.append("tokens/s")
        axes.legend(handles, labels, loc="upper left", ncols=len(labels), bbox_to_anchor=(0, -0.15))
        return save_figure(figure, path)


def _series(rows: list[dict], key: str) -> np.ndarray | None:
    """Values of `key` per row (NaN where missing), or None if no row has a number for it."""
    values = [row.get(key) for row in rows]
    if not any(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values):
        return None
    return np.array([value if isinstance(value, (int, float)) else np.nan for value in values], dtype=float)


def _agent_series(rows: list[dict], agents: list[str], metric: str) -> dict[str, np.ndarray]:
    found = {}
    for agent in agents:
        for prefix in ("agent", "agents"):
            values = _series(rows, f"{prefix}/{agent}/{metric}")
            if values is not None:
                found[agent] = values
                break
    return found


# --------------------------------------------------------------------------- everything for a workdir


def plot_all(
    workdir: PathLike, timeline: Timeline | None = None, out_dir: PathLike | None = None, *,
    gantt_iterations: int | None = None,
) -> list[Path]:
    """All plots of a run: curves from `workdir/metrics.jsonl`, Gantt and load from `timeline` (or
    `workdir/timeline.json`). Writes into `out_dir` (default `workdir/plots`); returns the PNG paths.

    gantt_iterations: the Gantt chart's window, the last k iterations (None: `DEFAULT_GANTT_ITERATIONS`;
    0: the whole run)."""
    target = workdir_paths.path(workdir, "plots") if out_dir is None else workdir_paths.path(out_dir)
    if workdir_paths.is_local(os.fspath(target)):
        return _plot_all_into(workdir, timeline, Path(target), gantt_iterations)
    # An object store (gs://): matplotlib writes local files, which are then copied up one by one.
    with tempfile.TemporaryDirectory(prefix="flexmarl-plots-") as local:
        drawn = _plot_all_into(workdir, timeline, Path(local), gantt_iterations)
        target.mkdir(parents=True, exist_ok=True)
        for png in drawn:
            (target / png.name).write_bytes(png.read_bytes())
        return [target / png.name for png in drawn]


def _plot_all_into(workdir: PathLike, timeline: Timeline | None, out_dir: Path,
                   gantt_iterations: int | None) -> list[Path]:
    written = plot_curves(read_metrics(workdir), out_dir)
    saved = workdir_paths.path(workdir, TIMELINE_FILENAME)
    if timeline is None and saved.exists():
        timeline = Timeline.load(saved)
    if timeline is not None:
        written += plot_gantt(timeline, out_dir, iterations=gantt_iterations)
        written += plot_load(timeline, out_dir)
    return written


def main(argv: list[str] | None = None) -> int:
    """Replot a run directory: `main(["runs/tiny"])` writes its PNGs and prints the summary table."""
    parser = argparse.ArgumentParser(description="Plot a flexmarl run from metrics.jsonl and timeline.json.")
    parser.add_argument("workdir", help="run directory holding metrics.jsonl (and timeline.json)")
    parser.add_argument("--out-dir", default=None, help="where the PNGs go (default: WORKDIR/plots)")
    parser.add_argument("--gantt-iterations", type=int, default=None, metavar="K",
                        help=f"the Gantt chart draws the last K iterations (default {DEFAULT_GANTT_ITERATIONS}; "
                             "0: the whole run)")
    args = parser.parse_args(argv)
    if args.gantt_iterations is not None and args.gantt_iterations < 0:
        parser.error(f"--gantt-iterations={args.gantt_iterations} must be >= 0 (0: the whole run)")
    workdir = Path(args.workdir)
    if not (workdir / METRICS_FILENAME).exists() and not (workdir / TIMELINE_FILENAME).exists():
        parser.error(f"workdir {str(workdir)!r} holds neither {METRICS_FILENAME} nor {TIMELINE_FILENAME}")
    written = plot_all(workdir, out_dir=args.out_dir, gantt_iterations=args.gantt_iterations)
    print_summary(read_metrics(workdir))
    for path in written:
        print(path)
    return 0
