"""The parts of an emulated run (`pipeline.emulate = "CHIP:MODEL"`): what `run.build_orchestrator` builds
instead of trainers, engines and weight sync on real devices. The control plane above them is the real one.

* trainers: one `EmulatedTrainer` per agent on `mesh.train_devices_per_agent` emulated chips at
  `pipeline.emulate_mfu`; with `mesh.train_slices` > 0 they lease `EmulatedSharedTraining` slices;
* engines: `rollout.instances_per_agent` `TimedInstance`s per agent over `EmulatedEngine`s of
  `mesh.rollout_devices_per_instance` chips each, scripted lengths (`rollout.max_response_length` each, or
  long-tailed around `pipeline.emulate_median_response`), behind the real router / balancer or least-loaded
  backend (`rollout_setup.backend_for`), each advancing up to `pipeline.emulate_tokens_per_call` steps per call;
* weight sync: `EmulatedWeightSync`: the model's bytes over `pipeline.emulate_sync_link` (one link per
  training chip), then the placeholder weights go to the instances as real weights would; each receiving
  instance pays the same bytes over its own chips' links (`EmulatedInstance`), and so does an instance the
  balancer moves, loading its new agent's weights from a peer before it serves.
Every emulated duration is divided by `pipeline.emulate_compression`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

from flexmarl_jax.config import RunConfig
from flexmarl_jax.config.workflow_from_config import team_agents
from flexmarl_jax.emulation.chips import Chip, get_link
from flexmarl_jax.emulation.cost_model import CostModel
from flexmarl_jax.emulation.engine import DeviceQueue, EmulatedEngine, ScriptedTokens, fixed_length, placeholder_params
from flexmarl_jax.emulation.scripts import long_tailed
from flexmarl_jax.emulation.spec import EmulatedDevice, parse_emulate
from flexmarl_jax.emulation.timescale import TimeScale
from flexmarl_jax.emulation.trainer import EmulatedTrainer
from flexmarl_jax.emulation.training_pool import EmulatedSharedTraining
from flexmarl_jax.metrics import Timeline
from flexmarl_jax.models.sources import ModelSource
from flexmarl_jax.orchestrator.agents import AgentRuntime, agent_trainer_config, sampling_for
from flexmarl_jax.orchestrator.rollout_setup import RolloutHandle, TimedInstance, backend_for
from flexmarl_jax.orchestrator.shared_training import DedicatedTraining
from flexmarl_jax.rollout.settings import EngineConfig, engine_config_for


@dataclasses.dataclass(frozen=True)
class Emulation:
    """An emulated run's devices: the chip and model, the clock's compression, the cost models, and how far an
    engine advances per call; every value from the run config (`from_config`)."""

    device: EmulatedDevice
    timescale: TimeScale
    rollout: CostModel  # one engine instance's replica
    train: CostModel  # one agent's training mesh (or one shared slice)
    sync_link_name: str
    tokens_per_call: int  # decode steps an engine advances per call at most
    # When the chip is `one_device` (this host): the timeline every engine's calls queue on, and the one every
    # trainer's calls and weight sync queue on (see chips.Chip.one_device); None for real chips.
    shared_rollout_device: DeviceQueue | None = None
    shared_train_device: DeviceQueue | None = None

    @classmethod
    def from_config(cls, config: RunConfig) -> Emulation:
        pipeline, mesh = config.pipeline, config.mesh
        device = parse_emulate(pipeline.emulate)
        timescale = TimeScale(pipeline.emulate_compression)
        rollout_device, train_device = _shared_timelines(device.chip, timescale)
        # Both cost models are at the run's MFU; only training steps read it (an engine's calls never train).
        return cls(device=device, timescale=timescale,
                   rollout=CostModel(device.model, device.chip, chips=mesh.rollout_devices_per_instance,
                                     mfu=pipeline.emulate_mfu),
                   train=CostModel(device.model, device.chip, chips=mesh.train_devices_per_agent,
                                   mfu=pipeline.emulate_mfu),
                   sync_link_name=pipeline.emulate_sync_link, tokens_per_call=pipeline.emulate_tokens_per_call,
                   shared_rollout_device=rollout_device, shared_train_device=train_device)

    def engine(self, engine_config: EngineConfig, tokenizer: Any, script: ScriptedTokens) -> EmulatedEngine:
        """One engine instance's EmulatedEngine on these devices."""
        return EmulatedEngine(self.rollout, engine_config, tokenizer, script, tokens_per_call=self.tokens_per_call,
                              timescale=self.timescale, device=self.shared_rollout_device)

    def weight_sync_s(self) -> float:
        """Device seconds of one agent's weight sync: each training chip sends its shard over its own link."""
        return self.train.weight_sync_s(self._sync_link())

    def weight_load_s(self) -> float:
        """Device seconds of one engine instance taking in a whole model (a sync's receiving side, or a moved
        instance loading its new agent's weights from a peer): each of its chips over its own link."""
        return self.rollout.weight_sync_s(self._sync_link())

    def _sync_link(self):
        name = self.device.chip.interconnect if self.sync_link_name == "interconnect" else self.sync_link_name
        return get_link(name, self.device.chip)


def _shared_timelines(chip: Chip, timescale: TimeScale) -> tuple[DeviceQueue | None, DeviceQueue | None]:
    """A `one_device` chip's two timelines (every engine's, every trainer's), each slowed while the other has
    work by the chip's measured factors (`DeviceQueue.contend_with`); (None, None) for a real chip."""
    if not chip.one_device:
        return None, None
    rollout, train = DeviceQueue(timescale), DeviceQueue(timescale)
    rollout.contend_with(train, slowdown=chip.engine_slowdown_beside_training, beside_calls_are_short=False)
    train.contend_with(rollout, slowdown=chip.training_slowdown_beside_engines, beside_calls_are_short=True)
    return rollout, train


def script_for(config: RunConfig, tokenizer: Any) -> ScriptedTokens:
    """The scripted responses of a run: filler tokens then EOS, lengths per `pipeline.emulate_median_response`."""
    cap, median = config.rollout.max_response_length, config.pipeline.emulate_median_response
    length = fixed_length(cap) if median == 0 else long_tailed(median, cap)
    filler = tokenizer.encode("a", add_bos=False)[-1]
    return ScriptedTokens(eos_id=tokenizer.eos_id, filler_id=filler, length=length)


def build_emulated_runtimes(config: RunConfig, emulation: Emulation, sources: Mapping[str, ModelSource], *,
                            clock: Callable[[], float] = time.perf_counter) -> dict[str, AgentRuntime]:
    """agent -> its runtime with an `EmulatedTrainer` (no devices: `devices` is None); with `mesh.train_slices`
    the trainers lease slices of one `EmulatedSharedTraining.make_pool`, whose pool `shared_pool_of` finds."""
    slices = (EmulatedSharedTraining.make_pool(config.mesh.train_slices, clock=clock)
              if config.mesh.train_slices else None)
    runtimes = {}
    for agent in team_agents(config.workflow):
        trainer = EmulatedTrainer(agent, emulation.train, agent_trainer_config(config, agent),
                                  timescale=emulation.timescale, slices=slices,
                                  device=emulation.shared_train_device)
        source = sources[agent]
        runtimes[agent] = AgentRuntime(name=agent, model_config=emulation.device.model, tokenizer=source.tokenizer,
                                       sampling=sampling_for(config, agent), devices=None, trainer=trainer)
    return runtimes


def start_emulated_engines(config: RunConfig, emulation: Emulation, runtimes: Mapping[str, AgentRuntime],
                           timeline: Timeline) -> tuple[dict[str, AgentRuntime], RolloutHandle]:
    """`rollout.instances_per_agent` emulated instances per agent, and the backend over all of them."""
    started, number = {}, 0
    for agent, runtime in runtimes.items():
        engine_config = engine_config_for(config, agent)
        script = script_for(config, runtime.tokenizer)
        instances = []
        for _ in range(config.rollout.instances_per_agent):
            engine = emulation.engine(engine_config, runtime.tokenizer, script)
            instance = EmulatedInstance(engine, placeholder_params(), policy_version=runtime.trainer.policy_version,
                                        name=f"instance{number}")
            instance.weight_load_s = emulation.weight_load_s()
            instances.append(instance.attach(timeline, agent))
            number += 1
        started[agent] = dataclasses.replace(runtime, instances=tuple(instances))
    weights = {agent: (runtime.trainer.params, runtime.trainer.policy_version) for agent, runtime in started.items()}
    return started, backend_for(config, started, timeline, weights)


class EmulatedInstance(TimedInstance):
    """A `TimedInstance` over an `EmulatedEngine` that pays for the weights it takes in: each `update_params`
    (a weight sync's receiving side, a migration's load) puts `weight_load_s` device seconds on its engine's
    device queue, so its next decode steps wait behind the transfer, and the transfer shows on its timeline
    row as a "load" interval. The caller is not held: a sync reaches every instance at once, in parallel.
    `wait_for_weights` holds a caller until the last load is done (the router's migration waits on it)."""

    weight_load_s: float = 0.0
    _weights_ready_at: float = 0.0

    def update_params(self, params: Any, version: int) -> None:
        device = self.engine.device
        if self.weight_load_s > 0:
            self._weights_ready_at = device.enqueue(self.weight_load_s)
            if self.timeline is not None:  # from when the work queued ahead of it is done until it lands
                now = self.timeline.now()
                end = self._busy_from(now)
                start = max(now, end - device.timescale.wall_s(self.weight_load_s))
                self.timeline.add_interval(f"rollout/{self.name}", start, end, kind="load", agent=self.agent)
        super().update_params(params, version)

    def wait_for_weights(self) -> None:
        self.engine.device.wait_until(self._weights_ready_at)

    def _busy_from(self, now: float) -> float:
        # A step taken while a load is still on the device runs after it: its decode span starts where the
        # "load" interval ends, so the two never overlap on the instance's row (syncs land while the next
        # rollout starts: the agents' syncs run at once, JointOrchestrator.sync_all).
        return now + max(0.0, self._weights_ready_at - self.engine.device.clock())


def pool_emulated_training(runtimes: Mapping[str, AgentRuntime], *, clock: Callable[[], float]):
    """The orchestrator's `TrainingPool` over the emulated trainers: shared slices when they lease some."""
    trainers = {agent: runtime.trainer for agent, runtime in runtimes.items()}
    pools = {id(trainer.slices): trainer.slices for trainer in trainers.values() if trainer.slices is not None}
    if pools:
        (pool,) = pools.values()
        return EmulatedSharedTraining(trainers, pool)
    return DedicatedTraining(trainers, clock=clock)


class EmulatedWeightSync:
    """A `sync_weights(agent, params, version)` that takes the cost model's sync time on the agent's own
    transfer queue, then hands the (placeholder) params to the rollout side."""

    def __init__(self, emulation: Emulation, push: Callable[[str, Any, int], None]):
        self.emulation, self.push = emulation, push
        self.synced: dict[str, int] = {}
        self._queues: dict[str, DeviceQueue] = {}

    def __call__(self, agent: str, params: Any, version: int) -> None:
        queue = (self.emulation.shared_train_device
                 or self._queues.setdefault(agent, DeviceQueue(self.emulation.timescale)))
        queue.run(self.emulation.weight_sync_s())
        self.synced[agent] = int(version)
        self.push(agent, params, version)
