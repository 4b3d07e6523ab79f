"""The decoder-only LM (Qwen2 / Llama / Qwen3 layout) as an NNX module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flexmarl_jax.mesh.rules import with_logical_constraint
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.layers import MLP, Attention, Embed, RMSNorm, normal_init
from flexmarl_jax.models.projection import project


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)); then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.attn = Attention(config, dtype=dtype, rngs=rngs)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, mask, cache=None, layer_index: int = 0, decode: bool = False, adapters=None):
        attn_out, cache = self.attn(self.input_norm(x), positions, mask, cache, layer_index, decode, adapters)
        x = x + attn_out
        x = x + self.mlp(self.post_attention_norm(x), adapters)
        return with_logical_constraint(x, ("batch", "length", "act_embed")), cache


def _rematerialised(layer: DecoderLayer, x, positions, mask, adapters=None):
    """`layer(x)` whose backward pass keeps only the layer's input and recomputes the rest from it.

    A custom VJP rather than `jax.checkpoint`: XLA's CPU compiler drops the optimisation barriers that
    `jax.checkpoint` relies on, then schedules every layer's recomputation as soon as its input exists (all
    before the backward pass starts) or merges it with the forward pass, and memory is not reduced at all.
    Here the recomputation's input depends on the incoming cotangent, so it can only run when the backward
    pass reaches this layer, on every backend. The dependency adds `min(|g|, 0)` of one cotangent element:
    exactly 0 unless the cotangent is NaN (then the gradient is NaN anyway). Gradients are `jax.vjp` of the
    same function, so they equal the plain backward pass.
    """
    graphdef, state = nnx.split(layer)

    def run(state, x, adapters, positions, mask):
        return nnx.merge(graphdef, state)(x, positions, mask, adapters=adapters)[0]

    # positions and mask are arguments, not closed over: a custom VJP that closes over tracers fails to lower
    # when the forward pass is jitted on its own and differentiated from outside.
    @jax.custom_vjp
    def layer_forward(state, x, adapters, positions, mask):
        return run(state, x, adapters, positions, mask)

    def keep_input(state, x, adapters, positions, mask):
        return run(state, x, adapters, positions, mask), (state, x, adapters, positions, mask)

    def recompute_then_backprop(saved, cotangent):
        state, x, adapters, positions, mask = saved
        after_cotangent = jnp.minimum(jnp.abs(cotangent.reshape(-1)[0].astype(jnp.float32)), 0.0)

        def differentiable(state, x, adapters):
            return run(state, x, adapters, positions, mask)

        grads = jax.vjp(differentiable, state, x + after_cotangent.astype(x.dtype), adapters)[1](cotangent)
        return (*grads, None, None)  # integer positions and a boolean mask have no cotangent

    layer_forward.defvjp(keep_input, recompute_then_backprop)
    return layer_forward(state, x, adapters, positions, mask)


class DecoderLM(nnx.Module):
    """Token ids -> next-token logits. `config` is kept as a static attribute (it is hashable)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        self.embed = Embed(config.vocab_size, config.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = nnx.List(
            [DecoderLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_layers)]
        )
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(
                normal_init(rngs, (config.hidden_size, config.vocab_size), dtype),
                logical_axes=("embed", "vocab"),
            )

    def __call__(self, tokens, positions, mask, cache=None, decode: bool = False, remat: bool = False,
                 logits_at=None, adapters=None):
        """tokens/positions [B, T]; mask [B, T, S] bool (query t may see key s).

        logits_at [B] int (optional): compute the logits of that one position of each row only ([B, 1, V]); a
        prefill needs just its last prompt token's, and the vocabulary projection of every other position
        would be a fifth of a small model's prefill work.
        remat (training, no cache): keep only each layer's input for the backward pass and recompute the
        layer's inside from it, so activation memory holds one layer's intermediates instead of all.
        adapters (optional): an `AdapterBatch` (models/lora.py), the LoRA adapter of every row.
        Returns (logits [B, T, V] float32, cache).
        """
        if remat and cache is not None:
            raise ValueError("remat is for the training forward pass; it takes no KV cache")
        x = with_logical_constraint(self.embed(tokens), ("batch", "length", "act_embed"))
        for index, layer in enumerate(self.layers):
            layer_adapters = None if adapters is None else adapters.layer(index)
            if remat:
                x = _rematerialised(layer, x, positions, mask, layer_adapters)
            else:
                x, cache = layer(x, positions, mask, cache, index, decode, layer_adapters)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at.astype(jnp.int32)[:, None, None], axis=1)
        x = self.final_norm(x)
        if self.config.tie_word_embeddings:
            logits = self.embed.attend(x)
        else:
            logits = project("bte,ev->btv", x, self.lm_head[...], preferred_element_type=jnp.float32)
        return with_logical_constraint(logits, ("batch", "length", "act_vocab")), cache
