"""Progress display: one line per iteration off a terminal, a rich bar on one, the summary table."""

from __future__ import annotations

import io

import numpy as np
import pytest
from rich.console import Console

from flexmarl_jax import metrics
from flexmarl_jax.metrics.progress import format_duration, format_number


def test_without_a_terminal_each_iteration_prints_one_line():
    output = io.StringIO()
    console = Console(file=output, force_terminal=False)
    with metrics.IterationProgress(total=5, initial=2, console=console) as progress:
        for iteration in range(2, 5):
            progress.advance(
                {"iteration": iteration, "team_accuracy": np.float32(0.1 * iteration), "e2e_s": 12.34}
            )
        assert progress.completed == 5
        assert progress.eta_seconds() == 0.0
    lines = output.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("iter 3/5 | acc 0.200 | e2e 12.3 | elapsed 0:00:")
    assert lines[2].startswith("iter 5/5 | acc 0.400 | e2e 12.3 |")
    assert lines[2].endswith("eta 0:00:00")


def test_on_a_terminal_a_rich_bar_shows_count_and_postfix():
    output = io.StringIO()
    console = Console(file=output, force_terminal=True, width=140)
    with metrics.IterationProgress(total=3, console=console, postfix_keys=("team_accuracy",)) as progress:
        for iteration in range(3):
            progress.advance({"iteration": iteration, "team_accuracy": 0.5 + 0.1 * iteration})
    text = output.getvalue()
    assert "3/3" in text
    assert "acc 0.700" in text
    assert "eta 0:00:00" in text
    assert "\n".join(line for line in text.splitlines() if line.startswith("iter ")) == ""  # no plain lines


def test_postfix_uses_flattened_keys_and_skips_missing_ones():
    progress = metrics.IterationProgress(
        total=1,
        postfix_keys=("utilization/rollout", "tokens_per_s", "absent"),
        console=Console(file=io.StringIO()),
    )
    assert progress.postfix({"utilization": {"rollout": 0.625}, "tokens_per_s": 812.4}) == (
        "utilization/rollout 0.625 | tok/s 812"
    )
    assert progress.postfix(None) == ""
    with pytest.raises(ValueError, match="initial=4 total=3"):
        metrics.IterationProgress(total=3, initial=4)


def test_summary_table_has_first_last_min_max_mean(synthetic_records):
    console = Console(file=io.StringIO(), width=160, record=True)
    table = metrics.print_summary(synthetic_records, console=console)
    text = console.export_text()
    assert "Run summary (12 records, iterations 0..11)" in text
    accuracy = [float(r["team_accuracy"]) for r in synthetic_records]
    row = next(line for line in text.splitlines() if "team_accuracy" in line)
    expected = [accuracy[0], accuracy[-1], min(accuracy), max(accuracy), float(np.mean(accuracy))]
    cells = [cell.strip() for cell in row.split("│")[2:7]]
    assert cells == [format_number(value) for value in expected]
    metric_names = table.columns[0]._cells
    assert metric_names[0] == "team_accuracy"  # run-level metrics first
    assert metric_names.index("tokens_per_s") < metric_names.index("agent/planner/accuracy")
    assert not any(name.startswith("utilization/resources/") for name in metric_names)
    assert "utilization/rollout" in metric_names


def test_summary_reads_a_workdir(tmp_path, synthetic_records):
    with metrics.MetricsWriter(tmp_path, tensorboard=False) as writer:
        for record in synthetic_records[:3]:
            writer.write(record)
    table = metrics.print_summary(tmp_path, console=Console(file=io.StringIO()))
    assert table.row_count == len(table.columns[0]._cells) > 10


def test_number_and_duration_formats():
    assert [format_number(x) for x in (0.41234, 12.345, 1234.5, -0.5, 0.0, 0.0011, float("nan"))] == [
        "0.412",
        "12.3",
        "1234",
        "-0.500",
        "0.000",
        "1.10e-03",
        "nan",
    ]
    assert format_duration(3725.4) == "1:02:05"
    assert format_duration(-3) == "0:00:00"


def test_an_eval_prints_a_line_and_joins_the_postfix():
    output = io.StringIO()
    console = Console(file=output, force_terminal=False)
    with metrics.IterationProgress(total=2, console=console) as progress:
        progress.report_eval({"kind": "eval", "iteration": 0, "eval_team_accuracy": 0.25, "eval_pass_at_k": 0.625,
                              "eval_sampled_accuracy": 0.3, "eval_k": 8, "eval_problems": 200})
        progress.advance({"iteration": 0, "team_accuracy": 0.5, "e2e_s": 2.0})
    lines = output.getvalue().splitlines()
    assert lines[0] == "eval after 0 iterations | greedy acc 0.250 | pass@8 0.625 | sampled acc 0.300 | 200 problems"
    assert lines[1].startswith("iter 1/2 | acc 0.500 | e2e 2.000 | eval 0.250 | elapsed")


def test_summary_table_summarises_evals_over_the_evals(synthetic_records):
    evals = [{"kind": "eval", "iteration": step, "eval_team_accuracy": accuracy, "policy_version": {"solver": step},
              "agent": {"solver": {"eval_accuracy": accuracy / 2}}}
             for step, accuracy in ((0, 0.1), (6, 0.4), (12, 0.3))]
    console = Console(file=io.StringIO(), width=160, record=True)
    table = metrics.print_summary([evals[0], *synthetic_records, *evals[1:]], console=console)
    text = console.export_text()
    assert "Run summary (12 records, iterations 0..11; 3 evals)" in text
    row = next(line for line in text.splitlines() if "eval_team_accuracy" in line)
    assert [cell.strip() for cell in row.split("│")[2:7]] == ["0.100", "0.300", "0.100", "0.400", "0.267"]
    names = table.columns[0]._cells
    assert names[:2] == ["team_accuracy", "eval_team_accuracy"]
    assert "agent/solver/eval_accuracy" in names
    # The evals' other fields (their policy versions) do not mix into the iterations' rows.
    assert not any(name.startswith("policy_version") for name in names)
