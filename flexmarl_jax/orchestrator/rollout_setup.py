"""Builds the rollout side of a run: engine instances on each agent's rollout devices, the backend the
workflow talks to, and the weight-sync path from trainers to instances.

With `pipeline.balancing` (flexmarl mode) the backend is hierarchical load balancing: a RequestRouter
(per-agent queues, least-loaded dispatch, timeouts and re-queues) plus an InstanceBalancer that moves
instances between agents; a moved instance loads its new agent's last synced weights, and later syncs
reach it through the router. Otherwise it is the plain least-loaded EngineBackend.

Balancing knobs: pipeline.balance_delta, pipeline.balance_cooldown_s, pipeline.balance_poll_s,
rollout.min_instances_per_agent, rollout.request_timeout_s (0 = none), rollout.max_retries.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from flexmarl_jax.config import RunConfig
from flexmarl_jax.metrics import Timeline
from flexmarl_jax.rollout.backend import EngineBackend
from flexmarl_jax.rollout.balancer import InstanceBalancer
from flexmarl_jax.rollout.instance import EngineInstance
from flexmarl_jax.rollout.protocols import RoutableInstance
from flexmarl_jax.rollout.routed_backend import RoutedBackend
from flexmarl_jax.rollout.router import RequestRouter
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

    def reassign(self, agent: str) -> None:
        """Serves `agent` from now on (after a migration): spans so far belong to the previous agent."""
        self.flush_span()
        self.agent = agent

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
    instances: dict[str, list[TimedInstance]]  # as built; with balancing, instances may serve other agents since
    balancer: InstanceBalancer | None = None

    def shutdown(self) -> None:
        self.backend.close()
        for agent_instances in self.instances.values():
            for instance in agent_instances:
                instance.flush_span()


def engine_config_for(config: RunConfig) -> EngineConfig:
    return EngineConfig(max_concurrent_decodes=config.rollout.decode_slots,
                        max_prefill_length=config.rollout.max_prompt_length,
                        max_decode_length=config.rollout.max_response_length)


def build_rollout(config: RunConfig, layout, trainers, tokenizer, timeline: Timeline) -> RolloutHandle:
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
    if config.pipeline.balancing and config.pipeline.mode == "flexmarl":
        weights = {agent: (trainer.params, trainer.policy_version) for agent, trainer in trainers.items()}
        backend, balancer = build_balanced_backend(config, instances, tokenizer, timeline, weights)
        return RolloutHandle(backend=backend, sync_weights=backend.update_params, instances=instances,
                             balancer=balancer)
    backend = EngineBackend(instances, tokenizer)
    return RolloutHandle(backend=backend, sync_weights=backend.update_params, instances=instances)


def balancing_settings(config: RunConfig) -> dict[str, Any]:
    """The balancing knobs of a config."""
    timeout = config.rollout.request_timeout_s
    return {
        "delta": config.pipeline.balance_delta,
        "cooldown_s": config.pipeline.balance_cooldown_s,
        "poll_interval_s": config.pipeline.balance_poll_s,
        "min_instances_per_agent": config.rollout.min_instances_per_agent,
        "timeout_s": timeout if timeout > 0 else None,
        "max_retries": config.rollout.max_retries,
    }


def build_balanced_backend(config: RunConfig, instances: dict[str, list[EngineInstance]], tokenizer,
                           timeline: Timeline, weights: dict[str, tuple[Any, int]], *, start: bool = True
                           ) -> tuple[RoutedBackend, InstanceBalancer]:
    """Router + balancer over `instances`; `weights` are each agent's (params, version) served now."""
    knobs = balancing_settings(config)

    def relabel(instance: RoutableInstance, from_agent: str, to_agent: str) -> None:
        if isinstance(instance, TimedInstance):
            instance.reassign(to_agent)

    router = RequestRouter(instances, timeout_s=knobs["timeout_s"], max_retries=knobs["max_retries"],
                           initial_weights=weights, on_migrated=relabel)
    balancer = InstanceBalancer(router, delta=knobs["delta"], cooldown_s=knobs["cooldown_s"],
                                poll_interval_s=knobs["poll_interval_s"],
                                min_instances_per_agent=knobs["min_instances_per_agent"], timeline=timeline)
    return RoutedBackend(router, tokenizer, start=start, services=[balancer]), balancer
