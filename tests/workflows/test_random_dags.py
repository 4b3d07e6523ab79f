"""Invariants of the executor over random DAGs with random conditional edges (hypothesis)."""

import collections

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexmarl_jax.workflows.executor import WorkflowExecutor
from flexmarl_jax.workflows.graph import Edge, Node, Workflow, first_answer_of
from flexmarl_jax.workflows.records import InMemorySink
from flexmarl_jax.workflows.scripted import ScriptedBackend
from flexmarl_jax.workflows.tasks import ArithmeticTask

AGENTS = ("red", "green", "blue")


@st.composite
def random_workflows(draw):
    count = draw(st.integers(2, 6))
    nodes = [
        Node(f"n{i}", draw(st.sampled_from(AGENTS)), "{prompt}{inputs}", parser="verdict", turn=i)
        for i in range(count)
    ]
    edges = []
    for dst in range(1, count):
        for src in range(dst):
            if draw(st.booleans()):
                edges.append(
                    Edge(f"n{src}", f"n{dst}", draw(st.sampled_from([None, "accepted", "rejected"])))
                )
    return Workflow("random", nodes, edges, first_answer_of([n.name for n in reversed(nodes)]))


def coin(request, sample_index, rng):
    return rng.choice("YN")


@pytest.mark.timeout(120)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workflow=random_workflows(), samples=st.integers(1, 3), seed=st.integers(0, 1000))
def test_random_dags_run_exactly_the_enabled_nodes(workflow, samples, seed):
    problems = ArithmeticTask().generate(3, seed=seed)
    sinks = {}
    with ScriptedBackend({agent: coin for agent in AGENTS}, max_workers=16, seed=seed) as backend:
        for mode in ("dependency", "staged"):
            sink = InMemorySink()
            result = WorkflowExecutor(
                workflow, backend, ArithmeticTask(), samples_per_query=samples, mode=mode
            ).run(problems, sink)
            sinks[mode] = sink
    for trajectory in result.trajectories:
        ran = set(trajectory.outputs)
        for node in workflow.order:
            enabled = all(u in ran for u in workflow.upstream[node]) and all(
                edge.holds(trajectory.outputs[edge.src]) for edge in workflow.incoming[node]
            )
            assert (node in ran) == enabled
            assert (node in trajectory.skipped) == (not enabled)
    assert len(result.trajectories) == len(problems) * samples
    for mode, sink in sinks.items():
        rows = collections.Counter((r.agent, r.group_id) for r in sink.records.values())
        assert sink.group_sizes == dict(rows), mode
        assert set(sink.rewards) == set(sink.records)
        assert all(size <= samples for size in rows.values())
    assert sinks["dependency"].records == sinks["staged"].records
