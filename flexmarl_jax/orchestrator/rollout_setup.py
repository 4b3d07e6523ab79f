"""Builds the rollout side of a run: engine instances on each agent's rollout devices, the backend the
workflow talks to, and the weight-sync path from trainers to instances."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import ml_collections

from flexmarl_jax.metrics import Timeline
from flexmarl_jax.rollout.backend import EngineBackend
from flexmarl_jax.rollout.instance import EngineInstance
from flexmarl_jax.rollout.settings import EngineConfig


class TimedInstance(EngineInstance):
    """An EngineInstance that records its busy spans (first step after idle .. idle again) on a timeline."""

    timeline: Timeline | None = None
    agent: str | None = None

    def step(self) -> None:
        timeline = self.timeline
        if timeline is None:
            return super().step()
        with self._span_lock:
            if self._span_start is None:
                self._span_start = timeline.now()
        try:
            super().step()
        finally:
            if not self.has_work():
                self.flush_span()

    def flush_span(self) -> None:
        with self._span_lock:
            if self._span_start is not None and self.timeline is not None:
                self.timeline.add_interval(f"rollout/{self.name}", self._span_start, self.timeline.now(),
                                           kind="decode", agent=self.agent)
            self._span_start = None

    def attach(self, timeline: Timeline, agent: str) -> TimedInstance:
        self.timeline, self.agent = timeline, agent
        self._span_lock = threading.Lock()
        self._span_start = None
        timeline.declare(f"rollout/{self.name}")
        return self


@dataclasses.dataclass
class RolloutHandle:
    backend: EngineBackend
    sync_weights: Callable[[str, Any, int], None]
    instances: dict[str, list[TimedInstance]]

    def shutdown(self) -> None:
        self.backend.close()
        for agent_instances in self.instances.values():
            for instance in agent_instances:
                instance.flush_span()


def engine_config_for(config: ml_collections.ConfigDict) -> EngineConfig:
    return EngineConfig(max_concurrent_decodes=config.rollout.decode_slots,
                        max_prefill_length=config.rollout.max_prompt_length,
                        max_decode_length=config.rollout.max_response_length)


def build_rollout(config: ml_collections.ConfigDict, layout, trainers, tokenizer, timeline: Timeline) -> RolloutHandle:
    """One engine instance per (agent, rollout device group), serving the trainer's current weights."""
    engine_config = engine_config_for(config)
    instances: dict[str, list[TimedInstance]] = {}
    number = 0
    for agent, trainer in trainers.items():
        instances[agent] = []
        for group in range(len(layout[agent].rollout_groups)):
            instance = TimedInstance.create(trainer.model_config, trainer.graphdef, trainer.params, engine_config,
                                            tokenizer, mesh=layout[agent].rollout_mesh(group),
                                            policy_version=trainer.policy_version, name=f"instance{number}")
            instances[agent].append(instance.attach(timeline, agent))
            number += 1
    backend = EngineBackend(instances, tokenizer)
    return RolloutHandle(backend=backend, sync_weights=backend.update_params, instances=instances)
