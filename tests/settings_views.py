"""Settings views for tests that build components directly: each is the view of `RunConfig()` (the config's
defaults, the only ones) built by the library's own builder, with the fields a test needs replaced. The views
have no defaults of their own (tests/config/test_settings_views.py), so a test names every value it depends on
that differs from the config's default."""

import dataclasses
import functools

from flexmarl_jax.config import RunConfig
from flexmarl_jax.rollout.settings import EngineConfig, engine_config_for
from flexmarl_jax.train.from_config import trainer_config_for
from flexmarl_jax.train.losses import LossConfig
from flexmarl_jax.train.optim import OptimizerConfig
from flexmarl_jax.train.trainer_config import TrainerConfig

AGENT = "solver"  # an agent of `RunConfig()`'s team


@functools.cache
def default_run() -> RunConfig:
    return RunConfig()


def trainer_config(**overrides) -> TrainerConfig:
    """The default run's TrainerConfig (`trainer_config_for`) with `overrides` replaced."""
    return dataclasses.replace(trainer_config_for(default_run(), AGENT), **overrides)


def loss_config(**overrides) -> LossConfig:
    """The default run's LossConfig (train.algorithm's preset) with `overrides` replaced."""
    return dataclasses.replace(trainer_config_for(default_run(), AGENT).loss, **overrides)


def optimizer_config(**overrides) -> OptimizerConfig:
    """The default run's OptimizerConfig with `overrides` replaced."""
    return dataclasses.replace(trainer_config_for(default_run(), AGENT).optimizer, **overrides)


def engine_config(**overrides) -> EngineConfig:
    """The default run's EngineConfig (`engine_config_for`) with `overrides` replaced; its prefill buckets follow
    max_prefill_length (None) unless given."""
    overrides.setdefault("prefill_buckets", None)
    return dataclasses.replace(engine_config_for(default_run(), AGENT), **overrides)
