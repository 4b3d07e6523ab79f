"""Fixture checkpoints: transformers loads them with our logits and token ids; files are deterministic."""

import importlib.util
import json
import os
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer

from flexmarl_benchmarks.parity import hf_logits, masked_max_abs_diff, our_logits, padded_batch
from flexmarl_jax.models import synthetic
from flexmarl_jax.models.checkpoint import from_pretrained, read_hf_config
from flexmarl_jax.models.tokenizer import HFTokenizer

ARCHITECTURES = ("qwen2", "qwen3", "llama")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_transformers_loads_each_fixture_with_our_logits(arch, synthetic_dirs):
    model = from_pretrained(synthetic_dirs[arch])
    tokens, mask, positions = padded_batch(model.config.vocab_size, (7, 33, 48))
    ours = our_logits(model.graphdef, model.params, tokens, mask, positions)
    theirs = hf_logits(synthetic_dirs[arch], tokens, mask, positions)
    assert masked_max_abs_diff(ours, theirs, mask) < 1e-4
    assert np.abs(theirs[mask]).max() > 0.5  # not a comparison of near-zero logits


def test_fixture_shapes_carry_each_family_and_fit_the_tokenizer(synthetic_dirs):
    configs = {arch: read_hf_config(synthetic_dirs[arch]) for arch in ARCHITECTURES}
    assert configs["qwen2"].qkv_bias and configs["qwen2"].tie_word_embeddings
    assert configs["qwen3"].qk_norm and configs["qwen3"].head_dim * configs["qwen3"].num_heads != 128
    assert not configs["llama"].tie_word_embeddings and configs["llama"].rope_scaling["rope_type"] == "llama3"
    for arch, config in configs.items():
        assert 5e5 < config.num_params() < 5e6, (arch, config.num_params())
        tokenizer = HFTokenizer(synthetic_dirs[arch])
        # the embedding is the tokenizer padded up to a multiple of 128: real checkpoints have unused rows too
        assert config.vocab_size % 128 == 0 and 0 <= config.vocab_size - tokenizer.vocab_size < 128
    assert (configs["qwen2"].vocab_size, configs["llama"].vocab_size) == (2048, 2560)


def test_qwen_families_share_a_tokenizer_and_llama_has_its_own(synthetic_dirs):
    def text(arch, name):
        return pathlib.Path(synthetic_dirs[arch], name).read_text()

    assert text("qwen2", "tokenizer.json") == text("qwen3", "tokenizer.json")  # different seeds, one tokenizer
    qwen, llama = HFTokenizer(synthetic_dirs["qwen2"]), HFTokenizer(synthetic_dirs["llama"])
    assert (qwen.vocab_size, llama.vocab_size) == (2000, 2500)
    assert qwen.bos_id is None and llama.bos_id is not None
    assert qwen.encode("The answer is 42.") != llama.encode("The answer is 42.")
    # a sampler may pick embedding rows no token uses (ids 2000..2047): decoding drops them
    assert qwen.decode(qwen.encode("The answer is 42.", add_bos=False) + [2000, 2047]) == "The answer is 42."


def test_generation_config_lists_every_stop_id(synthetic_dirs):
    for arch in ARCHITECTURES:
        generation = json.loads(pathlib.Path(synthetic_dirs[arch], "generation_config.json").read_text())
        tokenizer = HFTokenizer(synthetic_dirs[arch])
        assert isinstance(generation["eos_token_id"], list) and len(generation["eos_token_id"]) == 2
        assert tokenizer.stop_ids == tuple(generation["eos_token_id"])
        end_of_turn = "<|im_end|>" if arch != "llama" else "<|eot_id|>"
        raw = RawTokenizer.from_file(os.path.join(synthetic_dirs[arch], "tokenizer.json"))
        assert raw.id_to_token(tokenizer.eos_id) == end_of_turn and tokenizer.decode([tokenizer.eos_id]) == ""


# Pieces that stress merges, digits, whitespace runs and special tokens inside ordinary text.
_PIECES = ["Ava", " has", " 12", " apples", ".", "\n", "<|im_end|>", "<|eot_id|>", "  ", "The answer is"]


@settings(max_examples=30, deadline=None)
@given(text=st.one_of(st.text(max_size=80), st.lists(st.sampled_from(_PIECES)).map("".join)))
def test_our_token_ids_equal_transformers(text, synthetic_dirs, auto_tokenizers):
    for arch in ("qwen2", "llama"):
        theirs = auto_tokenizers[arch]
        ours = HFTokenizer(synthetic_dirs[arch])
        # with special tokens: transformers adds Llama's BOS through the tokenizer's post-processor, we prepend it
        assert ours.encode(text) == theirs(text)["input_ids"]
        ids = ours.encode(text, add_bos=False)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    first = synthetic.make_checkpoint(tmp_path / "a", "qwen3", seed=5)
    synthetic.trained_tokenizer_json.cache_clear()  # the tokenizer is trained again, not taken from the cache
    again = synthetic.make_checkpoint(tmp_path / "b", "qwen3", seed=5)
    other = synthetic.make_checkpoint(tmp_path / "c", "qwen3", seed=6)
    names = sorted(os.listdir(first))
    assert names == sorted(os.listdir(again)) == sorted(os.listdir(other))
    for name in names:
        assert pathlib.Path(first, name).read_bytes() == pathlib.Path(again, name).read_bytes(), name
    assert (
        pathlib.Path(first, "model.safetensors").read_bytes() != pathlib.Path(other, "model.safetensors").read_bytes()
    )
    assert pathlib.Path(first, "tokenizer.json").read_bytes() == pathlib.Path(other, "tokenizer.json").read_bytes()


def test_vocab_size_gives_a_different_tokenizer_and_embedding(tmp_path):
    directory = synthetic.make_checkpoint(tmp_path / "m", "qwen2", vocab_size=1200)
    assert HFTokenizer(directory).vocab_size == 1200 and read_hf_config(directory).vocab_size == 1280


def test_make_checkpoint_refuses_bad_requests_and_writes_nothing(tmp_path):
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="already exists and is not an empty directory"):
        synthetic.make_checkpoint(occupied, "qwen2")
    with pytest.raises(
        ValueError, match="architecture='gpt2' has no fixture; allowed: \\['llama', 'qwen2', 'qwen3'\\]"
    ):
        synthetic.make_checkpoint(tmp_path / "a", "gpt2")
    with pytest.raises(ValueError, match="size='huge' is not a fixture size"):
        synthetic.make_checkpoint(tmp_path / "b", "qwen2", size="huge")
    with pytest.raises(ValueError, match="vocab_size=100 must be >= 512"):
        synthetic.make_checkpoint(tmp_path / "c", "qwen2", vocab_size=100)
    assert sorted(os.listdir(tmp_path)) == ["occupied"] and os.listdir(occupied) == ["keep.txt"]


def test_command_line_writes_a_checkpoint_with_a_template_file(tmp_path, capsys):
    script = pathlib.Path(__file__).parents[1] / "fixtures" / "make_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_checkpoint_cli", script)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out = tmp_path / "cli"
    assert cli.main([str(out), "--arch", "llama", "--seed", "3", "--chat-template-file", "--size", "small"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert (out / "chat_template.jinja").read_text() == synthetic.HEADER_TEMPLATE
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    config = read_hf_config(out)
    assert (config.hidden_size, config.num_layers, config.architecture) == (256, 4, "LlamaForCausalLM")
    assert 2e6 < config.num_params() < 6e6
