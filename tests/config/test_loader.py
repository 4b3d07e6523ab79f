"""Loading configs by path/variant and applying typed overrides (through ml_collections.config_flags)."""

import pytest

from flexmarl_jax.config import ConfigError, RunConfig, apply_overrides, check_devices, load_config


def test_default_is_the_tiny_config_and_valid():
    config = RunConfig.from_config(load_config())
    assert config.workflow.name == "chain"
    assert set(config.agents) == {"solver", "verifier", "corrector"}
    check_devices(config, 8)


def test_path_and_variant_load_the_same_file():
    by_path = load_config("configs/tiny.py:sync")
    assert by_path.pipeline.mode == "sync"
    assert load_config("configs/tiny.py").to_dict() == load_config().to_dict()


def test_overrides_are_parsed_into_the_field_type():
    config = apply_overrides(load_config(), {"train.learning_rate": "3e-3", "train.max_staleness": "1",
                                             "pipeline.balancing": "false", "agents.solver.model": "tiny"})
    assert config.train.learning_rate == pytest.approx(3e-3)
    assert config.train.max_staleness == 1 and isinstance(config.train.max_staleness, int)
    assert config.pipeline.balancing is False


def test_tuple_overrides_take_a_python_literal():
    config = apply_overrides(load_config("configs/debate.py"), {"workflow.options.debaters": "('a', 'b')"})
    assert config.workflow.options.debaters == ("a", "b")


@pytest.mark.parametrize("key, value, fragment", [
    ("train.nonsense", "1", "'train' has no field 'nonsense'"),
    ("nonsense.x", "1", "'config' has no field 'nonsense'"),
    ("train.micro_batch_size", "abc", "train.micro_batch_size='abc' is not an int"),
    ("pipeline.balancing", "maybe", "is not a bool"),
    ("train", "3", "is a section"),
    ("train.learning_rate", "fast", "train.learning_rate='fast' is not a float"),
    ("train.learning_rate.x", "1", "'train.learning_rate' is a value, not a section"),
])
def test_bad_overrides_name_the_key(key, value, fragment):
    with pytest.raises(ConfigError, match=None) as error:
        apply_overrides(load_config(), {key: value})
    assert fragment in str(error.value)
    assert "\n" not in str(error.value)


def test_unknown_variant_and_missing_file():
    with pytest.raises(ConfigError, match="unknown variant 'nope'"):
        load_config("configs/tiny.py:nope")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/missing.py")
