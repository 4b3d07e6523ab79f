"""Did a finished run train every sample exactly once? Counted from the experience store's own rows.

A run of `iterations` iterations applies one update per agent per policy version 0 .. iterations-1 (strict
on-policy, `train.max_staleness=0`), each from one attempt of its iteration: every row that attempt produced
is trained exactly once (marked CONSUMED), and nothing of any other attempt is (a failed attempt's rows are
DROPPED). A row records the agent's policy version it was generated under (`version__<agent>`), and its
input id the attempt (`JointOrchestrator.problems_for` appends `r<attempt>` to a redone iteration's ids), so
for each version v the store alone says:

- the **applied attempt**: the one most of v's consumed rows (all agents together) come from (with none
  consumed, the latest attempt: its rows are then all counted lost);
- **lost rows**: rows of the applied attempt that are not consumed (produced for an update that was applied,
  never trained), plus, for an agent that runs on every sample (`expected_rows`), the rows its batch lacks;
- **double-trained rows**: consumed rows of any other attempt of v (trained beside the applied batch, or
  consumed without their update being kept), consumed rows of a version the run never applied
  (v >= iterations), and an agent's consumed rows beyond its batch. A conditional agent (one that runs only
  when a condition holds, like chain's corrector) has no fixed batch, but never more than one.

`tests/orchestrator/test_run_audit.py` checks it against a store where rows were lost and doubled by hand.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence

import numpy as np

from flexmarl_jax.store import ExperienceStore
from flexmarl_jax.store.schema import RowState

# A redone iteration's input ids end with r<attempt> (JointOrchestrator.problems_for); base task ids end with a
# number (`tasks.make_input_id`), so the suffix is unambiguous.
_ATTEMPT_SUFFIX = re.compile(r"r(\d+)$")
_SETTLED = (int(RowState.CONSUMED), int(RowState.DROPPED))


def attempt_of(sample_id: str) -> int:
    """The attempt of its iteration a row belongs to, from its sample id `{input_id}_{turn}_{trajectory}`."""
    input_id = sample_id.rsplit("_", 2)[0]
    match = _ATTEMPT_SUFFIX.search(input_id)
    return int(match.group(1)) if match else 0


def iteration_records(workdir: str) -> list[dict]:
    """The per-iteration records of `workdir`'s metrics.jsonl (not the evals; a torn last line is skipped)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        records = [json.loads(line) for line in handle if line.endswith("\n")]
    return [record for record in records if record.get("kind", "iteration") == "iteration"]


def rows_per_iteration(workflow, samples_per_iteration: int) -> dict[str, int | None]:
    """agent -> the rows it trains per iteration when it runs on every sample (one per sample and node it
    plays); None for an agent with a node behind a conditional edge (directly or upstream), whose count varies.

    workflow: a `workflows.Workflow`; samples_per_iteration: queries_per_iteration x samples_per_query."""
    conditional: set[str] = set()
    for node in workflow.order:
        if any(edge.when not in (None, "always") for edge in workflow.incoming[node]) or \
                any(upstream in conditional for upstream in workflow.upstream[node]):
            conditional.add(node)
    expected: dict[str, int | None] = {}
    for name, node in workflow.nodes.items():
        if name in conditional or expected.get(node.agent, 0) is None:
            expected[node.agent] = None
        else:
            expected[node.agent] = expected.get(node.agent, 0) + samples_per_iteration
    return expected


@dataclasses.dataclass(frozen=True)
class AgentRows:
    """One agent's table as the audit reads it: [rows] each."""

    sample_ids: Sequence[str]
    states: np.ndarray  # RowState values
    versions: np.ndarray  # the agent's own policy version each row was generated under


@dataclasses.dataclass
class StoreAudit:
    lost_rows: int = 0
    double_trained_rows: int = 0
    findings: list[str] = dataclasses.field(default_factory=list)  # one line per (agent, version) that is off

    @property
    def clean(self) -> bool:
        return self.lost_rows == 0 and self.double_trained_rows == 0


def audit_rows(tables: Mapping[str, AgentRows], *, iterations: int,
               expected_rows: Mapping[str, int | None]) -> StoreAudit:
    """Lost and double-trained rows of a run that applied versions 0 .. iterations-1 (module docstring).

    expected_rows: agent -> rows it trains per version (`rows_per_iteration`), None for a conditional agent."""
    audit = StoreAudit()
    attempts = {agent: np.array([attempt_of(s) for s in rows.sample_ids], dtype=np.int64)
                for agent, rows in tables.items()}
    consumed = {agent: np.asarray(rows.states) == int(RowState.CONSUMED) for agent, rows in tables.items()}
    versions = {agent: np.asarray(rows.versions, dtype=np.int64) for agent, rows in tables.items()}
    seen = set(range(iterations)).union(*(set(v.tolist()) for v in versions.values()))
    for version in sorted(seen):
        at = {agent: versions[agent] == version for agent in tables}
        applied = _applied_attempt({agent: attempts[agent][at[agent]] for agent in tables},
                                   {agent: consumed[agent][at[agent]] for agent in tables})
        for agent, rows in tables.items():
            here, done = at[agent], consumed[agent] & at[agent]
            if version >= iterations or version < 0:
                extra = int(done.sum())
                if extra:
                    audit.double_trained_rows += extra
                    audit.findings.append(f"{agent} v{version}: {extra} rows consumed for a version the run never "
                                          f"applied (it applied 0..{iterations - 1})")
                continue
            in_applied = here & (attempts[agent] == applied)
            not_trained = int((in_applied & ~consumed[agent]).sum())
            expected = expected_rows.get(agent)
            missing = max(0, expected - int(in_applied.sum())) if expected is not None else 0
            elsewhere = int((done & ~in_applied).sum())
            beyond = max(0, int((done & in_applied).sum()) - expected) if expected is not None else 0
            if not_trained or missing:
                audit.lost_rows += not_trained + missing
                audit.findings.append(f"{agent} v{version}: attempt {applied} was applied but {not_trained} of its "
                                      f"rows are not consumed and {missing} of its batch never reached the store")
            if elsewhere or beyond:
                audit.double_trained_rows += elsewhere + beyond
                audit.findings.append(f"{agent} v{version}: {elsewhere} consumed rows of attempts other than the "
                                      f"applied {applied}, {beyond} beyond its batch of {expected}")
            unsettled = here & ~in_applied & ~np.isin(np.asarray(rows.states), _SETTLED)
            if unsettled.any():  # neither lost nor trained: left over, never claimable at max_staleness=0
                audit.findings.append(f"{agent} v{version}: {int(unsettled.sum())} rows of unapplied attempts "
                                      "neither consumed nor dropped")
    return audit


def _applied_attempt(attempts: Mapping[str, np.ndarray], consumed: Mapping[str, np.ndarray]) -> int | None:
    """The attempt most consumed rows of one version come from (ties: the later); with none consumed, the
    latest attempt present; None when the version has no rows at all."""
    counts: collections.Counter[int] = collections.Counter()
    for agent, agent_attempts in attempts.items():
        counts.update(agent_attempts[consumed[agent]].tolist())
    if counts:
        return max(counts, key=lambda attempt: (counts[attempt], attempt))
    present = [int(a.max()) for a in attempts.values() if len(a)]
    return max(present) if present else None


def audit_workdir(workdir: str, *, iterations: int, expected_rows: Mapping[str, int | None]) -> StoreAudit:
    """`audit_rows` over the durable store of `workdir` (file backend), read as a resumed run would open it."""
    store = ExperienceStore.open(workdir, backend="file", must_exist=True)
    try:
        tables = {}
        for agent in store.agents:
            rows = store.read_rows(agent, columns=[])
            tables[agent] = AgentRows(rows["sample_id"], np.asarray(rows["state"]),
                                      np.asarray(rows["policy_versions"][agent]))
    finally:
        store.close()
    return audit_rows(tables, iterations=iterations, expected_rows=expected_rows)
