"""Settings views for benchmarks that build engines, trainers, routers, balancers and cost models directly: the
view of `RunConfig()` (the config's defaults, the only ones) built by the library's own builder, with the fields a
benchmark pins replaced. The views have no defaults of their own, so every value a benchmark depends on comes from
the config or is named here. JAX is imported on first use, not with this module (a benchmark's --help stays
fast)."""

from __future__ import annotations

import dataclasses

AGENT = "solver"  # an agent of `RunConfig()`'s team


def _default_run():
    from flexmarl_jax.config import RunConfig

    return RunConfig()


def trainer_config(**overrides):
    """The default run's TrainerConfig (`trainer_config_for`) with `overrides` replaced."""
    from flexmarl_jax.train.from_config import trainer_config_for

    return dataclasses.replace(trainer_config_for(_default_run(), AGENT), **overrides)


def loss_config(**overrides):
    """The default run's LossConfig (train.algorithm's preset) with `overrides` replaced."""
    return dataclasses.replace(trainer_config().loss, **overrides)


def optimizer_config(**overrides):
    """The default run's OptimizerConfig with `overrides` replaced."""
    return dataclasses.replace(trainer_config().optimizer, **overrides)


def lora_spec(**overrides):
    """The default run's LoraSpec (the trainer view's: rank 0, every target) with `overrides` replaced."""
    return dataclasses.replace(trainer_config().lora, **overrides)


def router_settings(**overrides) -> dict:
    """The default run's RequestRouter keyword arguments (`router_settings_for`) with `overrides` replaced."""
    from flexmarl_jax.rollout.routing_settings import router_settings_for

    return _replaced(router_settings_for(_default_run()), overrides)


def balancer_settings(**overrides) -> dict:
    """The default run's InstanceBalancer keyword arguments (`balancer_settings_for`) with `overrides` replaced."""
    from flexmarl_jax.rollout.routing_settings import balancer_settings_for

    return _replaced(balancer_settings_for(_default_run()), overrides)


def cost_model(model, chip, **overrides):
    """A CostModel of `model` on `chip` at the default run's pipeline.emulate_mfu, with `overrides` replaced."""
    from flexmarl_jax.emulation.cost_model import CostModel

    return CostModel(model, chip, **{"mfu": _default_run().pipeline.emulate_mfu, **overrides})


def _replaced(settings: dict, overrides: dict) -> dict:
    """`settings` with `overrides` replaced; a name it lacks is an error, as for `dataclasses.replace`."""
    unknown = sorted(set(overrides) - set(settings))
    if unknown:
        raise TypeError(f"no such setting(s) {unknown}; these are {sorted(settings)}")
    return {**settings, **overrides}


def engine_config(**overrides):
    """The default run's EngineConfig (`engine_config_for`) with `overrides` replaced; its prefill buckets follow
    max_prefill_length (None) unless given."""
    from flexmarl_jax.rollout.settings import engine_config_for

    overrides.setdefault("prefill_buckets", None)
    return dataclasses.replace(engine_config_for(_default_run(), AGENT), **overrides)
