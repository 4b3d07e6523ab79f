"""A run's config.json written before a config field existed still reads (export, serving), with that field at
its default; a key the schema does not know is still refused."""

import json

import pytest

from flexmarl_jax.config import RunConfig
from flexmarl_jax.orchestrator.export import ExportError, read_run_config


def _write(tmp_path, values):
    (tmp_path / "config.json").write_text(json.dumps(values))
    return str(tmp_path)


def test_fields_a_saved_config_lacks_read_as_their_defaults(tiny_config, tmp_path):
    values = json.loads(tiny_config.to_json())
    assert read_run_config(_write(tmp_path, values)) == tiny_config
    del values["train"]["kl_coef"]  # added after older runs were written
    del values["agents"]["solver"]["top_p"]  # a field inside one agent
    values["train"]["remat"] = not RunConfig().train.remat  # what the run did set is kept
    read = read_run_config(_write(tmp_path, values))
    assert read.train.kl_coef == RunConfig().train.kl_coef == 0.0
    assert read.agents["solver"].top_p == 1.0 and read.train.remat == values["train"]["remat"]
    assert read.agents["verifier"] == tiny_config.agents["verifier"]


def test_a_whole_missing_section_takes_its_defaults_and_an_unknown_key_is_refused(tiny_config, tmp_path):
    values = json.loads(tiny_config.to_json())
    del values["store"]
    assert read_run_config(_write(tmp_path, values)).store == RunConfig().store
    values["train"]["kl_weight"] = 0.1
    with pytest.raises(ExportError, match=r"config.json: unknown config key 'train.kl_weight'"):
        read_run_config(_write(tmp_path, values))
