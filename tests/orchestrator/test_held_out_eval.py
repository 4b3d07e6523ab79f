"""Acceptance: no eval problem, by its content, reaches warm-up or training in a real `flexmarl train` run, and the
run records its held-out evals.

The smoke config's task has 15 distinct problems (one-digit sums up to 4), 3 of them held out. The warm-up draws
256 problems and the rollouts 8, so a run that drew from the whole task would meet the held-out ones almost
surely (checked below): their absence from every warm-up and training call, and from every row of the store,
is the split at work. Problems are compared by their prompt text, never by input id.
"""

import json
import os

import numpy as np
import pytest

from flexmarl_jax.cli.main import main
from flexmarl_jax.config import RunConfig, load_config
from flexmarl_jax.models.tokenizer import CharTokenizer
from flexmarl_jax.workflows import WorkflowExecutor
from flexmarl_jax.workflows.from_config import split_task_from_config, task_from_config
from flexmarl_jax.workflows.splits import EVAL_PROBLEMS_SEED, content_key
from flexmarl_jax.workflows.warmup_data import warmup_problems


@pytest.mark.timeout(600)
def test_no_eval_problem_reaches_warmup_or_training(tmp_path, monkeypatch):
    config = RunConfig.from_config(load_config("configs/tiny.py:smoke"))
    split = split_task_from_config(config.workflow, config.eval)
    eval_keys = {content_key(problem) for problem in split.eval_problems(config.eval.problems, seed=EVAL_PROBLEMS_SEED)}
    assert len(eval_keys) == 3
    # Negative control: the bare task's warm-up draws contain every held-out problem.
    bare = task_from_config(config.workflow)
    assert eval_keys <= {content_key(p) for p in warmup_problems(bare, queries=256, seed=config.seed)}

    runs = []  # (kind of run, query prompts): every workflow run of the training process
    original_run = WorkflowExecutor.run

    def recording_run(self, problems, sink=None):
        kind = "eval" if sink is None else type(sink).__name__  # InMemorySink: warm-up; StoreSink: rollouts
        runs.append((kind, [problem.prompt for problem in problems]))
        return original_run(self, problems, sink)

    monkeypatch.setattr(WorkflowExecutor, "run", recording_run)
    workdir = tmp_path / "run"
    assert main(["train", "--config=configs/tiny.py:smoke", f"--workdir={workdir}", "--config.store.backend=file",
                 "--config.workflow.warmup=sft"]) == 0

    kinds = [kind for kind, _ in runs]
    assert kinds.count("InMemorySink") == 1 and kinds.count("StoreSink") == config.iterations
    assert kinds.count("eval") == 2 * 2  # evals after 0 and 2 iterations, a greedy and a sampled pass each
    for kind, prompts in runs:
        keys = {content_key(prompt) for prompt in prompts}
        if kind == "eval":
            assert keys == eval_keys  # every eval problem, and only those
        else:
            assert not keys & eval_keys, kind

    # What was trained: every row in the store, decoded. Each prompt starts with its query ("d+d=").
    from flexmarl_jax.store import ExperienceStore

    tokenizer = CharTokenizer()
    store = ExperienceStore.open(str(workdir), backend="file", must_exist=True)
    try:
        rows = 0
        for agent in store.counters():
            for tokens in store.read_rows(agent, columns=["prompt_tokens"])["prompt_tokens"]:
                query = tokenizer.decode(np.asarray(tokens).tolist())[:4]
                assert content_key(query) not in eval_keys, (agent, query)
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
        assert record["eval_problems"] == 3 and record["eval_k"] == config.eval.samples
        assert 0.0 <= record["eval_team_accuracy"] <= 1.0
        assert record["eval_sampled_accuracy"] <= record["eval_pass_at_k"] <= 1.0  # any of k >= mean of k
        assert record["policy_version"] == {agent: record["iteration"] for agent in config.agents}
    trained = [record for record in records if record.get("kind", "iteration") == "iteration"]
    assert [record["iteration"] for record in trained] == list(range(config.iterations))
