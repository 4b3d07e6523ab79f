"""Advantage estimators, computed once per iteration over all of an agent's samples (before dispatch).

Group-relative estimators (GRPO, Dr.GRPO, RLOO) compare each sample's reward to the other samples of
its group (same prompt). GAE (for PPO) turns per-token rewards and critic values into advantages and
value targets. All are pure jnp functions; ``group_advantages`` is the host-side entry point that maps
arbitrary group ids to dense indices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flexmarl_jax.train.registry import Registry

GroupEstimator = Callable[..., jax.Array]
# A group std below this (relative to the reward scale) is float32 rounding of equal rewards.
_EQUAL_REWARDS_RTOL = 1e-5
ADVANTAGES: Registry[GroupEstimator] = Registry("advantage estimator")


def _group_stats(rewards: jax.Array, group_index: jax.Array, num_groups: int):
    """Per-sample group size, mean and (population) std; rewards/group_index are ``[num_samples]``."""
    ones = jnp.ones_like(rewards)
    count = jax.ops.segment_sum(ones, group_index, num_segments=num_groups)
    total = jax.ops.segment_sum(rewards, group_index, num_segments=num_groups)
    mean = total / jnp.maximum(count, 1.0)
    centered = rewards - mean[group_index]
    var = jax.ops.segment_sum(centered**2, group_index, num_segments=num_groups) / jnp.maximum(count, 1.0)
    return count[group_index], mean[group_index], jnp.sqrt(var)[group_index]


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards: jax.Array, group_index: jax.Array, num_groups: int, eps: float = 1e-6):
    """(r - group mean) / (group std + eps); ``[num_samples]`` -> ``[num_samples]``.

    A group whose rewards are equal (up to float32 rounding of the mean) gets exactly 0: dividing
    rounding noise by a near-zero std would otherwise invent a signal.
    """
    _, mean, std = _group_stats(rewards, group_index, num_groups)
    has_spread = std > _EQUAL_REWARDS_RTOL * (1.0 + jnp.abs(mean))
    return jnp.where(has_spread, (rewards - mean) / (std + eps), 0.0)


@ADVANTAGES.register("drgrpo")
def drgrpo_advantages(rewards: jax.Array, group_index: jax.Array, num_groups: int, eps: float = 1e-6):
    """Dr.GRPO: r - group mean, without dividing by the std (which biases towards easy/hard prompts)."""
    del eps
    _, mean, _ = _group_stats(rewards, group_index, num_groups)
    return rewards - mean


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards: jax.Array, group_index: jax.Array, num_groups: int, eps: float = 1e-6):
    """Leave-one-out baseline: r_i - mean of the other samples of the group (0 for singleton groups)."""
    del eps
    count, mean, _ = _group_stats(rewards, group_index, num_groups)
    others = jnp.maximum(count - 1.0, 1.0)
    return jnp.where(count > 1, (rewards - mean) * count / others, 0.0)


def _bucket(n: int) -> int:
    """Next power of two >= max(n, 8): a few compiled shapes serve every iteration size."""
    return max(8, 1 << (max(n, 1) - 1).bit_length())


def group_advantages(
    rewards: Sequence[float], group_ids: Sequence[Hashable], estimator: str = "grpo", eps: float = 1e-6
) -> np.ndarray:
    """Host entry point: per-sample advantages ``[num_samples]`` float32 for one agent's iteration.

    ``group_ids`` may be any hashable values (e.g. the input id of the query); samples sharing one are a
    group. Must be called with every sample of the iteration so group statistics are the full batch's.
    """
    rewards = np.asarray(rewards, np.float32)
    if rewards.ndim != 1 or len(group_ids) != len(rewards):
        raise ValueError(f"rewards {rewards.shape} and group_ids ({len(group_ids)}) must be equal-length 1-D")
    fn = ADVANTAGES.get(estimator)
    dense: dict[Hashable, int] = {}
    group_index = np.asarray([dense.setdefault(g, len(dense)) for g in group_ids], np.int32)
    # Pad samples and groups to buckets; padding samples sit in their own extra group, so the
    # statistics of the real groups are untouched.
    num_samples, num_groups = len(rewards), len(dense)
    padded_samples, padded_groups = _bucket(num_samples), _bucket(num_groups + 1)
    padded_rewards = np.zeros(padded_samples, np.float32)
    padded_rewards[:num_samples] = rewards
    padded_index = np.full(padded_samples, num_groups, np.int32)
    padded_index[:num_samples] = group_index
    # A few host numbers in, host numbers out: run on the host's CPU device rather than queue a transfer and a
    # launch behind rollout or training work on an accelerator.
    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # this process's (devices()[0] is process 0's)
        out = _jitted_estimator(fn)(padded_rewards, padded_index, padded_groups, eps)
    return np.asarray(out)[:num_samples]


@functools.cache
def _jitted_estimator(fn: GroupEstimator):
    return jax.jit(fn, static_argnums=(2,))


def gae(
    rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float = 1.0, lam: float = 0.95
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over response tokens.

    rewards, values: ``[batch, seq]`` float32 per-token reward (usually the verifier reward on the last
    response token) and critic value; mask: ``[batch, seq]`` bool, True on response tokens (contiguous
    per row). Returns (advantages, returns), both ``[batch, seq]``, zero outside ``mask``. The value after
    the last response token is taken as 0 (the episode ends there).
    """
    mask = mask.astype(jnp.float32)
    rewards, values = rewards * mask, values * mask

    def step(carry, xs):
        next_value, next_advantage = carry
        reward, value, valid = xs
        delta = reward + gamma * next_value - value
        advantage = delta + gamma * lam * next_advantage
        # Outside the response keep the carry at zero so the recursion restarts at the response's end.
        advantage = advantage * valid
        return (value * valid, advantage), advantage

    init = (jnp.zeros(rewards.shape[0]), jnp.zeros(rewards.shape[0]))
    xs = (rewards.T[::-1], values.T[::-1], mask.T[::-1])
    _, advantages_reversed = jax.lax.scan(step, init, xs)
    advantages = advantages_reversed[::-1].T
    return advantages, (advantages + values) * mask


def whiten(values: jax.Array, mask: jax.Array, eps: float = 1e-8) -> jax.Array:
    """(x - mean) / std over the masked entries of the whole iteration (PPO advantage normalisation)."""
    mask = mask.astype(jnp.float32)
    count = jnp.maximum(mask.sum(), 1.0)
    mean = (values * mask).sum() / count
    var = (((values - mean) * mask) ** 2).sum() / count
    return (values - mean) / jnp.sqrt(var + eps) * mask


@functools.cache
def _jitted_gae():
    return jax.jit(gae, static_argnames=("gamma", "lam"))


def gae_from_rewards(rewards: Sequence[float], values: np.ndarray, loss_mask: np.ndarray, *, gamma: float,
                     lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Host entry point for PPO: GAE advantages and returns ``[batch, seq]`` float32 of a micro-batch.

    rewards: ``[rows]``, row i's reward, earned on its last response token (rows beyond them are padding);
    values: ``[batch, seq]`` the critic's values; loss_mask: ``[batch, seq]`` True on response tokens.
    """
    mask = np.asarray(loss_mask, np.bool_)
    rewards = np.asarray(rewards, np.float32)
    if rewards.ndim != 1 or len(rewards) > mask.shape[0] or not mask[:len(rewards)].any(axis=1).all():
        raise ValueError(f"rewards {rewards.shape} must give one reward per row with response tokens, at most "
                         f"{mask.shape[0]} (the micro-batch's rows)")
    rows = np.arange(len(rewards))
    last = mask.shape[1] - 1 - np.argmax(mask[rows, ::-1], axis=1)  # each row's last response token
    token_rewards = np.zeros(mask.shape, np.float32)
    token_rewards[rows, last] = rewards
    # Like group_advantages: a few host numbers, computed on the host's CPU device.
    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # this process's (devices()[0] is process 0's)
        advantages, returns = _jitted_gae()(token_rewards, np.asarray(values, np.float32), mask, gamma=gamma,
                                            lam=lam)
    return np.asarray(advantages, np.float32), np.asarray(returns, np.float32)
