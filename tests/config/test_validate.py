"""Validation names the field, the value and the rule, in one line."""

import ml_collections
import pytest

from flexmarl_jax.config import ConfigError, apply_overrides, devices_needed, load_config, validate_config


def _validate(overrides, devices=8):
    config = apply_overrides(load_config(), overrides)
    validate_config(config, available_devices=devices)


@pytest.mark.parametrize("overrides, fragment", [
    ({"train.micro_batch_size": "-1"}, "config.train.micro_batch_size=-1 must be a positive integer"),
    ({"train.micro_batch_size": "48"}, "micro_batch_size=48 must divide train.global_batch_size=128"),
    ({"train.micro_batch_size": "4"}, "must be a multiple of the GRPO group size"),
    ({"train.global_batch_size": "64"}, "must equal workflow.queries_per_iteration x"),
    ({"rollout.decode_slots": "0"}, "rollout.decode_slots=0 must be a positive integer"),
    ({"pipeline.mode": "turbo"}, "pipeline.mode='turbo' is not allowed; choose one of: serial, sync, flexmarl"),
    ({"train.algorithm": "sft"}, "train.algorithm='sft' is not allowed"),
    ({"agents.solver.temperature": "0"}, "agents.solver.temperature=0.0 must be > 0"),
    ({"agents.verifier.top_p": "1.5"}, "agents.verifier.top_p=1.5 must be in (0, 1]"),
    ({"agents.solver.model": "gpt-9"}, "agents.solver.model='gpt-9' is neither a model preset"),
    ({"mesh.tp": "2"}, "mesh.tp=2 must divide mesh.train_devices_per_agent=1"),
    ({"train.max_staleness": "-2"}, "max_staleness=-2 must be >= 0"),
    ({"pipeline.balance_delta": "0"}, "config.pipeline.balance_delta=0 must be a positive integer"),
    ({"rollout.min_instances_per_agent": "2"}, "min_instances_per_agent=2 exceeds rollout.instances_per_agent=1"),
    ({"rollout.max_retries": "-1"}, "config.rollout.max_retries=-1 must be >= 0"),
])
def test_bad_values(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        _validate(overrides)
    assert fragment in str(error.value)
    assert "\n" not in str(error.value)


def test_mesh_larger_than_the_machine():
    overrides = {"mesh.train_devices_per_agent": "20"}
    config = apply_overrides(load_config(), overrides)
    assert devices_needed(config) == 3 * (1 * 1 + 20)
    with pytest.raises(ConfigError, match=r"config.mesh needs 63 devices .* but 8 exist"):
        validate_config(config, available_devices=8)
    validate_config(config, available_devices=64)  # the same config fits a bigger machine


def test_unknown_and_mistyped_fields_in_a_config_file():
    config = load_config()
    with config.unlocked():
        config.train.nonsense = 1
    with pytest.raises(ConfigError, match="unknown config key 'train.nonsense'"):
        validate_config(config)
    config = load_config()
    config.agents.solver = ml_collections.ConfigDict({"model": "tiny"})
    with pytest.raises(ConfigError, match="missing config key 'agents.solver.temperature'"):
        validate_config(config)


def test_every_shipped_variant_is_valid():
    for variant in ("", "sync", "serial", "stale1", "smoke"):
        validate_config(load_config(f"configs/tiny.py:{variant}"), available_devices=8)


@pytest.mark.parametrize("overrides, fragment", [
    ({"workflow.agents": "('solver', 'verifier')"}, "config.workflow.agents=('solver', 'verifier') must list each"),
    ({"workflow.task_options.max_digits": "0"}, "max_digits=0"),
    ({"workflow.task": "sudoku"}, "config.workflow.task='sudoku'"),
])
def test_bad_workflow_settings(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        _validate(overrides)
    assert fragment in str(error.value)
