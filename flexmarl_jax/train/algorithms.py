"""Named RL algorithms as loss presets (the names `config.train.algorithm` accepts).

An algorithm here is only a choice of loss, advantage estimator and aggregation (and DAPO's clip); every other
`LossConfig` field is `LOSS_SETTINGS`, the one place a run's loss coefficients are set. Fields can still be
overridden one by one (e.g. ``kl_coef``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from flexmarl_jax.train.algorithm_names import ALGORITHM_NAMES
from flexmarl_jax.train.losses import LossConfig
from flexmarl_jax.train.registry import Registry

ALGORITHMS: Registry[Callable[[], LossConfig]] = Registry("algorithm")

# The loss settings a run does not choose (no `RunConfig` field): every preset starts from these.
LOSS_SETTINGS = dict(
    clip_eps_low=0.2,  # ratio lower clip 1 - eps_low
    clip_eps_high=0.2,  # ratio upper clip 1 + eps_high
    kl_coef=0.0,  # no KL to the reference
    tis_cap=None,  # no truncated IS (`trainer_config_for` sets train.tis_cap when max_staleness > 0)
    value_coef=0.5,  # PPO: weight of the value loss
    value_clip=0.2,  # PPO: clip of the value change around old_values
    gamma=1.0,  # PPO/GAE discount
    gae_lambda=0.95,  # PPO/GAE lambda
)


def _preset(**choices) -> LossConfig:
    """A LossConfig of `LOSS_SETTINGS` with an algorithm's `choices` (name, advantage estimator, aggregation, ...)."""
    return LossConfig(**{**LOSS_SETTINGS, **choices})


@ALGORITHMS.register("grpo")
def _grpo() -> LossConfig:
    """GRPO: group mean/std advantages, symmetric clip, per-sequence token mean."""
    return _preset(name="grpo", advantage_estimator="grpo", aggregation="seq_mean")


@ALGORITHMS.register("drgrpo")
def _drgrpo() -> LossConfig:
    """Dr.GRPO: no std normalisation, token sums over a constant length (no length bias)."""
    return _preset(name="grpo", advantage_estimator="drgrpo", aggregation="seq_mean_token_sum_norm")


@ALGORITHMS.register("dapo")
def _dapo() -> LossConfig:
    """DAPO: asymmetric clip-higher and token-level mean over the iteration."""
    return _preset(name="grpo", advantage_estimator="grpo", aggregation="token_mean",
                   clip_eps_low=0.2, clip_eps_high=0.28)


@ALGORITHMS.register("ppo")
def _ppo() -> LossConfig:
    """PPO: GAE advantages from a critic with a value head, clipped surrogate and value loss. The dispatcher
    computes each micro-batch's GAE (orchestrator/dispatch.py); the group estimator is not used."""
    return _preset(name="ppo", advantage_estimator="grpo", aggregation="token_mean")  # the estimator is unused


if ALGORITHMS.names() != sorted(ALGORITHM_NAMES):  # config validation lists ALGORITHM_NAMES without JAX
    raise ImportError(f"registered algorithms {ALGORITHMS.names()} != ALGORITHM_NAMES {sorted(ALGORITHM_NAMES)}")


def loss_config_for(algorithm: str, **overrides) -> LossConfig:
    """The LossConfig of `algorithm` with `overrides` applied (unknown fields raise TypeError)."""
    return dataclasses.replace(ALGORITHMS.get(algorithm)(), **overrides)
