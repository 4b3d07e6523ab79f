"""`flexmarl inspect WORKDIR`: what a run directory holds, as text."""

from __future__ import annotations

import os

from flexmarl_jax.metrics.writer import eval_records, iteration_records, read_metrics
from flexmarl_jax.store.inspect import format_store_summary


def _metrics_summary(workdir: str) -> str:
    records = read_metrics(workdir)
    rows, evals = iteration_records(records), eval_records(records)
    if not rows and not evals:
        return "metrics: none (no metrics.jsonl, or it is empty)"
    summary = "metrics: no iterations"
    if rows:
        first, last = rows[0], rows[-1]
        summary = (f"metrics: {len(rows)} iterations; team_accuracy {first.get('team_accuracy')} -> "
                   f"{last.get('team_accuracy')}; last e2e_s {last.get('e2e_s')}")
    if evals:
        summary += (f"; {len(evals)} evals, eval_team_accuracy {evals[0].get('eval_team_accuracy')} -> "
                    f"{evals[-1].get('eval_team_accuracy')}")
    return summary


def format_workdir_summary(workdir: str) -> str:
    """Experience-store tables (per agent) and a one-line metrics summary."""
    parts = [f"workdir: {os.path.abspath(workdir)}"]
    parts.append(format_store_summary(workdir))
    parts.append(_metrics_summary(workdir))
    return "\n".join(parts)
