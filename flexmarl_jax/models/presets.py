"""Named model shapes selectable from configs (pure Python, no JAX import).

"tiny" and "small" are randomly initialised models for this CPU: their vocabulary is exactly the
`CharTokenizer` one (104 ids). The Qwen2.5 presets copy the published shapes (config.json of
Qwen/Qwen2.5-{0.5B,1.5B,7B,14B,32B}) for accelerator users; load real weights with `from_pretrained`.
"""

from __future__ import annotations

from flexmarl_jax.models.config import ModelConfig

CHAR_VOCAB_SIZE = 104  # == CharTokenizer().vocab_size (checked by tests/models/test_presets.py)

PRESETS: dict[str, ModelConfig] = {
    # ~0.1M parameters: a few agents train with RL on a 2-core CPU in minutes.
    "tiny": ModelConfig(
        vocab_size=CHAR_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=192,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qkv_bias=True,
        max_position_embeddings=512,
        architecture="Qwen2ForCausalLM",
    ),
    # ~0.8M parameters: for longer CPU runs that need more capacity.
    "small": ModelConfig(
        vocab_size=CHAR_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qkv_bias=True,
        max_position_embeddings=1024,
        architecture="Qwen2ForCausalLM",
    ),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qkv_bias=True,
        max_position_embeddings=32768,
    ),
    "qwen2.5-1.5b": ModelConfig(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qkv_bias=True,
        max_position_embeddings=32768,
    ),
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qkv_bias=True,
        max_position_embeddings=32768,
    ),
    "qwen2.5-14b": ModelConfig(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=13824,
        num_layers=48,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        qkv_bias=True,
        max_position_embeddings=32768,
    ),
    # The largest shape the FlexMARL paper trains (its coding-agent team); used by the emulated benches.
    "qwen2.5-32b": ModelConfig(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        qkv_bias=True,
        max_position_embeddings=32768,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """Returns the preset called `name`; ValueError naming the allowed names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; allowed: {sorted(PRESETS)}") from None
