"""`config.run` (hang detection and stopping) and `rollout.instance_stall_s`: their rules, one line each."""

import dataclasses

import pytest

from flexmarl_jax.config import ConfigError, RunConfig, apply_overrides, load_config


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_stall_timeout_at_or_below_zero_is_a_config_error_naming_the_field(value):
    config = apply_overrides(load_config("configs/tiny.py:smoke"), {"run.stall_timeout_s": value})
    with pytest.raises(ConfigError, match=rf"^config.run.stall_timeout_s={float(value)!r} must be > 0$"):
        RunConfig.from_config(config)


def test_a_stuck_instance_must_be_caught_before_the_run_counts_as_stalled(tiny_config):
    with pytest.raises(ConfigError, match=r"^config.rollout.instance_stall_s=600 must be below "
                                          r"run.stall_timeout_s=600"):
        dataclasses.replace(tiny_config, rollout=dataclasses.replace(tiny_config.rollout, instance_stall_s=600.0))
    shorter = dataclasses.replace(tiny_config, run=dataclasses.replace(tiny_config.run, stall_timeout_s=60.0),
                                  rollout=dataclasses.replace(tiny_config.rollout, instance_stall_s=20.0))
    assert (shorter.run.stall_timeout_s, shorter.rollout.instance_stall_s) == (60.0, 20.0)


def test_stop_mode_and_timeout_rules(tiny_config):
    assert (tiny_config.run.stop_mode, tiny_config.run.stop_timeout_s) == ("finish", 300.0)
    with pytest.raises(ConfigError, match=r"^config.run.stop_mode='later' is not allowed; choose one of: "
                                          r"finish, abandon$"):
        dataclasses.replace(tiny_config, run=dataclasses.replace(tiny_config.run, stop_mode="later"))
    with pytest.raises(ConfigError, match=r"^config.run.stop_timeout_s=0.0 must be > 0$"):
        dataclasses.replace(tiny_config, run=dataclasses.replace(tiny_config.run, stop_timeout_s=0.0))
