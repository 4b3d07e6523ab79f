"""Acceptance: no eval problem, by its content, reaches warm-up or training in a real `flexmarl train` run, and the
run records its held-out evals.

The smoke config's task has 15 prompts (one-digit sums up to 4), 9 problems up to the order of the operands;
at eval.fraction=0.3 four of them are held out (0+0, 0+1, 1+1, 2+2: five prompts). The warm-up draws 256
problems and the rollouts 8, so a run that drew from the whole task would meet them almost surely (checked
below): their absence from every warm-up and training call, and from every row of the store, is the split at
work. Problems are compared by content (the sum, whatever the order of its operands), never by input id.
"""

import json
import os

import numpy as np
import pytest

from flexmarl_jax.cli.main import main
from flexmarl_jax.config import RunConfig, apply_overrides, load_config
from flexmarl_jax.config.workflow_from_config import split_task_from_config, task_from_config
from flexmarl_jax.models.tokenizer import CharTokenizer
from flexmarl_jax.workflows import WorkflowExecutor
from flexmarl_jax.workflows.splits import EVAL_PROBLEMS_SEED
from flexmarl_jax.workflows.warmup_data import warmup_problems


@pytest.mark.timeout(600)
def test_no_eval_problem_reaches_warmup_or_training(tmp_path, monkeypatch):
    config = RunConfig.from_config(apply_overrides(load_config("configs/tiny.py:smoke"),
                                                   {"workflow.task": "arithmetic", "eval.fraction": "0.3"}))
    split = split_task_from_config(config.workflow, config.eval)
    eval_keys = {split.content_key(problem)
                 for problem in split.eval_problems(config.eval.problems, seed=EVAL_PROBLEMS_SEED)}
    assert eval_keys == {"0+0=", "0+1=", "1+1=", "2+2="}
    # Negative control: the bare task's warm-up draws contain every held-out problem.
    bare = task_from_config(config.workflow)
    assert eval_keys <= {split.content_key(p) for p in warmup_problems(bare, queries=256, seed=config.seed)}

    runs = []  # (kind of run, its problems): every workflow run of the training process
    original_run = WorkflowExecutor.run

    def recording_run(self, problems, sink=None):
        kind = "eval" if sink is None else type(sink).__name__  # InMemorySink: warm-up; StoreSink: rollouts
        runs.append((kind, list(problems)))
        return original_run(self, problems, sink)

    monkeypatch.setattr(WorkflowExecutor, "run", recording_run)
    workdir = tmp_path / "run"
    assert main(["train", "--config=configs/tiny.py:smoke", f"--workdir={workdir}", "--config.store.backend=file",
                 "--config.workflow.task=arithmetic", "--config.workflow.warmup=sft",
                 "--config.eval.fraction=0.3"]) == 0

    kinds = [kind for kind, _ in runs]
    assert kinds.count("InMemorySink") == 1 and kinds.count("StoreSink") == config.iterations
    assert kinds.count("eval") == 2 * 2  # evals after 0 and 2 iterations, a greedy and a sampled pass each
    for kind, problems in runs:
        keys = {split.content_key(problem) for problem in problems}
        if kind == "eval":
            assert keys == eval_keys  # every eval problem, and only those
        else:
            assert not keys & eval_keys, kind

    # What was trained: every row in the store, decoded. Each prompt starts with its query "a+b=", which is the
    # problem "min(a,b)+max(a,b)=".
    from flexmarl_jax.store import ExperienceStore

    tokenizer = CharTokenizer()
    store = ExperienceStore.open(str(workdir), backend="file", must_exist=True)
    try:
        rows = 0
        for agent in store.counters():
            for tokens in store.read_rows(agent, columns=["prompt_tokens"])["prompt_tokens"]:
                query = tokenizer.decode(np.asarray(tokens).tolist())[:4]
                left, right = sorted(query[:3].split("+"))
                assert f"{left}+{right}=" not in eval_keys, (agent, query)
                rows += 1
            counts = store.counters(agent)
            assert counts["consumed"] == counts["total"]  # nothing but trained rollout rows is stored
        assert rows > 0
    finally:
        store.close()

    with open(os.path.join(workdir, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    evals = [record for record in records if record.get("kind") == "eval"]
    assert [record["iteration"] for record in evals] == [0, config.iterations]
    for record in evals:
        assert record["eval_problems"] == 4 and record["eval_k"] == config.eval.samples
        assert 0.0 <= record["eval_team_accuracy"] <= 1.0
        assert record["eval_sampled_accuracy"] <= record["eval_pass_at_k"] <= 1.0  # any of k >= mean of k
        assert record["policy_version"] == {agent: record["iteration"] for agent in config.agents}
    trained = [record for record in records if record.get("kind", "iteration") == "iteration"]
    assert [record["iteration"] for record in trained] == list(range(config.iterations))
