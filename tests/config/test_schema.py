"""The typed config: every field has a default and a description, it is read-only, and building it is JAX-free."""

import dataclasses
import json
import subprocess
import sys

import pytest

from flexmarl_jax.config import ConfigError, RunConfig, TrainConfig, apply_overrides, load_config
from flexmarl_jax.config.fields import walk_fields


def test_every_field_has_a_default_and_a_one_line_description():
    names = []
    for name, field in walk_fields(RunConfig):
        names.append(name)
        has_default = field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
        assert has_default and field.default is not None, name
        description = field.metadata.get("help")
        assert isinstance(description, str) and description.strip() and "\n" not in description, name
    assert {"seed", "agents.*.model", "workflow.task_options", "train.micro_batch_size", "store.backend"} <= set(names)
    assert "train.global_batch_size" not in names and "store.path" not in names


def test_schema_defaults_are_the_values_of_the_tiny_config():
    tiny = RunConfig.from_config(load_config())
    # The free-form workflow sections default to empty (the workflow's and tasks' own defaults).
    free = {name: {} for name in ("options", "roles", "task_options", "shaping_weights")}
    assert dataclasses.replace(tiny, workflow=dataclasses.replace(tiny.workflow, **free)) == RunConfig()


def test_building_a_config_imports_no_jax():
    code = ("import sys; from flexmarl_jax.config import RunConfig, load_config; "
            "RunConfig.from_config(load_config('configs/dag_example.py:smoke')); "
            "print(sorted(m for m in ('jax', 'tensorflow', 'jetstream', 'tensorstore') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_config_is_read_only(tiny_config):
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny_config.train.micro_batch_size = 8
    with pytest.raises(TypeError):
        tiny_config.agents["critic"] = tiny_config.agents["solver"]
    with pytest.raises(TypeError):
        tiny_config.workflow.task_options["arithmetic"]["max_digits"] = 3


def test_every_construction_checks_the_rules(tiny_config):
    with pytest.raises(ConfigError, match=r"^config.iterations=0 must be a positive integer$"):
        dataclasses.replace(tiny_config, iterations=0)
    with pytest.raises(ConfigError, match=r"^config.train.micro_batch_size=-1 must be a positive integer$"):
        RunConfig(train=TrainConfig(micro_batch_size=-1))
    with pytest.raises(ConfigError, match=r"config.agents.solver.temperature=0.0 must be > 0"):
        dataclasses.replace(tiny_config, agents={
            **tiny_config.agents, "solver": dataclasses.replace(tiny_config.agents["solver"], temperature=0)})
    assert dataclasses.replace(tiny_config, workdir="elsewhere").workdir == "elsewhere"


def test_agent_precision_and_decode_slots_rules(tiny_config):
    def with_solver(**changes):
        solver = dataclasses.replace(tiny_config.agents["solver"], **changes)
        return dataclasses.replace(tiny_config, agents={**tiny_config.agents, "solver": solver})

    assert with_solver(dtype="bfloat16", fp32_master_weights=True, decode_slots=4).agents["solver"].decode_slots == 4
    with pytest.raises(ConfigError, match=r"^config.agents.solver.dtype='float16' is not allowed; choose one of: "
                                          r"float32, bfloat16$"):
        with_solver(dtype="float16")
    with pytest.raises(ConfigError, match=r"^config.agents.solver.fp32_master_weights=True needs "
                                          r"agents.solver.dtype='bfloat16'"):
        with_solver(fp32_master_weights=True)
    with pytest.raises(ConfigError, match=r"^config.agents.solver.decode_slots=-1 must be >= 0$"):
        with_solver(decode_slots=-1)
    overridden = apply_overrides(load_config(), {"train.remat": "true", "agents.verifier.dtype": "bfloat16",
                                                 "agents.verifier.decode_slots": "8"})
    typed = RunConfig.from_config(overridden)
    assert typed.train.remat is True and typed.agents["verifier"].dtype == "bfloat16"
    assert typed.agents["verifier"].decode_slots == 8


def test_global_batch_size_follows_from_the_workflow(tiny_config):
    assert tiny_config.global_batch_size == 16 * 8
    smoke = RunConfig.from_config(load_config("configs/tiny.py:smoke"))
    assert smoke.global_batch_size == 4 * 4


def test_json_round_trip():
    config = RunConfig.from_config(load_config("configs/dag_example.py"))
    payload = json.loads(config.to_json())
    assert payload["workflow"]["name"] == "dag" and payload["agents"]["planner"]["model"] == "tiny"
    assert RunConfig.from_config(payload) == config
