"""Policy-gradient losses over per-token log-probs, picked by name from a registry.

Every loss returns ``sum(token_weights * per_token_loss)``: a plain sum, because ``token_weights``
already holds the iteration-wide normaliser (see normalizers.py). Summing this over the micro-batches of
an iteration is therefore exactly the full-batch loss, and so are the summed gradients. Metrics are
weighted sums for the same reason.

Terms, per response token t:
    ratio_t   = exp(logp_t - old_logp_t)                       (PPO ratio against the iteration start)
    pg_t      = -min(ratio_t * A_t, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_t)
    tis_t     = min(exp(old_logp_t - behaviour_logp_t), cap)   (truncated IS for stale samples, no grad)
    kl_t      = exp(ref_t - logp_t) - (ref_t - logp_t) - 1     (k3 estimator of KL(pi || ref))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from flexmarl_jax.train.advantages import ADVANTAGES
from flexmarl_jax.train.batch import MicroBatch
from flexmarl_jax.train.normalizers import AGGREGATIONS
from flexmarl_jax.train.registry import Registry


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """What an agent's trainer optimises (hashable: it is a static argument of the jitted step)."""

    name: str = "grpo"  # registered loss: "grpo" or "ppo"
    aggregation: str = "token_mean"  # "token_mean" | "seq_mean" | "seq_mean_token_sum_norm" (Dr.GRPO)
    advantage_estimator: str = "grpo"  # "grpo" | "drgrpo" | "rloo" (group-relative); PPO uses GAE
    clip_eps_low: float = 0.2  # ratio lower clip 1 - eps_low
    clip_eps_high: float = 0.2  # ratio upper clip 1 + eps_high; DAPO "clip-higher" uses e.g. 0.28
    kl_coef: float = 0.0  # weight of the k3 KL to the frozen reference; 0 disables it
    tis_cap: float | None = None  # truncated importance-sampling cap for stale samples; None disables
    value_coef: float = 0.5  # PPO: weight of the value loss
    value_clip: float = 0.2  # PPO: clip of the value change around old_values
    gamma: float = 1.0  # PPO/GAE discount
    gae_lambda: float = 0.95  # PPO/GAE lambda

    def __post_init__(self):
        LOSSES.get(self.name)  # raise early with the allowed names
        AGGREGATIONS.get(self.aggregation)
        ADVANTAGES.get(self.advantage_estimator)
        if not (0.0 <= self.clip_eps_low < 1.0) or self.clip_eps_high < 0.0:
            raise ValueError(f"clip_eps_low={self.clip_eps_low} must be in [0, 1) and "
                             f"clip_eps_high={self.clip_eps_high} >= 0")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef={self.kl_coef} must be >= 0")
        if self.tis_cap is not None and self.tis_cap < 1.0:
            raise ValueError(f"tis_cap={self.tis_cap} must be >= 1 (or None to disable)")

    @property
    def needs_values(self) -> bool:
        return self.name == "ppo"


# (logprobs [B,T], values [B,T] | None, batch, config) -> (scalar loss, metrics of weighted sums)
LossFn = Callable[[jax.Array, jax.Array | None, MicroBatch, LossConfig], tuple[jax.Array, dict]]
LOSSES: Registry[LossFn] = Registry("loss")


def truncated_importance_weights(old_logprobs, behaviour_logprobs, cap: float | None):
    """``min(pi_old / pi_behaviour, cap)`` per token, without gradient; ones when ``cap`` is None."""
    if cap is None:
        return jnp.ones_like(old_logprobs)
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(old_logprobs - behaviour_logprobs), cap))


def k3_kl(logprobs, ref_logprobs):
    """Per-token k3 estimator of KL(pi || ref): non-negative, unbiased, low variance."""
    log_ratio = ref_logprobs - logprobs
    return jnp.exp(log_ratio) - log_ratio - 1.0


def _clipped_policy_terms(logprobs, batch: MicroBatch, config: LossConfig):
    """Per-token policy loss ``[B,T]`` (already zero outside loss_mask) and metric ingredients."""
    mask = batch.loss_mask
    # Padding positions hold arbitrary log-probs; keep them out of exp() so 0 * inf never makes NaN.
    logprobs = jnp.where(mask, logprobs, 0.0)
    old = jnp.where(mask, batch.old_logprobs, 0.0)
    behaviour = jnp.where(mask, batch.behaviour_logprobs, 0.0)
    ratio = jnp.exp(logprobs - old)
    advantages = batch.advantages
    clipped_ratio = jnp.clip(ratio, 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)
    pg = -jnp.minimum(ratio * advantages, clipped_ratio * advantages)
    tis = truncated_importance_weights(old, behaviour, config.tis_cap)
    per_token = pg * tis
    if config.kl_coef > 0:
        ref = jnp.where(mask, batch.ref_logprobs, 0.0)
        kl = k3_kl(logprobs, ref)
        per_token = per_token + config.kl_coef * kl
    else:
        kl = jnp.zeros_like(pg)
    # The clip is active (the token gives no gradient) where the clipped branch is the smaller one.
    clipped = (clipped_ratio * advantages < ratio * advantages).astype(jnp.float32)
    per_token = jnp.where(mask, per_token, 0.0)
    return per_token, dict(pg=pg * tis, kl=kl, clip_fraction=clipped, tis_weight=tis, ratio=ratio)


def _weighted_metrics(weights, mask, terms: dict) -> dict:
    metrics = {name: jnp.sum(jnp.where(mask, weights * value, 0.0)) for name, value in terms.items()}
    metrics["num_tokens"] = jnp.sum(mask.astype(jnp.float32))
    return metrics


@LOSSES.register("grpo")
def grpo_loss(logprobs, values, batch: MicroBatch, config: LossConfig):
    """GRPO / Dr.GRPO / DAPO clipped surrogate (+ optional k3 KL), aggregated by ``token_weights``."""
    del values
    per_token, terms = _clipped_policy_terms(logprobs, batch, config)
    loss = jnp.sum(batch.token_weights * per_token)
    metrics = _weighted_metrics(batch.token_weights, batch.loss_mask, terms)
    metrics["loss"] = loss
    return loss, metrics


@LOSSES.register("ppo")
def ppo_loss(logprobs, values, batch: MicroBatch, config: LossConfig):
    """PPO: clipped surrogate on GAE advantages + clipped value loss on ``returns``."""
    if values is None:
        raise ValueError("the 'ppo' loss needs critic values; build the trainer with a value head")
    per_token, terms = _clipped_policy_terms(logprobs, batch, config)
    mask = batch.loss_mask
    values = jnp.where(mask, values, 0.0)
    clipped_values = batch.old_values + jnp.clip(values - batch.old_values, -config.value_clip,
                                                  config.value_clip)
    value_loss = 0.5 * jnp.maximum((values - batch.returns) ** 2, (clipped_values - batch.returns) ** 2)
    value_loss = jnp.where(mask, value_loss, 0.0)
    loss = jnp.sum(batch.token_weights * (per_token + config.value_coef * value_loss))
    metrics = _weighted_metrics(batch.token_weights, mask, dict(terms, value_loss=value_loss))
    metrics["loss"] = loss
    return loss, metrics
