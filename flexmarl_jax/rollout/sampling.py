"""Per-row token sampling with temperature, top-k and top-p, and its exact log-probs.

Every row of a decode batch carries its own settings, so one compiled step serves
requests with different sampling settings. The log-prob returned for a sampled token
is taken from the very distribution it was drawn from (`models/sampling_distribution.py`:
temperature-scaled, masked, renormalised): that is the behaviour log-prob RL needs. A greedy
row (temperature <= 0) takes the argmax of the raw logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flexmarl_jax.models.sampling_distribution import sampling_log_probs


def sample_tokens(
    keys: jax.Array,
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row and returns it with its behaviour log-prob.

    Args:
      keys: [batch] typed PRNG keys (one independent stream per row).
      logits: [batch, vocab] f32; temperature, top_p: [batch] f32; top_k: [batch] i32.
    Returns:
      tokens [batch] i32, logprobs [batch] f32.
    """
    log_probs = sampling_log_probs(logits, temperature, top_k, top_p)
    drawn = jax.vmap(jax.random.categorical)(keys, log_probs)
    greedy_tokens = jnp.argmax(logits, axis=-1)
    tokens = jnp.where(temperature <= 0, greedy_tokens, drawn).astype(jnp.int32)
    token_log_probs = jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
    return tokens, token_log_probs
