"""LoRA base groups: the LoRA agents of one `model` (the same checkpoint directory, or the same preset) train
adapters on one frozen base. A group shares that base in memory and is served by one set of engines, each of
which holds the base once and an adapter table with every agent of the group (rollout/instance.py); its
agents take their rollout devices from the group's first agent (orchestrator/agents.py, `agent_layout`).

One definition, used by the config's checks, the device layout and the engines' setup.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flexmarl_jax.config.schema import RunConfig


def base_key(model: str) -> str:
    """What makes two agents' models one base: a checkpoint directory's real path, or the preset's name."""
    return os.path.realpath(model) if os.path.isdir(model) else model


def lora_base_groups(config: RunConfig, order: Sequence[str] | None = None) -> dict[str, tuple[str, ...]]:
    """LoRA agent (rank > 0) -> the LoRA agents of its base group, in `order` (default `config.agents` order; a
    run passes its team order): the first is the group's leader, whose rollout devices its engines run on.
    Full fine-tunes are in no group."""
    by_base: dict[str, list[str]] = {}
    for name in config.agents if order is None else order:
        agent = config.agents[name]
        if agent.lora.enabled:
            by_base.setdefault(base_key(agent.model), []).append(name)
    return {name: tuple(members) for members in by_base.values() for name in members}
