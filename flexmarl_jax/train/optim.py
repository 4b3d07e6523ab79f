"""Per-agent optimizers by name. Each agent has its own optimizer and learning rate."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import optax

from flexmarl_jax.train.registry import Registry


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """One agent's optimizer; `name` picks a registered optimizer. No defaults of its own: a run's comes from
    `train.from_config.trainer_config_for`."""

    name: str  # "adamw" | "adam" | "sgd"
    learning_rate: float  # constant learning rate of this agent
    weight_decay: float  # decoupled weight decay (adamw only)
    b1: float
    b2: float
    eps: float
    max_grad_norm: float | None  # clip the accumulated gradient's global norm; None disables

    def __post_init__(self):
        OPTIMIZERS.get(self.name)
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be > 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} must be > 0 or None")


OPTIMIZERS: Registry[Callable[[OptimizerConfig], optax.GradientTransformation]] = Registry("optimizer")


@OPTIMIZERS.register("adamw")
def _adamw(config: OptimizerConfig) -> optax.GradientTransformation:
    return optax.adamw(config.learning_rate, b1=config.b1, b2=config.b2, eps=config.eps,
                       weight_decay=config.weight_decay)


@OPTIMIZERS.register("adam")
def _adam(config: OptimizerConfig) -> optax.GradientTransformation:
    return optax.adam(config.learning_rate, b1=config.b1, b2=config.b2, eps=config.eps)


@OPTIMIZERS.register("sgd")
def _sgd(config: OptimizerConfig) -> optax.GradientTransformation:
    return optax.sgd(config.learning_rate)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """The optax transformation for `config`, with global-norm clipping first when enabled.

    Clipping sees the *accumulated* gradient of the whole iteration, as a full-batch step would.
    """
    base = OPTIMIZERS.get(config.name)(config)
    if config.max_grad_norm is None:
        return base
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), base)
