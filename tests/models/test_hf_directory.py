"""inspect_checkpoint_dir: reads config and tokenizer without the weights; bad directories fail in one line."""

import json
import os
import shutil

import pytest

from flexmarl_jax.models.checkpoint import read_hf_config
from flexmarl_jax.models.hf_directory import inspect_checkpoint_dir, is_checkpoint_dir


@pytest.fixture
def checkpoint(synthetic_dirs, tmp_path):
    """A copy of the Llama fixture that a test may break."""
    return shutil.copytree(synthetic_dirs["llama"], tmp_path / "llama")


def _edit_json(path, **changes):
    value = json.loads(path.read_text())
    value.update(changes)
    path.write_text(json.dumps(value))


def _one_line_error(directory, file_name) -> str:
    with pytest.raises(ValueError) as error:
        inspect_checkpoint_dir(directory)
    message = str(error.value)
    assert "\n" not in message and os.path.join(str(directory), file_name).rstrip("/") in message, message
    return message


def test_inspect_reads_shape_tokenizer_and_generation_config(synthetic_dirs):
    for name, directory in synthetic_dirs.items():
        info = inspect_checkpoint_dir(directory)
        assert info.path == os.path.abspath(directory)
        assert info.model_config == read_hf_config(directory)
        assert info.tokenizer.stop_ids == tuple(info.generation["eos_token_id"]), name
        assert info.tokenizer.chat_template is not None
        assert info.tokenizer.max_token_id() < info.model_config.vocab_size


def test_inspect_never_reads_the_weights(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"not a safetensors file")
    info = inspect_checkpoint_dir(checkpoint)
    assert info.model_config.architecture == "LlamaForCausalLM"


def test_directory_without_tokenizer_files(checkpoint):
    (checkpoint / "tokenizer.json").unlink()
    message = _one_line_error(checkpoint, "tokenizer.json")
    assert "only tokenizer_config.json is there" in message
    (checkpoint / "tokenizer_config.json").unlink()
    assert "no tokenizer.json or tokenizer_config.json" in _one_line_error(checkpoint, "tokenizer.json")


def test_unsupported_architecture(checkpoint):
    _edit_json(checkpoint / "config.json", architectures=["MixtralForCausalLM"])
    message = _one_line_error(checkpoint, "config.json")
    assert "architecture 'MixtralForCausalLM' is not supported" in message and "LlamaForCausalLM" in message


def test_config_without_a_needed_field(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    del config["num_attention_heads"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert "lacks the field 'num_attention_heads'" in _one_line_error(checkpoint, "config.json")
    (checkpoint / "config.json").write_text("{ not json")
    assert "is not valid JSON" in _one_line_error(checkpoint, "config.json")
    (checkpoint / "config.json").unlink()
    assert "is missing" in _one_line_error(checkpoint, "config.json")


def test_tokenizer_larger_than_the_embedding(checkpoint):
    largest = inspect_checkpoint_dir(checkpoint).tokenizer.max_token_id()
    _edit_json(checkpoint / "config.json", vocab_size=largest + 1)
    inspect_checkpoint_dir(checkpoint)  # exactly fits
    _edit_json(checkpoint / "config.json", vocab_size=largest)
    message = _one_line_error(checkpoint, "tokenizer.json")
    assert f"token id {largest}, but config.json vocab_size={largest}" in message


def test_stop_id_outside_the_embedding(checkpoint):
    vocab_size = read_hf_config(checkpoint).vocab_size
    _edit_json(checkpoint / "generation_config.json", eos_token_id=[4, vocab_size + 7])
    message = _one_line_error(checkpoint, "generation_config.json")
    assert f"eos_token_id [{vocab_size + 7}]" in message


def test_no_weight_files(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    assert "has no *.safetensors weight files" in _one_line_error(checkpoint, "")
    (checkpoint / "pytorch_model.bin").write_bytes(b"")
    assert "found ['pytorch_model.bin']: convert them to safetensors" in _one_line_error(checkpoint, "")


def test_index_naming_absent_weight_files(checkpoint):
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    message = _one_line_error(checkpoint, "model.safetensors.index.json")
    assert "['model-00002-of-00002.safetensors']" in message


def test_missing_directory(tmp_path):
    assert "does not exist" in _one_line_error(tmp_path / "nowhere", "")


def test_is_checkpoint_dir(synthetic_dirs, tmp_path):
    assert is_checkpoint_dir(synthetic_dirs["qwen2"])
    assert not is_checkpoint_dir("tiny")  # a preset name
    assert not is_checkpoint_dir(tmp_path)  # a directory without config.json
    assert not is_checkpoint_dir(os.path.join(synthetic_dirs["qwen2"], "config.json"))
