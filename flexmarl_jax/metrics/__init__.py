"""Metrics: record what happened and show it; never change behaviour.

- `Timeline` (timeline.py): thread-safe busy intervals per resource, point events, gauges, counters
  (record types and series names in timeline_records.py); utilization over a window (utilization.py);
  saved to / loaded from `<workdir>/timeline.json`.
- `MetricsWriter` (writer.py): one JSON object per iteration in `<workdir>/metrics.jsonl` plus
  TensorBoard scalars in `<workdir>/tensorboard/`; resume-safe (an iteration is never written twice). Held-out
  evaluations add records of `"kind": "eval"` (`iteration_records` / `eval_records` tell them apart).
- `IterationProgress`, `print_summary` (progress.py): progress bar with ETA (one line per iteration when
  not on a terminal) and the end-of-run summary table.
- `flexmarl_jax.metrics.plots` (imported separately; it loads matplotlib): `plot_all(workdir)` writes
  curves.png, train_stats.png, time_breakdown.png, gantt.png and load.png into `<workdir>/plots/`;
  `plots.main(["WORKDIR"])` does that and prints the summary table (for a `flexmarl` subcommand).

Resource names are `<group>/<name>`; the group (`rollout`, `train`) pools utilization. Name rollout
resources after the *instance* (`rollout/instance3`), and pass the agent it serves as the `agent` label:
instances migrate between agents, the label follows the work.

Usage::

    from flexmarl_jax import metrics
    from flexmarl_jax.metrics import plots

    timeline = metrics.Timeline()                           # or, on resume: metrics.Timeline.load(workdir)
    timeline.declare("rollout/instance0", "rollout/instance1", "train/slice0")  # idle ones count as 0
    writer = metrics.MetricsWriter(workdir)                 # reads back lines from an earlier run
    start = writer.last_iteration + 1 if writer.last_iteration is not None else 0
    with metrics.IterationProgress(total=num_iterations, initial=start) as progress:
        for iteration in range(start, num_iterations):
            t0 = timeline.now()
            # ... in rollout threads:
            with timeline.busy("rollout/instance0", "decode", agent="solver"):
                tokens = engine.generate(...)               # block_until_ready inside the block
            timeline.increment(metrics.REQUESTS, "solver")
            timeline.increment(metrics.GENERATED_TOKENS, "solver", num_tokens)
            timeline.sample(metrics.QUEUE_LENGTH, "solver", router.queue_length("solver"))
            timeline.sample(metrics.INSTANCES, "solver", router.num_instances("solver"))
            timeline.record_migration("rollout/instance1", from_agent="verifier", to_agent="solver")
            # ... in the trainer:
            with timeline.busy("train/slice0", "train", agent="solver"):
                trainer.accumulate(micro_batch)
            timeline.record_policy_version("solver", version)
            with timeline.busy("train/slice0", "sync", agent="solver"):
                push_weights_to_rollout(...)
            t1 = timeline.now()
            timeline.record_iteration(iteration, t0, t1)    # the plots' iteration windows
            record = {
                "iteration": iteration, "team_accuracy": accuracy,
                # e2e_s, rollout_s + train_s + sync_s + other_s (= e2e_s), tokens_per_s, utilization
                **timeline.iteration_timing(t0, t1, generated_tokens),
                "agent": {"solver": {"reward": r, "accuracy": a, "kl": kl, "clip_frac": c, "entropy": h}},
            }
            writer.write(record)                           # numpy / jax scalars are fine
            timeline.save(workdir)                          # -> workdir/timeline.json
            progress.advance(record)
    writer.close()
    metrics.print_summary(writer.records)
    plots.plot_all(workdir, timeline)                       # -> list of PNG paths
"""

from flexmarl_jax.metrics.iteration_windows import DEFAULT_GANTT_ITERATIONS, iteration_spans
from flexmarl_jax.metrics.jsonable import flatten, to_jsonable
from flexmarl_jax.metrics.progress import IterationProgress, print_summary, summary_table
from flexmarl_jax.metrics.timeline import TIMELINE_FILENAME, Timeline
from flexmarl_jax.metrics.timeline_records import (
    GENERATED_TOKENS,
    INSTANCES,
    ITERATION_SPAN,
    KNOWN_KINDS,
    MIGRATION,
    POLICY_VERSION,
    QUEUE_LENGTH,
    REQUESTS,
    BusyInterval,
    PointEvent,
    Sample,
    resource_group,
)
from flexmarl_jax.metrics.utilization import DEFAULT_TIME_SPLIT, union_length
from flexmarl_jax.metrics.writer import (
    EVAL_KIND,
    ITERATION_KIND,
    METRICS_FILENAME,
    TENSORBOARD_DIRNAME,
    MetricsWriter,
    eval_records,
    iteration_records,
    read_metrics,
)

__all__ = [
    "DEFAULT_GANTT_ITERATIONS",
    "DEFAULT_TIME_SPLIT",
    "EVAL_KIND",
    "GENERATED_TOKENS",
    "INSTANCES",
    "ITERATION_KIND",
    "ITERATION_SPAN",
    "KNOWN_KINDS",
    "METRICS_FILENAME",
    "MIGRATION",
    "POLICY_VERSION",
    "QUEUE_LENGTH",
    "REQUESTS",
    "TENSORBOARD_DIRNAME",
    "TIMELINE_FILENAME",
    "BusyInterval",
    "IterationProgress",
    "MetricsWriter",
    "PointEvent",
    "Sample",
    "Timeline",
    "eval_records",
    "flatten",
    "iteration_records",
    "iteration_spans",
    "print_summary",
    "read_metrics",
    "resource_group",
    "summary_table",
    "to_jsonable",
    "union_length",
]
