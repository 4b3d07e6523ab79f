"""The placement rules that depend on how many processes run (one per host): each process rolls out every
agent on its own instances, and every training mesh spans all processes. The count may be known only once the
processes joined, so the CLI checks these again then (0 = not known yet)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flexmarl_jax.config.errors import ConfigError

if TYPE_CHECKING:
    from flexmarl_jax.config.schema import RunConfig


def check_instances_per_process(instances_per_agent: int, processes: int) -> None:
    """Each process rolls out every agent on its own instances: instances_per_agent must be a multiple of the
    process count (0 = not known yet: checked again once the processes joined)."""
    if processes and instances_per_agent % processes:
        raise ConfigError(f"config.rollout.instances_per_agent={instances_per_agent} must be a multiple of the "
                          f"{processes} processes: each process serves every agent on instances of its own")


def check_train_mesh_per_process(train_devices_per_agent: int, processes: int) -> None:
    """Every process issues every training computation (docs/architecture.md, "Several hosts"), so a training
    mesh must hold the same number of devices of each process: train_devices_per_agent a multiple of the process
    count (0 = not known yet: checked again once the processes joined). A mesh on some processes only would need
    its trainer's work, checkpoints and syncs confined to them, which the run does not do."""
    if processes and train_devices_per_agent % processes:
        raise ConfigError(f"config.mesh.train_devices_per_agent={train_devices_per_agent} must be a multiple of the "
                          f"{processes} processes: every training mesh spans all of them, one device of each in "
                          f"turn (e.g. mesh.train_devices_per_agent={processes} with mesh.train_slices=1)")


def check_per_process(config: RunConfig, processes: int) -> None:
    """The placement rules that depend on the process count (0 = not known yet)."""
    check_instances_per_process(config.rollout.instances_per_agent, processes)
    check_train_mesh_per_process(config.mesh.train_devices_per_agent, processes)
