"""The Gantt chart's window of the last k iterations and its per-iteration utilization panel, on a
hand-made timeline whose busy fractions are worked out below.

Five iterations, iteration i from 10i to 10i + 8 (2 s between iterations, as an eval would leave):
- rollout/inst0 is busy [10i, 10i + 4]: 4 of 8 s -> 0.5 in every iteration;
- rollout/inst1 is busy [10i + 1, 10i + 3] and [10i + 2, 10i + 4] (overlapping: their union is 3 s) -> 0.375,
  plus [37, 41] across the boundary of iterations 3 and 4: iteration 3 gets [37, 38] (3 + 1 = 4 s -> 0.5),
  iteration 4 gets [40, 41] ([40, 41] + [41, 44] = 4 s -> 0.5);
- train/solver trains [10i + 5, 10i + 5 + i/2] and syncs [10i + 7.5, 10i + 8]: (i/2 + 1/2) / 8 = 0.0625 (i + 1);
- train/idle is declared and never busy -> 0.
"""

from __future__ import annotations

import numpy as np
import pytest

from flexmarl_jax import metrics
from flexmarl_jax.metrics import plots
from flexmarl_jax.metrics.iteration_windows import (
    busy_fractions,
    iteration_spans,
    last_iterations_window,
    utilization_per_window,
)
from flexmarl_jax.metrics.timeline_plots import MAX_MESH_LINES, gantt_figure

INST0 = [0.5] * 5
INST1 = [0.375, 0.375, 0.375, 0.5, 0.5]
TRAIN = [0.0625 * (i + 1) for i in range(5)]
IDLE = [0.0] * 5


def hand_made_timeline() -> metrics.Timeline:
    timeline = metrics.Timeline()
    timeline.declare("rollout/inst0", "rollout/inst1", "train/solver", "train/idle")
    for i in range(5):
        start = 10.0 * i
        timeline.add_interval("rollout/inst0", start, start + 4, "decode", "solver")
        timeline.add_interval("rollout/inst1", start + 1, start + 3, "decode", "verifier")
        timeline.add_interval("rollout/inst1", start + 2, start + 4, "decode", "verifier")
        timeline.add_interval("train/solver", start + 5, start + 5 + i / 2, "train", "solver")
        timeline.add_interval("train/solver", start + 7.5, start + 8, "sync", "solver")
        timeline.record_policy_version("solver", i + 1, time=start + 8)
        timeline.record_iteration(i, start, start + 8)
    timeline.add_interval("rollout/inst1", 37, 41, "decode", "verifier")
    return timeline


def test_iterations_are_read_from_the_recorded_spans():
    spans = iteration_spans(hand_made_timeline())
    assert [(s.iteration, s.start, s.end) for s in spans] == [(i, 10.0 * i, 10.0 * i + 8) for i in range(5)]


def test_window_covers_exactly_the_last_k_iterations():
    timeline = hand_made_timeline()
    assert last_iterations_window(timeline, 3) == (20.0, 48.0)
    assert last_iterations_window(timeline, 1) == (40.0, 48.0)
    assert last_iterations_window(timeline, 99) == (0.0, 48.0)  # more than the run has: all of it
    assert last_iterations_window(timeline, 0) is None and last_iterations_window(timeline, None) is None
    with pytest.raises(ValueError, match=r"^gantt iterations=-1 must be an int >= 0"):
        last_iterations_window(timeline, -1)


def test_utilization_per_iteration_matches_the_hand_computed_fractions():
    timeline = hand_made_timeline()
    windows = [(s.start, s.end) for s in iteration_spans(timeline)]
    usage = utilization_per_window(timeline, windows)
    assert set(usage) == {"rollout/inst0", "rollout/inst1", "train/solver", "train/idle"}
    np.testing.assert_allclose(usage["rollout/inst0"], INST0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(usage["rollout/inst1"], INST1, rtol=0, atol=1e-12)
    np.testing.assert_allclose(usage["train/solver"], TRAIN, rtol=0, atol=1e-12)
    np.testing.assert_allclose(usage["train/idle"], IDLE, rtol=0, atol=0)


def test_busy_fractions_agree_with_the_timeline_accounting():
    """The fast per-window computation equals `Timeline.utilization` (union of clipped intervals) on random,
    overlapping intervals and windows, including windows beyond the data and a zero-length one."""
    rng = np.random.default_rng(7)
    timeline = metrics.Timeline()
    starts = rng.uniform(0, 100, 300)
    for start, length in zip(starts, rng.exponential(1.5, 300), strict=True):
        timeline.add_interval("rollout/x", start, start + length)
    edges = np.sort(rng.uniform(-5, 110, 30))
    windows = [*zip(edges[:-1], edges[1:], strict=True), (50.0, 50.0)]
    fractions = busy_fractions([(i.start, i.end) for i in timeline.intervals("rollout/x")], windows)
    expected = [timeline.utilization("rollout/x", t0, t1) for t0, t1 in windows[:-1]] + [0.0]
    np.testing.assert_allclose(fractions, expected, rtol=1e-9, atol=1e-12)
    assert all(0.0 <= f <= 1.0 for f in fractions)


def test_gantt_figure_draws_the_window_and_the_whole_run_beneath():
    timeline = hand_made_timeline()
    figure = gantt_figure(timeline)  # the default: the last DEFAULT_GANTT_ITERATIONS (3) iterations
    gantt_axes, usage_axes = figure.axes[:2]
    assert metrics.DEFAULT_GANTT_ITERATIONS == 3
    assert gantt_axes.get_xlim() == (20.0, 48.0)
    assert "the last 3 of 5 iterations (iterations 2-4)" in gantt_axes.get_title()
    lines = {line.get_label(): line for line in usage_axes.get_lines()}
    for name, expected in (("rollout/inst0", INST0), ("rollout/inst1", INST1), ("train/solver", TRAIN),
                           ("train/idle", IDLE)):
        np.testing.assert_allclose(lines[name].get_xdata(), range(5))
        np.testing.assert_allclose(lines[name].get_ydata(), expected, atol=1e-12)
    np.testing.assert_allclose(lines["rollout: all meshes (mean)"].get_ydata(),
                               (np.array(INST0) + INST1) / 2, atol=1e-12)
    for line in lines.values():
        assert np.all((np.asarray(line.get_ydata()) >= 0) & (np.asarray(line.get_ydata()) <= 1))
    assert gantt_figure(timeline, iterations=1).axes[0].get_xlim() == (40.0, 48.0)
    assert gantt_figure(timeline, iterations=0).axes[0].get_xlim() == (0.0, 48.0)
    assert gantt_figure(timeline, t0=5, t1=15).axes[0].get_xlim() == (5.0, 15.0)  # explicit times win


def test_old_timelines_fall_back_on_policy_version_updates(tmp_path):
    timeline = metrics.Timeline()
    for version, time in enumerate((0.0, 10.0, 20.0)):
        for agent in ("a", "b"):  # both agents update at one instant: one iteration boundary
            timeline.record_policy_version(agent, version, time=time + (0.0001 if agent == "b" else 0.0))
    timeline.add_interval("train/a", 12, 17, "train", "a")
    assert [tuple(s) for s in iteration_spans(timeline)] == [(0, 0.0, 10.0), (1, 10.0, 20.0)]
    assert gantt_figure(timeline, iterations=1).axes[0].get_xlim() == (10.0, 20.0)
    assert plots.plot_gantt(timeline, tmp_path)[0].exists()


def test_a_long_run_with_many_instances_pools_its_lines_per_agent(tmp_path):
    timeline = metrics.Timeline()
    agents = [f"agent{index}" for index in range(15)]
    for iteration in range(200):
        start = 5.0 * iteration
        for index, agent in enumerate(agents):
            for instance in range(4):
                timeline.add_interval(f"rollout/{agent}/{instance}", start, start + 1 + index / 15, "decode", agent)
            timeline.add_interval(f"train/{agent}", start + 2, start + 4, "train", agent)
        timeline.record_iteration(iteration, start, start + 5)
    figure = gantt_figure(timeline, iterations=5)
    assert figure.axes[0].get_xlim() == (975.0, 1000.0)
    lines = {line.get_label(): line for line in figure.axes[1].get_lines()}
    assert len(lines) == 15 * 2 + 2 > MAX_MESH_LINES  # rollout and train per agent, and the two pools
    # agent3's 4 instances are busy 1 + 3/15 = 1.2 s of every 5 s
    np.testing.assert_allclose(lines["rollout meshes of agent3 (4, mean)"].get_ydata(), [0.24] * 200)
    np.testing.assert_allclose(lines["train meshes of agent3 (1, mean)"].get_ydata(), [0.4] * 200)
    assert plots.plot_gantt(timeline, tmp_path, iterations=5)[0].exists()


def test_plot_all_and_main_take_the_window(tmp_path, monkeypatch):
    timeline = hand_made_timeline()
    timeline.save(tmp_path)
    drawn = []
    real = plots.plot_gantt
    monkeypatch.setattr(plots, "plot_gantt", lambda *args, **kwargs: drawn.append(kwargs) or real(*args, **kwargs))
    plots.plot_all(tmp_path, gantt_iterations=2)
    assert drawn[-1]["iterations"] == 2
    assert plots.main([str(tmp_path), "--gantt-iterations", "4"]) == 0
    assert drawn[-1]["iterations"] == 4
    with pytest.raises(SystemExit):
        plots.main([str(tmp_path), "--gantt-iterations=-1"])
