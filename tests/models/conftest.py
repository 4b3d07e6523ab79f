"""Shared fixtures for the model tests: tiny random transformers checkpoints, loaded once per session."""

import pytest


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """{"qwen2"|"llama"|"qwen3": dir}: tiny random transformers models saved with save_pretrained."""
    from flexmarl_benchmarks.parity import build_hf_checkpoint

    root = tmp_path_factory.mktemp("hf")
    return {
        kind: build_hf_checkpoint(kind, str(root / kind), seed=i)
        for i, kind in enumerate(("qwen2", "llama", "qwen3"))
    }


@pytest.fixture(scope="session")
def loaded(hf_dirs):
    """{kind: Pretrained} loaded by our from_pretrained (float32, unsharded)."""
    from flexmarl_jax.models.checkpoint import from_pretrained

    return {kind: from_pretrained(directory) for kind, directory in hf_dirs.items()}


@pytest.fixture(scope="session")
def synthetic_dirs(tmp_path_factory):
    """{"qwen2"|"qwen3"|"llama": dir} made by `synthetic.make_checkpoint` (templates in tokenizer_config.json),
    plus "llama_jinja": the Llama one with its template in chat_template.jinja."""
    from flexmarl_jax.models.synthetic import make_checkpoint

    root = tmp_path_factory.mktemp("synthetic")
    dirs = {arch: make_checkpoint(root / arch, arch, seed=i) for i, arch in enumerate(("qwen2", "qwen3", "llama"))}
    dirs["llama_jinja"] = make_checkpoint(root / "llama_jinja", "llama", seed=2, chat_template_file=True)
    return dirs


@pytest.fixture(scope="session")
def auto_tokenizers(synthetic_dirs):
    """{name: transformers AutoTokenizer} for each of `synthetic_dirs`."""
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(directory) for name, directory in synthetic_dirs.items()}
