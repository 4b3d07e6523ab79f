"""The package docstring's usage, run for real: threads record on a live clock, then write, plot, resume."""

from __future__ import annotations

import io
import threading
import time

import pytest
from rich.console import Console

from flexmarl_jax import metrics
from flexmarl_jax.metrics import plots

AGENTS = ("planner", "solver")


def run_iterations(
    workdir, timeline: metrics.Timeline, num_iterations: int, output: io.StringIO
) -> list[dict]:
    writer = metrics.MetricsWriter(workdir)
    start = writer.last_iteration + 1 if writer.last_iteration is not None else 0
    console = Console(file=output, force_terminal=False)
    with metrics.IterationProgress(total=num_iterations, initial=start, console=console) as progress:
        for iteration in range(start, num_iterations):
            t0 = timeline.now()

            def rollout(instance: int, agent: str) -> None:
                for _ in range(3):
                    with timeline.busy(f"rollout/instance{instance}", "decode", agent=agent):
                        time.sleep(0.004)
                    timeline.increment(metrics.REQUESTS, agent)
                    timeline.increment(metrics.GENERATED_TOKENS, agent, 32)
                    timeline.sample(metrics.QUEUE_LENGTH, agent, 3)

            threads = [threading.Thread(target=rollout, args=(i, AGENTS[i % 2])) for i in range(3)]
            for thread in threads:
                thread.start()
            with timeline.busy("train/slice0", "train", agent="solver"):
                time.sleep(0.005)
            for thread in threads:
                thread.join()
            with timeline.busy("train/slice0", "sync", agent="solver"):
                time.sleep(0.002)
            for agent in AGENTS:
                timeline.record_policy_version(agent, iteration + 1)
            t1 = timeline.now()
            timeline.record_iteration(iteration, t0, t1)
            record = {
                "iteration": iteration,
                "team_accuracy": 0.1 * iteration,
                "e2e_s": t1 - t0,
                **timeline.time_split(t0, t1),
                "tokens_per_s": timeline.counter_rate(metrics.GENERATED_TOKENS, t0, t1),
                "utilization": timeline.utilization_report(t0, t1),
                "agent": {
                    agent: {"reward": 0.2 * iteration, "accuracy": 0.1 * iteration} for agent in AGENTS
                },
            }
            writer.write(record)
            timeline.save(workdir)
            progress.advance(record)
    writer.close()
    return writer.records


@pytest.mark.timeout(120)
def test_docstring_usage_runs_and_resumes(tmp_path):
    timeline = metrics.Timeline()
    timeline.declare("rollout/instance0", "rollout/instance1", "rollout/instance2", "train/slice0")
    timeline.sample(metrics.INSTANCES, "planner", 1, time=0.0)
    timeline.sample(metrics.INSTANCES, "solver", 2, time=0.0)
    output = io.StringIO()
    records = run_iterations(tmp_path, timeline, 2, output)
    assert [r["iteration"] for r in records] == [0, 1]
    for record in records:
        parts = record["rollout_s"] + record["train_s"] + record["sync_s"] + record["other_s"]
        assert parts == pytest.approx(record["e2e_s"], abs=1e-9)
        assert record["tokens_per_s"] == pytest.approx(9 * 32 / record["e2e_s"])
        assert 0.0 < record["utilization"]["rollout"] <= 1.0
        assert 0.0 < record["utilization"]["train"] <= 1.0

    # A new process resumes: the timeline is reloaded, iterations 0-1 are skipped, 2 is added.
    resumed_timeline = metrics.Timeline.load(tmp_path)
    records = run_iterations(tmp_path, resumed_timeline, 3, output)
    assert [r["iteration"] for r in metrics.read_metrics(tmp_path)] == [0, 1, 2]
    assert len(output.getvalue().splitlines()) == 3  # one progress line per iteration run
    assert len(metrics.Timeline.load(tmp_path).events(metrics.POLICY_VERSION)) == 3 * len(AGENTS)
    assert metrics.Timeline.load(tmp_path).counter_total(metrics.REQUESTS) == 3 * 9
    spans = metrics.iteration_spans(metrics.Timeline.load(tmp_path))  # the iterations survive save and resume
    assert [span.iteration for span in spans] == [0, 1, 2]
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:], strict=False))

    written = plots.plot_all(tmp_path)
    assert len(written) == 4  # curves, time breakdown, gantt, load (no kl/clip/entropy recorded)
    assert all(path.stat().st_size > 10_000 for path in written)
