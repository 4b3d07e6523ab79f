"""HF import/export: parity with transformers, round trips, sharded files, bad input, bf16."""

import json
import os
import shutil
import weakref

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from flexmarl_benchmarks.parity import hf_logits, masked_max_abs_diff, our_logits, padded_batch
from flexmarl_jax.models import checkpoint
from flexmarl_jax.models.checkpoint import HF_NAME_TABLE, from_pretrained, hf_name, save_pretrained


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3"])
def test_logits_match_transformers_on_padded_batch(kind, hf_dirs, loaded):
    model = loaded[kind]
    tokens, mask, positions = padded_batch(model.config.vocab_size)
    assert not mask.all()  # really padded
    ours = our_logits(model.graphdef, model.params, tokens, mask, positions)
    theirs = hf_logits(hf_dirs[kind], tokens, mask, positions)
    assert masked_max_abs_diff(ours, theirs, mask) < 1e-4
    assert np.abs(theirs[mask]).max() > 0.5  # the comparison is not between near-zero logits


def test_loaded_configs_carry_the_family_features(loaded):
    qwen2, llama = loaded["qwen2"].config, loaded["llama"].config
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings and qwen2.rope_scaling is None
    assert not llama.qkv_bias and not llama.tie_word_embeddings
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rope_theta == 500000.0
    assert llama.num_heads == 2 * llama.num_kv_heads
    qwen3 = loaded["qwen3"].config
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim * qwen3.num_heads != qwen3.hidden_size


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_export_in_several_shards_loads_in_transformers_and_back(kind, loaded, tmp_path):
    model = loaded[kind]
    files = save_pretrained((model.graphdef, model.params), tmp_path, max_shard_bytes=64 * 1024)
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in index["weight_map"]

    tokens, mask, positions = padded_batch(model.config.vocab_size, seed=3)
    ours = our_logits(model.graphdef, model.params, tokens, mask, positions)
    assert masked_max_abs_diff(ours, hf_logits(str(tmp_path), tokens, mask, positions), mask) < 1e-4

    again = from_pretrained(tmp_path)
    assert again.config == model.config
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(again.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_single_file_bf16_round_trip_is_exact(loaded, tmp_path):
    model = loaded["llama"]
    bf16_params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.params)
    files = save_pretrained((model.graphdef, bf16_params), tmp_path)
    assert files == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    again = from_pretrained(tmp_path, dtype=jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(bf16_params), jax.tree.leaves(again.params), strict=True):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_bf16_parameters_give_float32_logits_close_to_float32(hf_dirs, loaded):
    low = from_pretrained(hf_dirs["qwen2"], dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(low.params)} == {jnp.dtype(jnp.bfloat16)}
    tokens, mask, positions = padded_batch(low.config.vocab_size)
    low_logits = our_logits(low.graphdef, low.params, tokens, mask, positions)
    high = our_logits(loaded["qwen2"].graphdef, loaded["qwen2"].params, tokens, mask, positions)
    assert low_logits.dtype == np.float32
    diff = masked_max_abs_diff(low_logits, high, mask)
    assert 0 < diff < 5e-2, diff  # bf16 really used, and still close


# dtype of our parameters -> (safetensors header code, torch dtype name, same-width int for bit compares)
_DTYPES = {
    "float32": ("F32", "float32", np.int32),
    "bfloat16": ("BF16", "bfloat16", np.int16),
    "float16": ("F16", "float16", np.int16),
}


@pytest.mark.parametrize("dtype", list(_DTYPES))
def test_every_dtype_is_written_and_read_back_bit_exactly(dtype, loaded, tmp_path):
    """Our export as seen by safetensors (numpy) and by torch, then our import: same bits."""
    import torch

    code, torch_name, int_type = _DTYPES[dtype]
    model = loaded["llama"]
    params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), model.params)
    save_pretrained((model.graphdef, params), tmp_path, max_shard_bytes=48 * 1024)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1

    expected = {}
    for our_path, variable in nnx.to_flat_state(params):
        name, layout = hf_name(our_path)
        expected[name] = checkpoint._to_hf(np.asarray(variable.get_value()), layout)
    assert set(weight_map) == set(expected) and len(expected) == 21
    for name, want in expected.items():
        file = str(tmp_path / weight_map[name])
        with safe_open(file, framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}
            assert f.get_slice(name).get_dtype() == code
            got = f.get_tensor(name)
        assert got.dtype == np.dtype(dtype) and got.shape == want.shape
        np.testing.assert_array_equal(got.view(int_type), np.ascontiguousarray(want).view(int_type))
        with safe_open(file, framework="pt") as f:
            theirs = f.get_tensor(name)
        assert theirs.dtype == getattr(torch, torch_name)
        np.testing.assert_array_equal(theirs.view(getattr(torch, int_type.__name__)).numpy(), got.view(int_type))

    again = from_pretrained(tmp_path, dtype=jnp.dtype(dtype))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again.params), strict=True):
        assert b.dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(a).view(int_type), np.asarray(b).view(int_type))


def test_every_bf16_bit_pattern_survives_the_library(tmp_path):
    """All 65536 bf16 bit patterns (signed zeros, subnormals, infinities, NaN payloads) come back."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    array = bits.view(ml_dtypes.bfloat16).reshape(256, 256)
    save_file({"all": array}, tmp_path / "all.safetensors")
    with safe_open(tmp_path / "all.safetensors", framework="numpy") as f:
        got = f.get_tensor("all")
    assert got.dtype == np.dtype(ml_dtypes.bfloat16) and got.shape == (256, 256)
    assert np.count_nonzero(got.view(np.uint16).reshape(-1) != bits) == 0
    assert np.isnan(got.astype(np.float32)).sum() == 2 * 127  # the 254 NaN patterns are all there


def test_import_reads_one_tensor_at_a_time_and_only_those_it_uses(hf_dirs, tmp_path, monkeypatch):
    """Shapes come from headers; each used tensor is read once and dropped before the next one."""
    directory = _copy_checkpoint(hf_dirs["llama"], tmp_path / "m")
    _rewrite_tensors(
        directory, lambda t: t.__setitem__("model.rotary_emb.inv_freq", np.ones(8, np.float32))
    )
    reads, alive_at_read = [], []
    returned: list[weakref.ref] = []

    class CountingFile:
        def __init__(self, *args, **kwargs):
            self._file = safe_open(*args, **kwargs)

        def __enter__(self):
            self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def keys(self):
            return self._file.keys()

        def get_slice(self, name):
            return self._file.get_slice(name)

        def get_tensor(self, name):
            alive_at_read.append(sum(ref() is not None for ref in returned))
            reads.append(name)
            array = self._file.get_tensor(name)
            returned.append(weakref.ref(array))
            return array

    monkeypatch.setattr(checkpoint, "safe_open", CountingFile)
    model = from_pretrained(directory)
    used = [hf_name(path)[0] for path, _ in nnx.to_flat_state(model.params)]
    assert sorted(reads) == sorted(used) and len(reads) == 21  # each once; inv_freq never read
    assert max(alive_at_read) == 0  # no earlier tensor still held when the next one is read


def test_index_naming_the_wrong_shard_is_reported(loaded, tmp_path):
    model = loaded["llama"]
    save_pretrained((model.graphdef, model.params), tmp_path, max_shard_bytes=64 * 1024)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.norm.weight"
    wrong = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = wrong
    index_path.write_text(json.dumps(index))
    message = f"'{name}' is listed in model.safetensors.index.json but missing from .*{wrong}"
    with pytest.raises(ValueError, match=message):
        from_pretrained(tmp_path)


def _copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(directory, **changes):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with open(path, "w") as f:
        json.dump(config, f)


def test_unsupported_architecture_is_named(hf_dirs, tmp_path):
    directory = _copy_checkpoint(hf_dirs["llama"], tmp_path / "m")
    _edit_config(directory, architectures=["MixtralForCausalLM"])
    with pytest.raises(ValueError, match="'MixtralForCausalLM' is not supported.*LlamaForCausalLM"):
        from_pretrained(directory)


def test_missing_architecture_is_reported(hf_dirs, tmp_path):
    directory = _copy_checkpoint(hf_dirs["llama"], tmp_path / "m")
    _edit_config(directory, architectures=None, model_type="gpt2")
    with pytest.raises(ValueError, match="names no architecture.*model_type='gpt2'"):
        from_pretrained(directory)


def _rewrite_tensors(directory, edit):
    path = os.path.join(directory, "model.safetensors")
    with safe_open(path, framework="numpy") as file:
        metadata = file.metadata()
        tensors = {name: file.get_tensor(name) for name in file.keys()}
    edit(tensors)
    save_file(tensors, path, metadata=metadata)


def test_wrong_tensor_shape_is_named(hf_dirs, tmp_path):
    directory = _copy_checkpoint(hf_dirs["llama"], tmp_path / "m")
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite_tensors(directory, lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(ValueError, match=rf"tensor '{name}' .* shape \[31, 64\], expected \[32, 64\]"):
        from_pretrained(directory)


def test_missing_and_unexpected_tensors_are_named(hf_dirs, tmp_path):
    missing = _copy_checkpoint(hf_dirs["llama"], tmp_path / "missing")
    _rewrite_tensors(missing, lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="lacks tensor 'model.layers.0.mlp.up_proj.weight'"):
        from_pretrained(missing)
    extra = _copy_checkpoint(hf_dirs["llama"], tmp_path / "extra")
    _rewrite_tensors(
        extra, lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.bias", np.zeros(64, np.float32))
    )
    with pytest.raises(ValueError, match="does not use: \\['model.layers.0.self_attn.o_proj.bias'\\]"):
        from_pretrained(extra)


def test_every_table_row_is_used_by_some_family(loaded):
    from flexmarl_jax.models.functional import abstract_model

    seen = set()
    for config in (model.config for model in loaded.values()):
        for path, _ in nnx.to_flat_state(abstract_model(config)[1]):
            seen.add(hf_name(path)[0].replace(".0.", ".{i}.").replace(".1.", ".{i}."))
    assert seen == {hf for _, hf, _ in HF_NAME_TABLE}
