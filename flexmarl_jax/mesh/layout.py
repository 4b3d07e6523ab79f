"""Splitting the machine's devices into per-agent rollout instances and training meshes.

Disaggregated modes (`sync`, `flexmarl`) give every agent its own rollout devices (one group per engine
instance) and its own training devices, all disjoint. The `serial` mode colocates: an agent's rollout
instances run on its training devices, as naive single-agent RL moved to multi-agent does. `mesh.colocate`
goes further for machines with fewer devices than agents (one GPU, a CPU with one device): every agent's
rollout and training share its devices, and agents reuse devices in turn once every device is taken.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from flexmarl_jax.mesh.meshes import make_mesh


@dataclasses.dataclass(frozen=True)
class AgentDevices:
    """The devices one agent binds: one device group per rollout instance, and one training group."""

    agent: str
    rollout_groups: tuple[tuple, ...]
    train_devices: tuple

    def train_mesh(self, tp: int = 1):
        return make_mesh(self.train_devices, fsdp=len(self.train_devices) // tp, tp=tp)

    def rollout_mesh(self, instance: int):
        group = self.rollout_groups[instance]
        return make_mesh(group, fsdp=len(group), tp=1)


def layout_devices(devices: Sequence, agents: Sequence[str], *, instances_per_agent: int,
                   rollout_devices_per_instance: int, train_devices_per_agent: int,
                   colocate: bool = False, share_between_agents: bool = False) -> dict[str, AgentDevices]:
    """Assigns devices to agents in order: each agent's rollout groups, then its training group.

    With `colocate`, rollout instances reuse the agent's training devices (one device group each). With
    `share_between_agents` (implies colocate) agents wrap around the device list: agent i trains on devices
    ``[i*t, (i+1)*t)`` modulo the device count, so one device can serve a whole team.
    """
    devices = list(devices)
    colocate = colocate or share_between_agents
    per_agent = train_devices_per_agent + (0 if colocate else instances_per_agent * rollout_devices_per_instance)
    needed = per_agent if share_between_agents else per_agent * len(agents)
    if needed > len(devices):
        count = "" if share_between_agents else f"{len(agents)} agents x "
        raise ValueError(f"the layout needs {needed} devices ({count}{per_agent}) but {len(devices)} exist")
    layout, cursor = {}, 0
    for agent in agents:
        if colocate:
            if cursor + train_devices_per_agent > len(devices):
                cursor = 0  # only reached when sharing: start over at the first device
            train = tuple(devices[cursor:cursor + train_devices_per_agent])
            cursor += train_devices_per_agent
            groups = tuple(train for _ in range(instances_per_agent))
        else:
            groups = []
            for _ in range(instances_per_agent):
                groups.append(tuple(devices[cursor:cursor + rollout_devices_per_instance]))
                cursor += rollout_devices_per_instance
            train = tuple(devices[cursor:cursor + train_devices_per_agent])
            cursor += train_devices_per_agent
            groups = tuple(groups)
        layout[agent] = AgentDevices(agent=agent, rollout_groups=groups, train_devices=train)
    return layout
