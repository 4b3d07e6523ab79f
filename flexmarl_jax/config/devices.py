"""How many devices a config's meshes bind, checked against the machine once JAX has started."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flexmarl_jax.config.errors import ConfigError

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
    return len(config.agents) * rollout + slices * config.mesh.train_devices_per_agent


def check_devices(config: RunConfig, available_devices: int) -> None:
    """Raises ConfigError when the config's meshes need more devices than exist."""
    needed = devices_needed(config)
    if needed <= available_devices:
        return
    agents, mesh = len(config.agents), config.mesh
    instances = f"{config.rollout.instances_per_agent} instances x {mesh.rollout_devices_per_instance}"
    if mesh.colocate:
        breakdown = f"mesh.colocate=True: mesh.train_devices_per_agent={mesh.train_devices_per_agent}"
    elif mesh.train_slices:
        breakdown = (f"{agents} agents x {instances} + mesh.train_slices={mesh.train_slices} x "
                     f"mesh.train_devices_per_agent={mesh.train_devices_per_agent}")
    else:
        breakdown = f"{agents} agents x ({instances} + mesh.train_devices_per_agent={mesh.train_devices_per_agent})"
    raise ConfigError(f"config.mesh needs {needed} devices ({breakdown}) but {available_devices} exist")
