"""Shared fixtures for the model tests: tiny random transformers checkpoints, loaded once per session."""

import pytest


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """{"qwen2"|"llama"|"qwen3": dir}: tiny random transformers models saved with save_pretrained."""
    from flexmarl_jax.bench.parity import build_hf_checkpoint

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
