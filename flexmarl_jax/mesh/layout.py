"""Splitting the machine's devices into per-agent rollout instances and training meshes.

Disaggregated modes (`sync`, `flexmarl`) give every agent its own rollout devices (one group per engine
instance) and its own training devices, all disjoint. The `serial` mode colocates: an agent's rollout
instances run on its training devices, as naive single-agent RL moved to multi-agent does. `mesh.colocate`
goes further for machines with fewer devices than agents (one GPU, a CPU with one device): every agent's
rollout and training share its devices, and agents reuse devices in turn once every device is taken.

With several processes (hosts) the devices are laid out in `interleave_processes` order: an agent's rollout
instances alternate between hosts (each host then holds an instance of every agent when instances_per_agent
is a multiple of the host count), and a training mesh of several devices takes one from each host in turn.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

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


def interleave_processes(devices: Sequence) -> list:
    """``devices`` round-robin over their processes: the first of each process, then the second of each, ...
    (the order of one process's devices is kept). One process: ``devices`` as they are."""
    by_process: dict[int, list] = {}
    for device in devices:
        by_process.setdefault(device.process_index, []).append(device)
    columns = itertools.zip_longest(*(by_process[index] for index in sorted(by_process)))
    return [device for column in columns for device in column if device is not None]


def layout_devices(devices: Sequence, agents: Sequence[str], *, instances_per_agent: int,
                   rollout_devices_per_instance: int, train_devices_per_agent: int,
                   colocate: bool = False, share_between_agents: bool = False,
                   rollout_leaders: Mapping[str, str] | None = None) -> dict[str, AgentDevices]:
    """Assigns devices to agents in order: each agent's rollout groups, then its training group.

    With `colocate`, rollout instances reuse the agent's training devices (one device group each). With
    `share_between_agents` (implies colocate) agents wrap around the device list: agent i trains on devices
    ``[i*t, (i+1)*t)`` modulo the device count, so one device can serve a whole team. `rollout_leaders`: agent ->
    the agent whose rollout groups it shares (a LoRA base group's leader, config/lora_groups.py; it comes
    earlier in `agents`); such an agent takes no rollout devices of its own.
    """
    devices = list(devices)
    colocate = colocate or share_between_agents
    leaders = dict(rollout_leaders or {})
    followers = sum(1 for agent in agents if leaders.get(agent, agent) != agent)
    rollout_per_agent = 0 if colocate else instances_per_agent * rollout_devices_per_instance
    per_agent = train_devices_per_agent + rollout_per_agent
    needed = per_agent if share_between_agents else per_agent * len(agents) - rollout_per_agent * followers
    if needed > len(devices):
        count = "" if share_between_agents else f"{len(agents)} agents x "
        shared = f", {followers} of them on their LoRA group's rollout devices" if followers and count else ""
        raise ValueError(f"the layout needs {needed} devices ({count}{per_agent}{shared}) but {len(devices)} exist")
    layout, cursor = {}, 0
    for agent in agents:
        leader = leaders.get(agent, agent)
        if leader != agent and not colocate:
            train = tuple(devices[cursor:cursor + train_devices_per_agent])
            cursor += train_devices_per_agent
            layout[agent] = AgentDevices(agent=agent, rollout_groups=layout[leader].rollout_groups, train_devices=train)
            continue
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
