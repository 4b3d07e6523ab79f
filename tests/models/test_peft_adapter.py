"""LoRA adapters leave in PEFT's format and as merged weights (models/peft_adapter.py, models/lora.py):
transformers (+ peft) reload both with the logits of our adapted model, and the PEFT directory reads back."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexmarl_jax.models import functional as F
from flexmarl_jax.models import lora
from flexmarl_jax.models.checkpoint import from_pretrained, save_pretrained
from flexmarl_jax.models.peft_adapter import load_peft_adapter, save_peft_adapter
from tests.settings_views import lora_spec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SPEC = lora_spec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def llama(synthetic_dirs):
    """(checkpoint directory, our Pretrained, a trained-looking adapter) on the synthetic Llama."""
    directory = synthetic_dirs["llama"]
    model = from_pretrained(directory)
    adapter = lora.init_adapters(model.config, SPEC, seed=0)
    key = jax.random.key(1)
    adapter = {target: {"a": pair["a"], "b": 0.2 * jax.random.normal(jax.random.fold_in(key, i), pair["b"].shape)}
               for i, (target, pair) in enumerate(sorted(adapter.items()))}
    return directory, model, adapter


def _tokens(config, batch=2, length=9):
    return np.random.default_rng(0).integers(3, config.vocab_size - 200, (batch, length))


def _ours(model, adapter, tokens):
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    adapters = None if adapter is None else lora.stack_adapters([adapter], [SPEC])
    return np.asarray(F.forward(model.graphdef, model.params, jnp.asarray(tokens, jnp.int32), positions,
                                jnp.ones((batch, length), bool), adapters=adapters))


def _theirs(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.as_tensor(tokens)).logits.float().numpy()


def test_peft_loads_our_adapter_with_our_logits(llama, tmp_path):
    directory, model, adapter = llama
    out = save_peft_adapter(adapter, SPEC, tmp_path / "adapter", base_model=directory)
    with open(os.path.join(out, "adapter_config.json")) as handle:
        settings = json.load(handle)
    assert settings["r"] == 4 and settings["lora_alpha"] == 8.0 and len(settings["target_modules"]) == 7
    base = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, out).eval()
    tokens = _tokens(model.config)
    ours = _ours(model, adapter, tokens)
    theirs = _theirs(adapted, tokens)
    assert np.abs(ours - _ours(model, None, tokens)).max() > 1e-2  # the adapter changes the logits
    assert np.abs(ours - theirs).max() < 1e-4


def test_merged_export_reloads_in_transformers_with_our_logits(llama, tmp_path):
    _, model, adapter = llama
    merged = lora.merge_adapter(model.params, adapter, SPEC)
    save_pretrained((model.graphdef, merged), tmp_path / "merged")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    tokens = _tokens(model.config, batch=3)
    assert np.abs(_ours(model, adapter, tokens) - _theirs(reloaded, tokens)).max() < 1e-4


def test_a_peft_directory_reads_back_exactly(llama, tmp_path):
    _, model, adapter = llama
    out = save_peft_adapter(adapter, SPEC, tmp_path / "adapter")
    loaded, spec = load_peft_adapter(out, model.config)
    assert spec == SPEC
    for target in adapter:
        for name in ("a", "b"):
            np.testing.assert_array_equal(loaded[target][name], np.asarray(adapter[target][name]))


def test_an_adapter_peft_itself_saved_reads_with_peft_logits(llama, tmp_path):
    """The real use: an adapter made and saved by PEFT (`get_peft_model(...).save_pretrained`)."""
    directory, model, _ = llama
    base = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    settings = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"],
                               lora_dropout=0.0, task_type="CAUSAL_LM")
    adapted = peft.get_peft_model(base, settings)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero; a trained adapter's is not
                parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))
    adapted.save_pretrained(tmp_path / "theirs")
    loaded, spec = load_peft_adapter(tmp_path / "theirs", model.config)
    assert spec == lora.LoraSpec(rank=4, alpha=12.0, targets=("q_proj", "v_proj", "down_proj"))
    tokens = _tokens(model.config)
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    ours = np.asarray(F.forward(model.graphdef, model.params, jnp.asarray(tokens, jnp.int32), positions,
                                jnp.ones((batch, length), bool), adapters=lora.stack_adapters([loaded], [spec])))
    theirs = _theirs(adapted.eval(), tokens)
    assert np.abs(ours - _ours(model, None, tokens)).max() > 1e-2
    assert np.abs(ours - theirs).max() < 1e-4


@pytest.mark.parametrize("change, message", [
    ({"bias": "all"}, "bias='all'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"alpha_pattern": {"q_proj": 32}}, "alpha_pattern"),
    ({"peft_type": "IA3"}, "peft_type='IA3'"),
    ({"use_rslora": True}, "rslora"),
    ({"target_modules": "all-linear"}, "target_modules='all-linear'"),
])
def test_adapters_this_model_cannot_take_are_refused_naming_the_field(llama, tmp_path, change, message):
    _, model, adapter = llama
    out = save_peft_adapter(adapter, SPEC, tmp_path / "adapter")
    path = os.path.join(out, "adapter_config.json")
    with open(path) as handle:
        settings = json.load(handle)
    with open(path, "w") as handle:
        json.dump({**settings, **change}, handle)
    with pytest.raises(ValueError, match=message):
        load_peft_adapter(out, model.config)
