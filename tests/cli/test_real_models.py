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

import pytest

from flexmarl_jax.cli.main import main
from flexmarl_jax.mesh.host_devices import without_fake_cpu_devices

SMOKE_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "data", "gsm8k_smoke.jsonl")
SMALL_RUN = ("--config.iterations=2", "--config.workflow.queries_per_iteration=2",
             "--config.workflow.samples_per_query=4", "--config.train.micro_batch_size=8",
             "--config.workflow.warmup_steps=0", "--config.rollout.max_prompt_length=192",
             "--config.rollout.max_response_length=16", "--config.rollout.decode_slots=8",
             f"--config.workflow.task={SMOKE_DATA}", "--config.workflow.task_options.jsonl.verifier=math",
             "--config.eval.problems=2", "--config.eval.samples=2")


def _iterations(lines) -> list[dict]:
    """The training iterations' records of metrics.jsonl lines (held-out eval records left out)."""
    return [record for record in map(json.loads, lines) if record.get("kind", "iteration") == "iteration"]


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
        return _iterations(handle)


def _prompts(workdir, agent: str, checkpoint: str) -> list[str]:
    """The prompts `agent` was sent, as its own tokenizer reads the stored prompt ids (special tokens kept)."""
    from tokenizers import Tokenizer

    from flexmarl_jax.store import ExperienceStore

    vocabulary = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
    store = ExperienceStore.open(str(workdir), backend="file", must_exist=True)
    try:
        rows = store.read_rows(agent, columns=["prompt_tokens"])["prompt_tokens"]
    finally:
        store.close()
    return [vocabulary.decode([int(t) for t in ids], skip_special_tokens=False) for ids in rows]


def _assert_trained(records: list[dict], agents: set[str], called: set[str] | None = None) -> None:
    """Two iterations, every agent updated twice, and every agent in `called` (default all) was called."""
    assert [r["iteration"] for r in records] == [0, 1]
    assert set(records[-1]["policy_version"]) == agents and set(records[-1]["policy_version"].values()) == {2}
    assert all(0.0 <= r["team_accuracy"] <= 1.0 for r in records)
    for agent in agents if called is None else called:
        assert sum(r["agent"][agent]["requests"] for r in records) > 0, agent


@pytest.mark.timeout(420)
def test_chain_of_three_architectures_with_two_tokenizers(tmp_path, checkpoints):
    """Qwen2 solver, Qwen3 verifier, Llama corrector: each architecture trains as an agent, and the team
    mixes two tokenizers and chat templates; chat prompts go out because every agent is a chat checkpoint."""
    records = _train(tmp_path, "configs/tiny.py",
                     f"--config.agents.solver.model={checkpoints['qwen2']}",
                     f"--config.agents.verifier.model={checkpoints['qwen3']}",
                     f"--config.agents.corrector.model={checkpoints['llama']}",
                     "--config.workflow.options.corrector_runs=always", "--config.store.backend=file")
    _assert_trained(records, {"solver", "verifier", "corrector"})
    # Each agent's prompts are its own chat template's rendering of natural-language role prompts.
    solver = _prompts(tmp_path, "solver", checkpoints["qwen2"])
    corrector = _prompts(tmp_path, "corrector", checkpoints["llama"])
    assert solver and all(p.startswith("<|im_start|>system\n") and p.endswith("<|im_start|>assistant\n")
                          for p in solver)
    assert corrector and all(p.startswith("<|begin_of_text|><|start_header_id|>system") and "Verifier's judgement"
                             in p for p in corrector)


@pytest.mark.timeout(420)
def test_debate_between_two_architectures_with_two_tokenizers(tmp_path, checkpoints):
    """Plain prompts this time, so the supervised format warm-up runs: its updates move every checkpoint's
    weights. (Random weights never answer right, so RL's group advantages, and its updates, are zero.)"""
    plain = tmp_path / "plain_debate.py"  # configs/debate.py with workflow.options.chat=False
    plain.write_text("from flexmarl_jax.configs import debate\n\n\ndef get_config(variant=None):\n"
                     "    config = debate.get_config(variant)\n    config.workflow.options.chat = False\n"
                     "    return config\n")
    records = _train(tmp_path / "run", str(plain),
                     f"--config.agents.debater0.model={checkpoints['qwen2']}",
                     f"--config.agents.debater1.model={checkpoints['llama']}",
                     f"--config.agents.debater2.model={checkpoints['qwen3']}", "--config.workflow.warmup_steps=3")
    _assert_trained(records, {"debater0", "debater1", "debater2"})
    import jax

    from flexmarl_jax.models.checkpoint import from_pretrained
    from flexmarl_jax.train.checkpoint import restore_policy

    for agent, arch in (("debater0", "qwen2"), ("debater1", "llama"), ("debater2", "qwen3")):
        trained = restore_policy(tmp_path / "run" / "checkpoints" / agent)
        source = from_pretrained(checkpoints[arch])
        assert trained.policy_version == 2 and trained.model_config == source.config
        moved = max(float(abs(a - b).max()) for a, b in zip(jax.tree.leaves(trained.params),
                                                            jax.tree.leaves(source.params), strict=True))
        assert moved > 1e-4, (agent, moved)


def _copy_without(source: str, target, *drop: str) -> str:
    import shutil

    shutil.copytree(source, target, ignore=shutil.ignore_patterns(*drop))
    return str(target)


def _edit_json(path, **changes) -> None:
    with open(path) as handle:
        value = json.load(handle)
    value.update(changes)
    with open(path, "w") as handle:
        json.dump(value, handle)


BAD_INPUTS = ("no_tokenizer", "architecture", "vocabulary", "no_answer", "long_prompt", "memory")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line_naming_the_file_or_field_and_nothing_is_written(tmp_path, checkpoints, case, capsys):
    qwen = checkpoints["qwen2"]
    model, extra, expected = qwen, [], ""
    if case == "no_tokenizer":
        model = _copy_without(qwen, tmp_path / "ckpt", "tokenizer.json", "tokenizer_config.json")
        expected = "tokenizer"
    elif case == "architecture":
        model = _copy_without(qwen, tmp_path / "ckpt")
        _edit_json(os.path.join(model, "config.json"), architectures=["MistralForCausalLM"], model_type="mistral")
        expected = "MistralForCausalLM"
    elif case == "vocabulary":
        model = _copy_without(qwen, tmp_path / "ckpt")
        _edit_json(os.path.join(model, "config.json"), vocab_size=1024)  # the tokenizer has 2000 ids
        expected = "vocab"
    elif case == "no_answer":
        data = tmp_path / "broken.jsonl"
        data.write_text('{"question": "What is 1 + 1?", "answer": "1 + 1 = 2\\n#### 2"}\n{"question": "And 2 + 2?"}\n')
        extra, expected = [f"--config.workflow.task={data}"], "broken.jsonl:2"
    elif case == "long_prompt":
        extra, expected = ["--config.rollout.max_prompt_length=24"], "max_prompt_length=24"
    elif case == "memory":  # a 14B solver in float32 with Adam: ~200 GiB against this host's RAM
        extra, expected = ["--config.agents.solver.model=qwen2.5-14b"], "config.agents.solver (qwen2.5-14b, float32)"
    workdir = tmp_path / "run"
    code = main(["train", "--config=configs/tiny.py", f"--workdir={workdir}", *SMALL_RUN,
                 *(f"--config.agents.{agent}.model={model}" for agent in ("solver", "verifier", "corrector")),
                 *extra])
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1 and expected in error, error
    assert ("ckpt" in error) == (case in ("no_tokenizer", "architecture", "vocabulary")), error
    assert not workdir.exists()


@pytest.mark.timeout(420)
def test_cpu_smoke_recipe_trains_and_its_agents_export_to_transformers(tmp_path):
    """What CI runs of the recipe: `flexmarl train --config=configs/gsm8k_chain.py:cpu_smoke` (2 iterations on
    synthetic Qwen2 checkpoints of two sizes, GSM8K-format data, chat prompts), then `flexmarl export`."""
    workdir = tmp_path / "run"
    assert main(["train", "--config=configs/gsm8k_chain.py:cpu_smoke", f"--workdir={workdir}"]) == 0
    with open(workdir / "metrics.jsonl") as handle:
        records = _iterations(handle)
    # (random weights rarely say "No", and the corrector runs only then)
    _assert_trained(records, {"solver", "verifier", "corrector"}, called={"solver", "verifier"})
    out = tmp_path / "solver-hf"
    assert main(["export", str(workdir), "--agent", "solver", "--out", str(out)]) == 0
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.timeout(420)
def test_cpu_smoke_recipe_on_one_colocated_device(tmp_path):
    """mesh.colocate: the whole team (rollout and training of three agents) on one CPU device. A child process,
    since this process already has 8 fake devices."""
    env = without_fake_cpu_devices(os.environ)
    done = subprocess.run([sys.executable, "-m", "flexmarl_jax.cli.main", "train",
                           "--config=configs/gsm8k_chain.py:cpu_smoke", f"--workdir={tmp_path / 'run'}",
                           "--config.mesh.fake_cpu_devices=1", "--config.mesh.colocate=True"],
                          env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "run" / "metrics.jsonl") as handle:
        records = _iterations(handle)
    assert [r["iteration"] for r in records] == [0, 1]
    assert set(records[-1]["policy_version"].values()) == {2}
    with open(tmp_path / "run" / "config.json") as handle:
        config = json.load(handle)
    assert config["mesh"]["fake_cpu_devices"] == 1 and config["mesh"]["colocate"] is True
