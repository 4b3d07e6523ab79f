"""The run config: loading files, command-line overrides and the typed, checked schema. Never imports JAX.

    config = RunConfig.from_config(load_config("configs/tiny.py:smoke"))

- `loader.py`: `load_config(PATH[:VARIANT])` -> ml_collections.ConfigDict (the config files' format);
- `cli_flags.py`: `--config`, `--config.KEY=VALUE`, `--workdir`, `--verbosity` via ml_collections.config_flags,
  and `apply_overrides` for `KEY=VALUE` strings;
- `schema.py`: `RunConfig` and its sections (frozen dataclasses; every field has a default, a description
  and its rule), built by `RunConfig.from_config`; `fields.py`: the machinery; `workflow_checks.py`: the
  workflow section against the workflow and task registries;
- `devices.py`: `devices_needed` / `check_devices` once the machine's device count is known;
- `memory.py`: `estimate_agent_memory` / `check_team_fits`: each agent's peak memory from shapes, checked
  against host RAM (CPU) or device memory before anything is allocated.
"""

from flexmarl_jax.config.cli_flags import apply_overrides, parse_train_flags
from flexmarl_jax.config.devices import check_devices, devices_needed
from flexmarl_jax.config.errors import ConfigError
from flexmarl_jax.config.loader import load_config
from flexmarl_jax.config.memory import AgentMemory, check_team_fits, estimate_agent_memory
from flexmarl_jax.config.schema import (
    AgentConfig,
    DistributedConfig,
    LoraConfig,
    MeshConfig,
    PipelineConfig,
    RolloutConfig,
    RunConfig,
    RunControlConfig,
    StoreConfig,
    TrainConfig,
    WorkflowConfig,
)

__all__ = [
    "AgentConfig", "AgentMemory", "ConfigError", "DistributedConfig", "LoraConfig", "MeshConfig", "PipelineConfig",
    "RolloutConfig", "RunConfig", "RunControlConfig", "StoreConfig", "TrainConfig", "WorkflowConfig",
    "apply_overrides", "check_devices", "check_team_fits", "devices_needed", "estimate_agent_memory",
    "load_config", "parse_train_flags",
]
