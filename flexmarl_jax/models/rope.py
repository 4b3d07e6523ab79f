"""Rotary position embeddings (non-interleaved halves, as in HF Llama/Qwen2), with Llama-3 scaling."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from flexmarl_jax.models.config import ModelConfig


def rope_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] float32, after the configured scaling.

    Computed in float32 like the reference implementation so that angles agree to the ulp.
    """
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = np.float32(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return (inv_freq / factor).astype(np.float32)
    # "llama3": long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly (the published Llama 3.1 recipe).
    low_factor = np.float32(scaling["low_freq_factor"])
    high_factor = np.float32(scaling["high_freq_factor"])
    original_context = np.float32(scaling["original_max_position_embeddings"])
    low_freq_wavelen = original_context / low_factor
    high_freq_wavelen = original_context / high_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_factor) / (high_factor - low_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
    """Rotates `x` [batch, seq, heads, head_dim] by `positions` [batch, seq]; same dtype out."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
