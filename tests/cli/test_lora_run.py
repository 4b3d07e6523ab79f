"""LoRA agents through `flexmarl train`, resume and `flexmarl export` (issue 34's training side): two agents with
adapters of different ranks on one synthetic Llama base beside a full fine-tune of the same checkpoint."""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexmarl_jax.cli.main import main

LORA = ("--config.agents.solver.lora.rank=8", "--config.agents.verifier.lora.rank=4",
        "--config.agents.verifier.lora.targets=q_proj,v_proj")


def _run(workdir, base: str, iterations: int) -> list[dict]:
    models = [f"--config.agents.{name}.model={base}" for name in ("solver", "verifier", "corrector")]
    code = main(["train", "--config=configs/gsm8k_chain.py:cpu_smoke", f"--workdir={workdir}", *models, *LORA,
                 f"--config.iterations={iterations}", "--config.workflow.queries_per_iteration=2",
                 "--config.rollout.max_response_length=16", "--config.eval.every=100",
                 # supervised warm-up steps (plain prompts): random weights earn no reward, so RL alone moves nothing
                 "--config.workflow.options.chat=false", "--config.workflow.warmup_steps=2"])
    assert code == 0
    with open(os.path.join(workdir, "metrics.jsonl")) as handle:
        return [r for r in map(json.loads, handle) if r.get("kind", "iteration") == "iteration"]


def _bytes(directory) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(directory) for name in names)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(workdir, base directory) after 2 iterations, then a resume to 3."""
    from flexmarl_jax.models.fixture_cache import synthetic_checkpoint

    workdir = tmp_path_factory.mktemp("lora") / "run"
    base = synthetic_checkpoint("llama", size="smoke")
    records = _run(workdir, base, 2)
    assert [r["iteration"] for r in records] == [0, 1]
    assert set(records[-1]["policy_version"].values()) == {2}
    records = _run(workdir, base, 3)  # resumes from the adapters it saved
    assert records[-1]["iteration"] == 2 and set(records[-1]["policy_version"].values()) == {3}
    return workdir, base


@pytest.mark.timeout(600)
def test_adapter_checkpoints_hold_the_adapter_and_name_the_base(trained):
    """A LoRA agent's checkpoint is its adapter and optimizer state: a few percent of the full fine-tune's
    beside it; the restored policy is the base with that adapter merged, moved by training; restored unmerged,
    the same adapter without the base."""
    from flexmarl_jax.models.sources import weights_digest
    from flexmarl_jax.train.checkpoint import restore_policy

    workdir, base = trained
    root = os.path.join(workdir, "checkpoints")
    solver, corrector = (_bytes(os.path.join(root, name, "3")) for name in ("solver", "corrector"))
    assert solver < 0.25 * corrector, (solver, corrector)
    snapshot = restore_policy(os.path.join(root, "solver"))
    assert snapshot.policy_version == 3 and snapshot.lora.rank == 8
    assert snapshot.base == {"model": os.path.abspath(base), "sha256": weights_digest(base), "dtype": "float32"}
    assert float(jnp.max(jnp.abs(snapshot.adapters["q_proj"]["b"]))) > 0
    verifier = restore_policy(os.path.join(root, "verifier"))
    assert sorted(verifier.adapters) == ["q_proj", "v_proj"] and verifier.lora.rank == 4
    unmerged = restore_policy(os.path.join(root, "solver"), merged=False)  # what a group's serving engine reads
    assert unmerged.params is None and unmerged.base == snapshot.base and unmerged.lora == snapshot.lora
    for ours, merged_read in zip(jax.tree.leaves(unmerged.adapters), jax.tree.leaves(snapshot.adapters), strict=True):
        assert np.array_equal(np.asarray(ours), np.asarray(merged_read))


@pytest.mark.timeout(600)
def test_peft_and_merged_exports_reload_with_the_runs_logits(trained, tmp_path):
    """`flexmarl export --format peft` loads with peft on the base and `--format merged` with transformers;
    both give the logits of our restored policy (1e-4); peft is refused for the full fine-tune."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from flexmarl_jax.models import functional
    from flexmarl_jax.train.checkpoint import restore_policy

    workdir, base = trained
    merged_dir, peft_dir = tmp_path / "merged", tmp_path / "peft"
    assert main(["export", str(workdir), "--agent", "solver", "--out", str(merged_dir)]) == 0
    assert main(["export", str(workdir), "--agent", "solver", "--out", str(peft_dir), "--format", "peft"]) == 0
    assert sorted(os.listdir(peft_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert main(["export", str(workdir), "--agent", "corrector", "--out", str(tmp_path / "x"),
                 "--format", "peft"]) == 2
    assert not (tmp_path / "x").exists()

    snapshot = restore_policy(os.path.join(workdir, "checkpoints", "solver"))
    tokens = np.random.default_rng(0).integers(3, 1500, (2, 11))
    positions = jnp.broadcast_to(jnp.arange(11, dtype=jnp.int32), (2, 11))
    ours = np.asarray(functional.forward(snapshot.graphdef, snapshot.params, jnp.asarray(tokens, jnp.int32),
                                         positions, jnp.ones((2, 11), bool)))
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
        from_merged = merged(torch.as_tensor(tokens)).logits.numpy()
        bare = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        adapted = peft.PeftModel.from_pretrained(bare, peft_dir).eval()
        from_peft = adapted(torch.as_tensor(tokens)).logits.numpy()
    assert np.max(np.abs(from_merged - ours)) < 1e-4
    assert np.max(np.abs(from_peft - ours)) < 1e-4
    assert jax.tree.leaves(snapshot.adapters)  # not the base alone


@pytest.mark.timeout(600)
def test_serve_puts_a_base_group_on_one_engine_that_decodes_each_agents_merged_weights(trained):
    """`flexmarl serve --api openai`'s loader: solver and verifier (one base) share one engine, the corrector has
    its own; greedy through the shared engine, each agent decodes what its merged weights decode."""
    from flexmarl_jax.rollout.engine import FlexEngine, SlotSampling
    from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest
    from flexmarl_jax.serve.openai_server import load_served_models
    from flexmarl_jax.serve.served_agent import load_agent

    workdir, _ = trained
    models = load_served_models(str(workdir), slots=4, max_new_tokens=8, announce=lambda line: None)
    try:
        solver, verifier, corrector = (models.models[name] for name in ("solver", "verifier", "corrector"))
        assert solver.instance is verifier.instance and solver.instance.adapter_agents == ("solver", "verifier")
        assert corrector.instance is not solver.instance and corrector.instance.adapter_agents == ()
        prompts = [tuple(solver.tokenizer.encode(text)) for text in ("What is 3 + 4?", "Name a prime.")]
        for model in (solver, verifier):
            done = []
            for prompt in prompts:
                model.instance.submit(RolloutRequest(prompt, sampling=SlotSampling(), max_new_tokens=8,
                                                     agent=model.name, on_done=done.append))
            deadline = time.monotonic() + 300
            while len(done) < len(prompts):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            served = sorted(done, key=lambda samples: prompts.index(samples[0].prompt_ids))
            agent = load_agent(str(workdir), model.name)
            engine = FlexEngine(agent.model_config, agent.graphdef, model.instance.engine.config, agent.tokenizer,
                                params=agent.params)
            plain = RolloutLoop(engine, agent.params).generate(
                [RolloutRequest(prompt, sampling=SlotSampling(), max_new_tokens=8) for prompt in prompts])
            assert [s[0].token_ids for s in served] == [s[0].token_ids for s in plain], model.name
    finally:
        models.stop()
