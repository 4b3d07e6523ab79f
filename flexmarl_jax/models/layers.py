"""NNX building blocks of the decoder: Embed, RMSNorm, Attention (GQA), MLP (SwiGLU).

Every parameter carries `logical_axes` metadata (names from `flexmarl_jax.mesh.rules`), and
its attribute path matches one row of the HF name table in `checkpoint.py`.
Weights are stored head-structured ([embed, heads, head_dim]) so that tensor parallelism can split
heads without reshapes; the HF import/export reshapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flexmarl_jax.mesh.rules import with_logical_constraint
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.lora import project_with_adapter
from flexmarl_jax.models.projection import project
from flexmarl_jax.models.rope import apply_rope, rope_inverse_frequencies

_INIT_STDDEV = 0.02
# Large finite negative instead of -inf: a fully masked row (a padding query) then gives a
# uniform average instead of NaN, and its output is ignored anyway.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def normal_init(rngs: nnx.Rngs, shape, dtype):
    return (_INIT_STDDEV * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Embed(nnx.Module):
    """Token embedding table [vocab, embed]; also the LM head when embeddings are tied."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs):
        self.embedding = nnx.Param(
            normal_init(rngs, (vocab_size, hidden_size), dtype), logical_axes=("vocab", "embed")
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] int -> [B, T, E]. Ids outside [0, vocab) are clipped (never NaN)."""
        return jnp.take(self.embedding[...], tokens, axis=0, mode="clip")

    def attend(self, x: jax.Array) -> jax.Array:
        """x [B, T, E] -> logits [B, T, V] float32 (tied LM head)."""
        return project("bte,ve->btv", x, self.embedding[...], preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """RMS normalisation over the last axis, computed in float32, scaled after casting back."""

    def __init__(self, size: int, eps: float, *, dtype):
        self.scale = nnx.Param(jnp.ones((size,), dtype), logical_axes=("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * normed.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = nnx.Param(
            normal_init(rngs, (hidden_size, intermediate_size), dtype), logical_axes=("embed", "mlp")
        )
        self.up_proj = nnx.Param(
            normal_init(rngs, (hidden_size, intermediate_size), dtype), logical_axes=("embed", "mlp")
        )
        self.down_proj = nnx.Param(
            normal_init(rngs, (intermediate_size, hidden_size), dtype), logical_axes=("mlp", "embed")
        )

    def __call__(self, x: jax.Array, adapters=None) -> jax.Array:
        """x [B, T, E]; `adapters`: this layer's LoRA adapters by target (models/lora.py), or None."""
        adapters = adapters or {}
        gate = project_with_adapter("gate_proj", x, self.gate_proj[...], adapters.get("gate_proj"))
        up = project_with_adapter("up_proj", x, self.up_proj[...], adapters.get("up_proj"))
        hidden = with_logical_constraint(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
        return project_with_adapter("down_proj", hidden, self.down_proj[...], adapters.get("down_proj"))


class Attention(nnx.Module):
    """Grouped-query attention with optional q/k/v bias (Qwen2) and q/k RMSNorm (Qwen3).

    One method serves three paths; `layer_index` selects this layer's slice of the stacked cache:
      * no cache: keys are this chunk, `mask` [B, T, T];
      * prefill (cache given, `decode=False`): as above and the chunk's k/v go to cache rows 0..T-1;
      * decode (`decode=True`, T == 1): k/v are written at `positions[b]` of row b and the query
        attends to the whole cache row, `mask` [B, 1, S].
    """

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        e, h, k, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nnx.Param(
            normal_init(rngs, (e, h, d), dtype), logical_axes=("embed", "q_heads", "head_dim")
        )
        self.k_proj = nnx.Param(
            normal_init(rngs, (e, k, d), dtype), logical_axes=("embed", "kv_heads", "head_dim")
        )
        self.v_proj = nnx.Param(
            normal_init(rngs, (e, k, d), dtype), logical_axes=("embed", "kv_heads", "head_dim")
        )
        self.o_proj = nnx.Param(
            normal_init(rngs, (h, d, e), dtype), logical_axes=("q_heads", "head_dim", "embed")
        )
        if config.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((h, d), dtype), logical_axes=("q_heads", "head_dim"))
            self.k_bias = nnx.Param(jnp.zeros((k, d), dtype), logical_axes=("kv_heads", "head_dim"))
            self.v_bias = nnx.Param(jnp.zeros((k, d), dtype), logical_axes=("kv_heads", "head_dim"))
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype)
        self.qkv_bias = config.qkv_bias
        self.qk_norm = config.qk_norm
        self.num_kv_heads = k
        self.groups = config.num_query_groups
        self.head_dim = d
        self.inv_freq = tuple(float(f) for f in rope_inverse_frequencies(config))  # static, hashable

    def __call__(self, x, positions, mask, cache=None, layer_index: int = 0, decode: bool = False, adapters=None):
        """x [B, T, E], positions [B, T] -> ([B, T, E], cache). `adapters`: this layer's LoRA adapters."""
        adapters = adapters or {}
        q = project_with_adapter("q_proj", x, self.q_proj[...], adapters.get("q_proj"))
        k = project_with_adapter("k_proj", x, self.k_proj[...], adapters.get("k_proj"))
        v = project_with_adapter("v_proj", x, self.v_proj[...], adapters.get("v_proj"))
        if self.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        q = with_logical_constraint(
            apply_rope(q, positions, inv_freq), ("batch", "length", "act_heads", None)
        )
        k = with_logical_constraint(
            apply_rope(k, positions, inv_freq), ("batch", "length", "act_kv_heads", None)
        )

        if cache is not None:
            cache = dict(cache)
            if decode:
                rows = jnp.arange(x.shape[0])
                write = positions[:, 0]
                for name, new in (("k", k), ("v", v)):
                    cache[name] = (
                        cache[name].at[layer_index, rows, write].set(new[:, 0].astype(cache[name].dtype))
                    )
                # The batch may be the cache's leading rows only (the engine steps a slot bucket): read just those.
                k = cache["k"][layer_index, : x.shape[0]].astype(x.dtype)
                v = cache["v"][layer_index, : x.shape[0]].astype(x.dtype)
            else:
                for name, new in (("k", k), ("v", v)):
                    cache[name] = jax.lax.dynamic_update_slice(
                        cache[name], new[None].astype(cache[name].dtype), (layer_index, 0, 0, 0, 0)
                    )

        out = self._attend(q, k, v, mask)
        return project_with_adapter("o_proj", out, self.o_proj[...], adapters.get("o_proj")), cache

    def _attend(self, q, k, v, mask):
        """q [B, T, H, D], k/v [B, S, K, D], mask [B, T, S] bool -> [B, T, H, D]."""
        b, t, _, d = q.shape
        q = q.reshape(b, t, self.num_kv_heads, self.groups, d)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
        scores = scores * (d**-0.5)
        scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", weights, v)
        return out.reshape(b, t, self.num_kv_heads * self.groups, d)
