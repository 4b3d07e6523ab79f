"""Builds the rollout side of a run: each agent's engine instances on its rollout devices (kept on its
`AgentRuntime`, with the shardings its weight sync targets), and the team's backend the workflow talks to.

Each agent's prompts are tokenised with its own tokenizer (agents of one team may run different checkpoints).
In every mode requests go through a RequestRouter (per-agent queues, least-loaded dispatch, timeouts and
re-queues) watched by an InstanceHealthMonitor, so a crashed or stuck instance's requests fail over to the
agent's other instances. With `pipeline.balancing` (flexmarl mode) an InstanceBalancer also moves instances
between agents that run the same model with the same tokenizer; a moved instance loads its new agent's last
synced weights, and later syncs reach it through the router.

Knobs (read by `rollout/routing_settings.py`): rollout.request_timeout_s (0 = none), rollout.max_retries,
rollout.instance_stall_s, run.stall_timeout_s; balancing: pipeline.balance_delta, pipeline.balance_cooldown_s,
pipeline.balance_poll_s, rollout.min_instances_per_agent.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from flexmarl_jax.config import RunConfig
from flexmarl_jax.config.lora_groups import lora_base_groups
from flexmarl_jax.metrics import Timeline
from flexmarl_jax.models.functional import param_shardings
from flexmarl_jax.models.lora import AdaptedParams, adapter_table
from flexmarl_jax.orchestrator.agents import AgentRuntime
from flexmarl_jax.rollout.backend import EngineBackend
from flexmarl_jax.rollout.balancer import InstanceBalancer
from flexmarl_jax.rollout.health import InstanceHealthMonitor
from flexmarl_jax.rollout.instance import EngineInstance
from flexmarl_jax.rollout.protocols import RoutableInstance
from flexmarl_jax.rollout.routed_backend import RoutedBackend
from flexmarl_jax.rollout.router import RequestRouter
from flexmarl_jax.rollout.routing_settings import balancer_settings_for, health_settings_for, router_settings_for
from flexmarl_jax.rollout.settings import engine_config_for
from flexmarl_jax.transfer import across_processes
from flexmarl_jax.transfer.across_processes import spans_processes


class TimedInstance(EngineInstance):
    """An EngineInstance that records its busy spans (first step after idle .. idle again) on a timeline."""

    timeline: Timeline | None = None
    agent: str | None = None
    _load_started: float | None = None  # when the weights a migration waits for were handed over

    def step(self) -> None:
        timeline = self.timeline
        if timeline is None:
            return super().step()
        with self._span_lock:
            if self._span_start is None:
                self._span_start = self._busy_from(timeline.now())
        try:
            super().step()
        finally:
            if not self.has_work():
                self.flush_span()

    def _busy_from(self, now: float) -> float:
        """When a span that opens at `now` starts being busy (an instance that knows its device queue says
        when the work ahead of the step, a weight load, is done)."""
        return now

    def flush_span(self) -> None:
        with self._span_lock:
            start = self._span_start
            # (a span that opened behind a load and ended before it, a step that only took the new weights,
            # has no decode time of its own)
            now = None if self.timeline is None else self.timeline.now()
            if start is not None and now is not None and now >= start:
                self.timeline.add_interval(f"rollout/{self.name}", start, now, kind="decode", agent=self.agent)
            self._span_start = None

    def update_params(self, params: Any, version: int) -> None:
        self._load_started = None if self.timeline is None else self.timeline.now()
        super().update_params(params, version)

    def wait_for_weights(self) -> None:
        """Waits for the transfer (a migration's load), shown as a "load" interval on this instance's row."""
        super().wait_for_weights()
        started = self._load_started
        if self.timeline is not None and started is not None:
            self.timeline.add_interval(f"rollout/{self.name}", started, self.timeline.now(), kind="load",
                                       agent=self.agent)
            self._load_started = None

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
    """The team's rollout side: one backend over every agent's instances (it spans agents, since balancing
    moves instances between them). Each agent's instances as built are on its `AgentRuntime`."""

    backend: EngineBackend
    sync_weights: Callable[[str, Any, int], None]
    instances: tuple[TimedInstance, ...]  # every instance of the team, to close their timeline spans
    balancer: InstanceBalancer | None = None

    def shutdown(self) -> None:
        self.backend.close()
        for instance in self.instances:
            instance.flush_span()


def start_engines(config: RunConfig, runtimes: Mapping[str, AgentRuntime], timeline: Timeline
                  ) -> tuple[dict[str, AgentRuntime], RolloutHandle]:
    """One engine instance per (agent, rollout device group), serving the agent's trainer's current weights,
    and the backend over all of them. Returns the runtimes with their instances and rollout shardings.

    Call once the trainers hold the weights rollout starts from (after a resume or warm-up): the engines
    copy them now. The trainers must still be `AgentTrainer`s (before `agents.pool_training`).

    With several processes each builds the instances on its own devices only (every process holds instances of
    every agent: config rule), numbered as in the whole team; a training mesh that spans processes gives its
    weights to them through `across_processes.put` (a collective, issued here in agent order).
    """
    started: dict[str, AgentRuntime] = {}
    weights: dict[str, tuple[Any, int]] = {}
    groups = lora_base_groups(config, order=list(runtimes))
    number = 0
    for agent, runtime in runtimes.items():
        trainer, devices = runtime.trainer, runtime.devices
        if agent in groups and groups[agent][0] != agent:  # served by its group leader's instances
            started[agent] = dataclasses.replace(runtime, rollout_shardings=started[groups[agent][0]].rollout_shardings)
            weights[agent] = (trainer.rollout_weights, trainer.policy_version)
            continue
        engine_config = engine_config_for(config, agent)
        local_groups = [group for group, members in enumerate(devices.rollout_groups)
                        if all(device.process_index == jax.process_index() for device in members)]
        if not local_groups:
            raise RuntimeError(f"process {jax.process_index()} holds no rollout instance of agent {agent!r}; "
                               f"its device groups: {devices.rollout_groups}")
        if agent in groups:
            served = _group_params(runtimes, groups[agent])
            shardings = NamedSharding(devices.rollout_mesh(local_groups[0]), PartitionSpec())  # adapters replicated
            params = trainer.rollout_weights  # what its sync sends: the adapter
            extra = {"adapter_agents": groups[agent]}
        else:
            shardings = param_shardings(trainer.params, devices.rollout_mesh(local_groups[0]))
            spanning = any(spans_processes(leaf) for leaf in jax.tree.leaves(trainer.params))
            served = params = across_processes.put(trainer.params, shardings) if spanning else trainer.params
            extra = {}
        instances = []
        for group in range(len(devices.rollout_groups)):
            if group in local_groups:
                instance = TimedInstance.create(runtime.model_config, trainer.graphdef, served, engine_config,
                                                runtime.tokenizer, mesh=devices.rollout_mesh(group),
                                                policy_version=trainer.policy_version, name=f"instance{number}",
                                                **extra)
                instances.append(instance.attach(timeline, agent))
            number += 1
        started[agent] = dataclasses.replace(runtime, instances=tuple(instances), rollout_shardings=shardings)
        weights[agent] = (params, trainer.policy_version)
    return started, backend_for(config, started, timeline, weights, groups)


def _group_params(runtimes: Mapping[str, AgentRuntime], group: tuple[str, ...]) -> AdaptedParams:
    """What a base group's instance starts from: the base once, and each agent's adapter in both of its rows
    (current and spare), zero-padded to the group's largest rank."""
    weights = [runtimes[agent].trainer.rollout_weights for agent in group]
    # Each adapter lives on its own trainer's mesh: the table is stacked on the host, then placed on the engine's.
    adapters = [jax.tree.map(np.asarray, w.adapter) for w in weights]
    table = adapter_table([a for a in adapters for _ in range(2)], [w.spec for w in weights for _ in range(2)])
    return AdaptedParams(runtimes[group[0]].trainer.base_params, table)


def backend_for(config: RunConfig, started: Mapping[str, AgentRuntime], timeline: Timeline,
                weights: dict[str, tuple[Any, int]], groups: Mapping[str, tuple[str, ...]] | None = None
                ) -> RolloutHandle:
    """The team's backend over the runtimes' instances: the router in every mode (failover), plus the balancer
    with `pipeline.balancing` in the flexmarl mode. `weights`: agent -> (params, version) its instances serve now.
    `groups` (`config.lora_groups.lora_base_groups`): a LoRA agent is served by its group leader's instances."""
    groups = groups or {}
    instances = {agent: list(started[groups.get(agent, (agent,))[0]].instances) for agent in started}
    every_instance = tuple(instance for runtime in started.values() for instance in runtime.instances)
    tokenizers = {agent: runtime.tokenizer for agent, runtime in started.items()}
    backend, balancer = build_routed_backend(config, instances, tokenizers, timeline, weights)
    return RolloutHandle(backend=backend, sync_weights=backend.update_params, instances=every_instance,
                         balancer=balancer)


def build_routed_backend(config: RunConfig, instances: dict[str, list[EngineInstance]], tokenizers,
                         timeline: Timeline, weights: dict[str, tuple[Any, int]], *, start: bool = True
                         ) -> tuple[RoutedBackend, InstanceBalancer | None]:
    """Router + health monitor (+ balancer with `pipeline.balancing` in flexmarl mode) over `instances`;
    `tokenizers` agent -> its tokenizer; `weights` are each agent's (params, version) served now. Instances
    move only between agents of one model and tokenizer."""

    def relabel(instance: RoutableInstance, from_agent: str, to_agent: str) -> None:
        if isinstance(instance, TimedInstance):
            instance.reassign(to_agent)

    router = RequestRouter(instances, **router_settings_for(config), initial_weights=weights, on_migrated=relabel)
    services: list[Any] = [InstanceHealthMonitor(router, **health_settings_for(config))]
    balancer = None
    if config.pipeline.balancing and config.pipeline.mode == "flexmarl":
        balancer = InstanceBalancer(router, **balancer_settings_for(config), timeline=timeline)
        services.append(balancer)
    return RoutedBackend(router, tokenizers, start=start, services=services), balancer
