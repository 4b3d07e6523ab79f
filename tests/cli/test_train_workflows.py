"""Every built-in workflow trains end to end through `flexmarl train` in `flexmarl` mode, and every pipeline mode
runs the workflow shapes its code treats differently.

The modes differ in the orchestration, not in the graph: `serial` puts rollout and training on the same devices
and sends one query at a time, so it runs a conditional node (chain's corrector), a policy shared by several
nodes (debate_shared), several roots feeding an aggregator (mixture) and a fan-out/fan-in graph (dag); `sync`
differs from `flexmarl` only in when training starts, so it runs a shared policy and (on a task file) the chain.
The full workflow x mode product repeated these and took twice as long (tests/orchestrator/test_pipeline.py
checks every mode on the chain, and that sync and flexmarl reach the same parameters).

One process runs these on smoke sizes (2 iterations of 4 queries x 4 samples), sharing the
session's compile cache (tests/conftest.py). After each run the experience store itself is checked: every
row was trained exactly once, under the policy version of its iteration, and depended only on that version
of every agent (strict on-policy); the run's own consistency checker (`pipeline.debug_invariants`) was on.
"""

import json
import os

import numpy as np
import pytest

from flexmarl_jax.cli.main import main

MODES = ("serial", "sync", "flexmarl")
JSONL_MODE = "sync"  # reading a task file does not depend on the mode
WORKFLOW_CONFIGS = {
    "chain": "configs/tiny.py:smoke",
    "debate": "configs/debate.py:smoke",
    "debate_judge": "configs/debate.py:judge,smoke",
    "debate_shared": "configs/debate.py:shared,smoke",
    "mixture": "configs/mixture.py:smoke",
    "dag": "configs/dag_example.py:smoke",
}


@pytest.fixture(scope="module")
def jsonl_task(tmp_path_factory):
    """A GSM8K-sized arithmetic file in the `{"prompt", "answer"}` format."""
    from flexmarl_jax.workflows import ArithmeticTask

    path = tmp_path_factory.mktemp("task") / "sums.jsonl"
    problems = ArithmeticTask(max_digits=1, operators="+", max_answer=9).generate(40, seed=3)
    path.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in problems))
    return str(path)


def _train(workdir, spec: str, mode: str, *extra: str) -> list[dict]:
    code = main(["train", f"--config={spec}", f"--config.pipeline.mode={mode}", f"--workdir={workdir}",
                 "--config.store.backend=file", "--config.pipeline.debug_invariants=true", *extra])
    assert code == 0
    with open(os.path.join(workdir, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    evals = [record for record in records if record.get("kind") == "eval"]
    assert [record["iteration"] for record in evals] == [0, 2]  # held-out evals at the start and the end
    assert all(record["eval_sampled_accuracy"] <= record["eval_pass_at_k"] for record in evals)
    return [record for record in records if record.get("kind", "iteration") == "iteration"]


def _check_store(workdir, records: list[dict]) -> None:
    from flexmarl_jax.store import ExperienceStore

    store = ExperienceStore.open(str(workdir), backend="file", must_exist=True)
    try:
        agents = list(records[-1]["agent"])
        assert sorted(store.counters()) == sorted(agents)
        assert sum(store.counters(agent)["consumed"] for agent in agents) > 0
        for agent in agents:
            counts = store.counters(agent)
            trained = [r["agent"][agent]["samples"] for r in records]
            # (a conditional agent, like chain's corrector, may have had nothing to do)
            assert counts["consumed"] == counts["total"] == sum(trained), (agent, counts, trained)
            rows = store.read_rows(agent)
            own = np.asarray(rows["policy_versions"][agent])
            # Iteration v trains exactly the rows generated under version v, each once.
            assert [int((own == version).sum()) for version in range(len(records))] == trained, agent
            assert len(set(rows["sample_id"])) == len(rows["sample_id"])
            for dependency, versions in rows["policy_versions"].items():
                versions = np.asarray(versions)
                depends = versions >= 0
                assert (versions[depends] == own[depends]).all(), (agent, dependency)
    finally:
        store.close()


def _check_run(records: list[dict], agents_expected: int) -> None:
    assert [r["iteration"] for r in records] == [0, 1]
    assert len(records[-1]["policy_version"]) == agents_expected
    assert set(records[-1]["policy_version"].values()) == {2}
    assert all(0.0 <= r["team_accuracy"] <= 1.0 for r in records)


AGENTS_PER_WORKFLOW = {"chain": 3, "debate": 3, "debate_judge": 4, "debate_shared": 2, "mixture": 4, "dag": 4}


RUNS = [*((workflow, "flexmarl") for workflow in WORKFLOW_CONFIGS),
        *((workflow, "serial") for workflow in ("chain", "debate_shared", "mixture", "dag")),
        ("debate_shared", "sync")]  # chain x sync: test_chain_trains_on_a_jsonl_task_file


def test_the_runs_cover_every_workflow_and_every_mode():
    assert {workflow for workflow, _ in RUNS} == set(WORKFLOW_CONFIGS)
    assert {mode for _, mode in RUNS} | {JSONL_MODE} == set(MODES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("workflow", "mode"), RUNS)
def test_every_workflow_trains(tmp_path, workflow, mode):
    records = _train(tmp_path, WORKFLOW_CONFIGS[workflow], mode)
    _check_run(records, AGENTS_PER_WORKFLOW[workflow])
    _check_store(tmp_path, records)


@pytest.mark.timeout(300)
def test_chain_trains_on_a_jsonl_task_file(tmp_path, jsonl_task):
    records = _train(tmp_path, WORKFLOW_CONFIGS["chain"], JSONL_MODE, f"--config.workflow.task={jsonl_task}")
    _check_run(records, 3)
    _check_store(tmp_path, records)
    with open(tmp_path / "config.json") as handle:
        assert json.load(handle)["workflow"]["task"] == jsonl_task
