"""Per-agent summary of a run's durable experience store (``flexmarl inspect WORKDIR``)."""

from __future__ import annotations

import io

import numpy as np
from rich.console import Console
from rich.table import Table

from flexmarl_jax.store.layout import store_url
from flexmarl_jax.store.store import ExperienceStore


def summarize_store(workdir: str) -> list[dict]:
    """One dict per agent: row counts by state, groups, policy versions seen, column types.

    ``versions`` maps each agent the rows depend on to the sorted distinct versions seen. ``claimed`` is
    always 0 here: claims are leases held in the claiming process's memory, never written to disk.
    Raises FileNotFoundError when WORKDIR holds no store.
    """
    store = ExperienceStore.open(workdir, backend="file", must_exist=True)
    summary = []
    for agent in store.agents:
        rows = store.read_rows(agent, columns=[])
        versions = {}
        for dependency, values in rows["policy_versions"].items():
            seen = np.unique(values[values >= 0])
            if len(seen):
                versions[dependency] = seen.tolist()
        summary.append(
            {
                "agent": agent,
                "rows": len(rows["sample_id"]),
                "groups": len(set(rows["group_id"])),
                **{k: v for k, v in store.counters(agent).items() if k != "total"},
                "versions": versions,
                "columns": dict(store.schema.data_columns),
            }
        )
    store.close()
    return summary


def _versions_text(versions: dict[str, list[int]]) -> str:
    parts = []
    for agent, seen in versions.items():
        span = str(seen[0]) if len(seen) == 1 else f"{seen[0]}..{seen[-1]}"
        parts.append(f"{agent}:{span}" + (f" ({len(seen)})" if len(seen) > 2 else ""))
    return " ".join(parts) or "-"


def format_store_summary(workdir: str) -> str:
    """The summary as a (rich) table, or one line saying there is no store."""
    try:
        summary = summarize_store(workdir)
    except FileNotFoundError:
        return f"store: none at {store_url(workdir)}"
    headers = ["agent", "rows", "groups", "pending", "ready", "consumed", "dropped", "versions seen"]
    body = [[s["agent"], *(str(s[k]) for k in headers[1:7]), _versions_text(s["versions"])] for s in summary]
    columns = ", ".join(f"{name}:{kind}" for name, kind in (summary[0]["columns"] if summary else {}).items())
    title = f"experience store {store_url(workdir)}"
    note = f"data columns: {columns}\n(claims are in-memory leases, so a stored table shows none claimed)"
    table = Table(title=title, title_justify="left")
    for i, header in enumerate(headers):
        table.add_column(header, justify="right" if 0 < i < 7 else "left")
    for row in body:
        table.add_row(*row)
    buffer = io.StringIO()
    Console(file=buffer, width=120, color_system=None, force_terminal=False).print(table)
    return buffer.getvalue().rstrip() + "\n" + note
