"""Agents that run Hugging Face checkpoints train end to end through `flexmarl train`, and export back.

The checkpoints are synthetic (models/synthetic.py): random weights of the Qwen2, Qwen3 and Llama
architectures with real byte-level BPE tokenizers and chat templates; Qwen2/Qwen3 share a ChatML tokenizer,
Llama has another vocabulary, BOS and template. So a team mixes architectures, sizes and tokenizers as a real
one (a 1.5B Qwen solver next to a Llama verifier) does, on a 2-core CPU.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from flexmarl_jax.cli.main import main

SMOKE_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "data", "gsm8k_smoke.jsonl")
SMALL_RUN = ("--config.iterations=2", "--config.workflow.queries_per_iteration=2",
             "--config.workflow.samples_per_query=4", "--config.train.micro_batch_size=8",
             "--config.workflow.warmup_steps=0", "--config.rollout.max_prompt_length=192",
             "--config.rollout.max_response_length=16", "--config.rollout.decode_slots=8",
             f"--config.workflow.task={SMOKE_DATA}", "--config.workflow.task_options.jsonl.verifier=math")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """architecture -> a synthetic checkpoint directory."""
    from flexmarl_jax.models.synthetic import make_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: make_checkpoint(root / arch, arch, seed=index) for index, arch in
            enumerate(("qwen2", "qwen3", "llama"))}


def _train(workdir, spec: str, *extra: str) -> list[dict]:
    code = main(["train", f"--config={spec}", f"--workdir={workdir}", "--config.pipeline.debug_invariants=true",
                 *SMALL_RUN, *extra])
    assert code == 0
    with open(os.path.join(workdir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def _assert_trained(records: list[dict], agents: set[str]) -> None:
    assert [r["iteration"] for r in records] == [0, 1]
    assert set(records[-1]["policy_version"]) == agents and set(records[-1]["policy_version"].values()) == {2}
    assert all(0.0 <= r["team_accuracy"] <= 1.0 for r in records)
    for agent in agents:
        assert sum(r["agent"][agent]["requests"] for r in records) > 0, agent


@pytest.mark.timeout(420)
def test_chain_of_three_architectures_with_two_tokenizers(tmp_path, checkpoints):
    """Qwen2 solver, Qwen3 verifier, Llama corrector: each architecture trains as an agent, and the team
    mixes two tokenizers and chat templates; chat prompts go out because every agent is a chat checkpoint."""
    records = _train(tmp_path, "configs/tiny.py",
                     f"--config.agents.solver.model={checkpoints['qwen2']}",
                     f"--config.agents.verifier.model={checkpoints['qwen3']}",
                     f"--config.agents.corrector.model={checkpoints['llama']}",
                     "--config.workflow.options.corrector_runs=always")
    _assert_trained(records, {"solver", "verifier", "corrector"})


@pytest.mark.timeout(420)
def test_debate_between_two_architectures_with_two_tokenizers(tmp_path, checkpoints):
    records = _train(tmp_path, "configs/debate.py",
                     f"--config.agents.debater0.model={checkpoints['qwen2']}",
                     f"--config.agents.debater1.model={checkpoints['llama']}",
                     f"--config.agents.debater2.model={checkpoints['qwen3']}")
    _assert_trained(records, {"debater0", "debater1", "debater2"})
