"""Training progress on the console: a rich progress bar with ETA on a terminal, one line per iteration
otherwise (CI logs), a line per held-out evaluation, and an end-of-run summary table built from the metrics
records (training iterations and evaluations)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from flexmarl_jax.metrics.jsonable import numeric_items
from flexmarl_jax.metrics.writer import eval_records, is_eval_metric, iteration_records, read_metrics

DEFAULT_POSTFIX_KEYS = ("team_accuracy", "e2e_s", "tokens_per_s")
_SHORT_NAMES = {"team_accuracy": "acc", "team_reward": "reward", "e2e_s": "e2e", "tokens_per_s": "tok/s"}
_SUMMARY_FIRST = (
    "team_accuracy",
    "eval_team_accuracy",
    "eval_pass_at_k",
    "eval_sampled_accuracy",
    "team_reward",
    "e2e_s",
    "rollout_s",
    "train_s",
    "sync_s",
    "other_s",
    "tokens_per_s",
)


def format_number(value: float) -> str:
    """Compact, fixed-ish precision: 0.412, 12.3, 1234, and 1.10e-03 for small values such as KL."""
    if value != value:  # NaN
        return "nan"
    magnitude = abs(value)
    if 0 < magnitude < 0.01:
        return f"{value:.2e}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"


def format_duration(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class IterationProgress:
    """Progress over training iterations, with ETA and a live postfix taken from each metrics record.

    Use as a context manager and call `advance(record)` once per finished iteration. On a terminal this is
    a rich progress bar; when the console is not a terminal (CI, `| tee`), each `advance` prints one line:
    `iter 3/20 | acc 0.412 | e2e 12.3 | tok/s 845 | elapsed 0:00:37 | eta 0:03:12`.

    Args:
      total: iterations the run will reach (the last iteration number + 1 when counting from 0).
      initial: iterations already done (when resuming); they count as done but not towards the ETA.
      postfix_keys: flattened record keys shown after the bar (e.g. `utilization/rollout`).
      console: where to draw; default stdout. `Console(force_terminal=...)` decides bar vs lines.
    """

    def __init__(
        self,
        total: int,
        *,
        initial: int = 0,
        description: str = "training",
        postfix_keys: Sequence[str] = DEFAULT_POSTFIX_KEYS,
        console: Console | None = None,
    ):
        if total < 0 or not 0 <= initial <= total:
            raise ValueError(f"need 0 <= initial <= total, got initial={initial} total={total}")
        self.total = total
        self.completed = initial
        self._initial = initial
        self._postfix_keys = tuple(postfix_keys)
        self._last_eval: float | None = None  # the latest eval_team_accuracy, shown after the postfix
        self._console = console or Console(file=sys.stdout)
        self._started = time.monotonic()
        self._progress: Progress | None = None
        self._task = None
        if self._console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("elapsed"),
                TimeElapsedColumn(),
                # Our own ETA (mean time per iteration of this process), as in the line-per-iteration mode:
                # rich's estimate needs several samples within a 30 s window, and iterations take minutes.
                TextColumn("eta {task.fields[eta]}"),
                TextColumn("{task.fields[postfix]}"),
                console=self._console,
            )
            self._task = self._progress.add_task(
                description, total=total, completed=initial, postfix="", eta="?"
            )

    def __enter__(self) -> IterationProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()

    def postfix(self, record: Mapping[str, Any] | None) -> str:
        """`acc 0.412 | e2e 12.3 | eval 0.350` from the record's values for `postfix_keys` (missing keys
        skipped) and the latest held-out eval accuracy (`report_eval`)."""
        numbers = numeric_items(record) if record else {}
        parts = [
            f"{_SHORT_NAMES.get(key, key)} {format_number(numbers[key])}"
            for key in self._postfix_keys
            if key in numbers
        ]
        if self._last_eval is not None:
            parts.append(f"eval {format_number(self._last_eval)}")
        return " | ".join(parts)

    def report_eval(self, record: Mapping[str, Any]) -> None:
        """Shows a held-out eval record: one line (above the bar on a terminal), and its greedy team accuracy
        in the postfix from now on."""
        accuracy = record.get("eval_team_accuracy")
        self._last_eval = accuracy if isinstance(accuracy, (int, float)) else None
        parts = [f"eval after {record.get('iteration')} iterations"]
        for key, name in (("eval_team_accuracy", "greedy acc"), ("eval_pass_at_k", f"pass@{record.get('eval_k')}"),
                          ("eval_sampled_accuracy", "sampled acc")):
            if isinstance(record.get(key), (int, float)):
                parts.append(f"{name} {format_number(record[key])}")
        parts.append(f"{record.get('eval_problems')} problems")
        line = " | ".join(parts)
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self._console.file, flush=True)

    def eta_seconds(self) -> float | None:
        """Remaining time from the mean time per iteration done in this process; None before the first."""
        done_here = self.completed - self._initial
        if done_here <= 0:
            return None
        return (time.monotonic() - self._started) / done_here * (self.total - self.completed)

    def advance(self, record: Mapping[str, Any] | None = None, steps: int = 1) -> None:
        """Mark `steps` more iterations done; `record` (the iteration's metrics) fills the postfix."""
        self.completed = min(self.completed + steps, self.total)
        postfix = self.postfix(record)
        eta = self.eta_seconds()
        if self._progress is not None:
            eta_text = format_duration(eta) if eta is not None else "?"
            self._progress.update(self._task, advance=steps, postfix=postfix, eta=eta_text)
            return
        parts = [f"iter {self.completed}/{self.total}"]
        if postfix:
            parts.append(postfix)
        parts.append(f"elapsed {format_duration(time.monotonic() - self._started)}")
        parts.append(f"eta {format_duration(eta) if eta is not None else '?'}")
        # Plain print, not console.print: no markup, no wrapping at the console width, one grep-able line.
        print(" | ".join(parts), file=self._console.file, flush=True)


def summary_table(records: Sequence[Mapping[str, Any]]) -> Table:
    """A rich table: one row per numeric metric with first, last, min, max and mean over the iterations (an
    eval metric: over the evaluations).

    Run-level metrics come first (accuracy, held-out eval accuracy, reward, times, throughput, utilization),
    then per-agent ones. Per-resource utilization rows are left out (they are in metrics.jsonl).
    """
    rows = [numeric_items(record) for record in iteration_records(records)]
    evals = [{key: value for key, value in numeric_items(record).items() if is_eval_metric(key)}
             for record in eval_records(records)]
    iterations = [int(row["iteration"]) for row in rows if "iteration" in row]
    span = f"iterations {min(iterations)}..{max(iterations)}" if iterations else "no iterations"
    held_out = f"; {len(evals)} evals" if evals else ""
    table = Table(title=f"Run summary ({len(rows)} records, {span}{held_out})", title_style="bold")
    table.add_column("metric", style="cyan", no_wrap=True)
    for column in ("first", "last", "min", "max", "mean"):
        table.add_column(column, justify="right")

    keys: dict[str, None] = {}
    for row in (*rows, *evals):
        keys.update(dict.fromkeys(row))
    keys.pop("iteration", None)
    keys = {key: None for key in keys if not key.startswith("utilization/resources/")}

    def order(key: str) -> tuple:
        if key in _SUMMARY_FIRST:
            return (0, _SUMMARY_FIRST.index(key), key)
        if key.startswith(("agent/", "agents/")):
            return (2, 0, key)
        return (1, 0, key)

    for key in sorted(keys, key=order):
        values = [row[key] for row in (evals if is_eval_metric(key) else rows) if key in row]
        table.add_row(
            key,
            format_number(values[0]),
            format_number(values[-1]),
            format_number(min(values)),
            format_number(max(values)),
            format_number(sum(values) / len(values)),
        )
    return table


def print_summary(
    records: Sequence[Mapping[str, Any]] | str | os.PathLike[str], console: Console | None = None
) -> Table:
    """Print `summary_table` of the records (or of a metrics.jsonl / workdir) and return the table."""
    if isinstance(records, (str, os.PathLike)):
        records = read_metrics(records)
    table = summary_table(records)
    (console or Console()).print(table)
    return table
