"""How many devices a config's meshes bind, checked against the machine once JAX has started."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flexmarl_jax.config.errors import ConfigError
from flexmarl_jax.config.lora_groups import lora_base_groups

if TYPE_CHECKING:
    from flexmarl_jax.config.schema import RunConfig


def devices_needed(config: RunConfig) -> int:
    """Devices the run binds: every agent's rollout instances plus its training mesh (or the S shared
    training slices when mesh.train_slices = S > 0). With mesh.colocate only one agent's training mesh: agents
    share it, and their engines run on it."""
    if config.mesh.colocate:
        return config.mesh.train_devices_per_agent
    rollout = config.rollout.instances_per_agent * config.mesh.rollout_devices_per_instance
    slices = config.mesh.train_slices or len(config.agents)
    return _rollout_owners(config) * rollout + slices * config.mesh.train_devices_per_agent


def _rollout_owners(config: RunConfig) -> int:
    """Agents with rollout devices of their own: a LoRA base group's agents share its first agent's."""
    followers = sum(1 for agent, group in lora_base_groups(config).items() if group[0] != agent)
    return len(config.agents) - followers


def check_devices(config: RunConfig, available_devices: int) -> None:
    """Raises ConfigError when the config's meshes need more devices than exist."""
    needed = devices_needed(config)
    if needed <= available_devices:
        return
    agents, mesh = _rollout_owners(config), config.mesh
    shared = "" if agents == len(config.agents) else " (LoRA base groups counted once)"
    instances = f"{config.rollout.instances_per_agent} instances x {mesh.rollout_devices_per_instance}"
    if mesh.colocate:
        breakdown = f"mesh.colocate=True: mesh.train_devices_per_agent={mesh.train_devices_per_agent}"
    elif mesh.train_slices:
        breakdown = (f"{agents} agents x {instances} + mesh.train_slices={mesh.train_slices} x "
                     f"mesh.train_devices_per_agent={mesh.train_devices_per_agent}")
    elif shared:
        breakdown = (f"{agents} agents x {instances} + {len(config.agents)} agents x mesh.train_devices_per_agent="
                     f"{mesh.train_devices_per_agent}")
    else:
        breakdown = f"{agents} agents x ({instances} + mesh.train_devices_per_agent={mesh.train_devices_per_agent})"
    raise ConfigError(f"config.mesh needs {needed} devices ({breakdown}{shared}) but {available_devices} exist")
