"""The distribution an engine samples a token from: temperature-scaled, top-k and top-p masked, renormalised.

Rollout draws tokens from it (`rollout/sampling.py`) and records the drawn token's log-prob as the behaviour
log-prob; training evaluates the same distribution under the iteration's old policy, so the truncated
importance weight compares like with like (`train/trainer.py`). Every row carries its own settings.

Conventions (rows are independent):
* temperature <= 0 means greedy. The log-probs reported for a greedy row are the raw model log-softmax
  (temperature 1, no mask): a point mass would report 0, which is useless as a behaviour probability.
* top_k <= 0 disables top-k; otherwise the k highest scaled logits survive (ties broken
  towards the lower token id).
* top_p is applied after top-k on the renormalised top-k distribution: a token survives
  when the probability mass of the tokens ranked strictly above it is < top_p, so at
  least the top token always survives; top_p >= 1 keeps every token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sampling_log_probs(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """Log-probs of the distribution each row samples from.

    Args:
      logits: [batch, vocab] f32 raw model logits.
      temperature, top_p: [batch] f32; top_k: [batch] i32.
    Returns:
      [batch, vocab] f32 log-probs, -inf for masked tokens.
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0
    safe_temperature = jnp.where(greedy, 1.0, temperature)
    scaled = logits / safe_temperature[:, None]
    vocab = logits.shape[-1]

    def masked(scaled_logits: jax.Array) -> jax.Array:
        # Descending sort with ties to the lower id (lax.top_k's order).
        sorted_values, sorted_ids = jax.lax.top_k(scaled_logits, vocab)
        rank = jnp.arange(vocab)[None, :]
        k = jnp.where(top_k <= 0, vocab, top_k)[:, None]
        keep_sorted = rank < k
        sorted_probs = jax.nn.softmax(jnp.where(keep_sorted, sorted_values, -jnp.inf), axis=-1)
        mass_above = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        # top_p >= 1 must keep everything even when rounding pushes the cumulative mass to 1.0
        keep_sorted = keep_sorted & ((mass_above < top_p[:, None]) | (top_p[:, None] >= 1.0))
        rows = jnp.arange(scaled_logits.shape[0])[:, None]
        keep = jnp.zeros_like(keep_sorted).at[rows, sorted_ids].set(keep_sorted)
        keep = keep | greedy[:, None]  # greedy rows report the unmasked distribution
        return jnp.where(keep, scaled_logits, -jnp.inf)

    # Sorting the vocabulary is the expensive part; skip it when no row needs a mask.
    needs_mask = jnp.any((~greedy) & ((top_k > 0) | (top_p < 1.0)))
    scaled = jax.lax.cond(needs_mask, masked, lambda x: x, scaled)
    return jax.nn.log_softmax(scaled, axis=-1)


def is_plain_softmax(temperature: float, top_k: int, top_p: float) -> bool:
    """Whether these settings sample from the model's own softmax (temperature 1, no filter)."""
    return temperature == 1.0 and top_k <= 0 and top_p >= 1.0


def sampling_token_logprobs(logits: jax.Array, targets: jax.Array, *, temperature: float, top_k: int,
                            top_p: float) -> jax.Array:
    """Log-prob of each target under the distribution one set of sampling settings draws from.

    Args:
      logits: [batch, seq, vocab] raw model logits; targets: [batch, seq] int.
      temperature, top_k, top_p: one agent's settings (Python numbers: the same for every position).
    Returns:
      [batch, seq] f32; -inf where a filter masks the target out.
    """
    batch, seq, vocab = logits.shape
    rows = batch * seq
    log_probs = sampling_log_probs(logits.reshape(rows, vocab), jnp.full((rows,), temperature, jnp.float32),
                                   jnp.full((rows,), top_k, jnp.int32), jnp.full((rows,), top_p, jnp.float32))
    picked = jnp.take_along_axis(log_probs, targets.reshape(rows, 1).astype(jnp.int32), axis=-1)
    return picked.reshape(batch, seq)
