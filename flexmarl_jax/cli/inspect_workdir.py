"""`flexmarl inspect WORKDIR`: what a run directory holds, as text."""

from __future__ import annotations

import os


def _metrics_summary(workdir: str) -> str:
    from flexmarl_jax.metrics.writer import read_metrics

    rows = read_metrics(workdir)
    if not rows:
        return "metrics: none (no metrics.jsonl, or it is empty)"
    first, last = rows[0], rows[-1]
    return (f"metrics: {len(rows)} iterations; team_accuracy {first.get('team_accuracy')} -> "
            f"{last.get('team_accuracy')}; last e2e_s {last.get('e2e_s')}")


def format_workdir_summary(workdir: str) -> str:
    """Experience-store tables (per agent) and a one-line metrics summary."""
    parts = [f"workdir: {os.path.abspath(workdir)}"]
    try:
        from flexmarl_jax.store.inspect import format_store_summary
    except ImportError:
        parts.append("store: the experience store package is not installed")
    else:
        parts.append(format_store_summary(workdir))
    parts.append(_metrics_summary(workdir))
    return "\n".join(parts)
