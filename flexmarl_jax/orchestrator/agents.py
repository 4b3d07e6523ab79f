"""One runtime per agent: everything a single agent of the team owns, built from the typed `RunConfig`.

    layout = agent_layout(config)
    runtimes = build_agent_runtimes(config, layout)           # trainers, tokenizers, sampling, devices
    ... restore or warm up the trainers ...                   # (run.py)
    runtimes, rollout = start_engines(config, runtimes, timeline)   # rollout_setup.py: engines per agent
    training, runtimes = pool_training(runtimes, slice_meshes, store=state_store, clock=timeline.now)

An agent is built in these steps, not in one call, because each step needs the previous one finished:
engines copy the trainer's weights when they are built, so they start after a resume or warm-up has set
those weights; and a shared training pool takes each trainer's state into its `StateStore`, so it wraps the
trainers last. Runs with scripted rollouts (tests, `bench swap`) skip `start_engines`.

What spans agents stays outside a runtime: the router/backend (instances migrate between agents), the
experience store, the `StateStore` and the `TrainingPool`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from flexmarl_jax.config import RunConfig
from flexmarl_jax.config.lora_groups import lora_base_groups
from flexmarl_jax.config.workflow_from_config import team_agents
from flexmarl_jax.mesh.layout import AgentDevices, interleave_processes, layout_devices
from flexmarl_jax.mesh.meshes import make_mesh
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.functional import init_params
from flexmarl_jax.models.sources import ModelSource, resolve_model
from flexmarl_jax.models.tokenizer import Tokenizer
from flexmarl_jax.orchestrator.shared_training import DedicatedTraining, SharedTraining, TrainingPool
from flexmarl_jax.train.from_config import trainer_config_for
from flexmarl_jax.train.trainer import AgentTrainer, TrainerConfig
from flexmarl_jax.transfer import StateStore
from flexmarl_jax.workflows import SamplingParams


@dataclasses.dataclass(frozen=True)
class AgentRuntime:
    """One agent's parts. Frozen: each build step returns new runtimes (`dataclasses.replace`).

    name: the agent (a key of `config.agents`).
    model_config: its model's architecture (a preset or a checkpoint's config).
    tokenizer: encodes its prompts and pads its micro-batches (`pad_id`).
    sampling: how its rollouts sample (seeds are derived per request).
    devices: its `mesh.layout` entry: one device group per engine instance, and its own training devices
        (none with shared training slices).
    trainer: what trains it: its `AgentTrainer`, or the training pool's stand-in for it once pooled
        (`pool_training`); the orchestrator trains through this one.
    instances: its engine instances as built (with balancing they may later serve other agents); empty
        until `start_engines`, and with scripted rollouts.
    rollout_shardings: where a weight sync places its parameters (a sharding pytree like the params, on
        its first rollout group's mesh); None without engines.
    """

    name: str
    model_config: ModelConfig
    tokenizer: Tokenizer
    sampling: SamplingParams
    devices: AgentDevices
    trainer: Any
    instances: tuple[Any, ...] = ()
    rollout_shardings: Any = None

    @property
    def pad_id(self) -> int:
        """The pad token of its micro-batches (its tokenizer's)."""
        return self.tokenizer.pad_id


def agent_layout(config: RunConfig) -> dict[str, AgentDevices]:
    """Each agent's rollout and training devices (`mesh.layout.layout_devices`) for a config. With shared
    training slices (`mesh.train_slices`) agents get no training devices of their own; with `mesh.colocate`
    each agent's rollout runs on its training devices, and agents share devices when there are too few. With
    several processes the devices alternate between hosts (`mesh.layout.interleave_processes`). The agents of a
    LoRA base group share their leader's rollout devices: one set of engines serves the whole group."""
    mesh = config.mesh
    team = team_agents(config.workflow)
    groups = lora_base_groups(config, order=team)
    return layout_devices(interleave_processes(jax.devices()), team,
                          instances_per_agent=config.rollout.instances_per_agent,
                          rollout_devices_per_instance=mesh.rollout_devices_per_instance,
                          train_devices_per_agent=0 if mesh.train_slices else mesh.train_devices_per_agent,
                          colocate=config.pipeline.mode == "serial", share_between_agents=mesh.colocate,
                          rollout_leaders={agent: group[0] for agent, group in groups.items()})


def training_slice_meshes(config: RunConfig, layout: Mapping[str, AgentDevices], train_slices: int) -> list[Mesh]:
    """``train_slices`` meshes of ``mesh.train_devices_per_agent`` devices each, from the devices that no
    rollout instance uses (in device order; with several processes alternating between hosts, so a slice of
    two devices on two hosts spans both)."""
    used = {device for agent_devices in layout.values() for group in agent_devices.rollout_groups
            for device in group}
    free = [device for device in interleave_processes(jax.devices()) if device not in used]
    per_slice = config.mesh.train_devices_per_agent
    if len(free) < train_slices * per_slice:
        raise ValueError(f"mesh.train_slices={train_slices} x mesh.train_devices_per_agent={per_slice} needs "
                         f"{train_slices * per_slice} devices; {len(free)} are left after the rollout instances")
    return [make_mesh(free[i * per_slice:(i + 1) * per_slice], fsdp=per_slice // config.mesh.tp, tp=config.mesh.tp)
            for i in range(train_slices)]


def sampling_for(config: RunConfig, agent: str) -> SamplingParams:
    """How ``agent``'s rollouts sample: its own temperature, top-k, top-p and stop pattern; the run's response
    cap."""
    settings = config.agents[agent]
    return SamplingParams(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                          max_new_tokens=config.rollout.max_response_length, stop_pattern=settings.stop_pattern)


def agent_trainer_config(config: RunConfig, agent: str) -> TrainerConfig:
    """``agent``'s TrainerConfig in a run (`train.from_config.trainer_config_for`: truncated IS when
    max_staleness > 0), padded to prompt + response tokens (one more than the loss needs)."""
    return dataclasses.replace(trainer_config_for(config, agent),
                               max_len=config.rollout.max_prompt_length + config.rollout.max_response_length)


def model_sources(config: RunConfig) -> dict[str, ModelSource]:
    """agent -> its model source (`agents.<name>.model`: a preset, or a checkpoint directory read and checked
    without loading weights), in first-call order."""
    return {agent: resolve_model(config.agents[agent].model) for agent in team_agents(config.workflow)}


def build_agent_runtimes(config: RunConfig, layout: Mapping[str, AgentDevices], *,
                         sources: Mapping[str, ModelSource] | None = None,
                         train_meshes: Mapping[str, Mesh] | None = None,
                         trainer_overrides: Mapping[str, Any] | None = None) -> dict[str, AgentRuntime]:
    """agent -> its runtime (no engines yet: `rollout_setup.start_engines`), in first-call order.

    layout: agent -> its devices (`agent_layout`); each trainer is built on its training mesh unless
        ``train_meshes[agent]`` names another (a shared slice, or one mesh for every agent in tests).
    sources: agent -> its `ModelSource` (default: `model_sources(config)`). A checkpoint's weights load straight
        onto the agent's training mesh; a preset is initialised with seed ``config.seed * 1000 + i`` (agent i).
        LoRA agents of one model share its weights: a preset base takes the seed of the group's first agent,
        and each agent's adapter its own.
    trainer_overrides: TrainerConfig fields to replace for every agent (what a RunConfig cannot express,
        e.g. an optimizer with another eps in tests).
    """
    sources = model_sources(config) if sources is None else sources
    runtimes = {}
    base_records: dict[str, dict] = {}  # a LoRA base group's record, by model (its digest is computed once)
    bases: dict[tuple[str, Mesh], Any] = {}  # a LoRA base group's weights on one training mesh
    for index, agent in enumerate(team_agents(config.workflow)):
        source = sources[agent]
        trainer_config = dataclasses.replace(agent_trainer_config(config, agent), **(trainer_overrides or {}))
        mesh = train_meshes[agent] if train_meshes is not None else layout[agent].train_mesh(config.mesh.tp)
        # Weights load in the dtype they are trained in; with master weights in float32, which the trainer keeps
        # as the master copy and casts for the bfloat16 parameters.
        load_dtype = jnp.dtype("float32" if trainer_config.fp32_master_weights else trainer_config.dtype)
        seed = config.seed * 1000 + index
        base_record = None
        if trainer_config.lora.rank:
            key = source.checkpoint_dir or source.name
            base_record = base_records.setdefault(key, source.base_record(init_seed=seed))
            # One frozen base per group and mesh: agents of a group on one mesh hold the same arrays.
            if (key, mesh) not in bases:
                initial = source.initial_weights(mesh=mesh, dtype=load_dtype)
                if initial is None:  # a preset: the group's weights, not this agent's own random init
                    initial = init_params(source.model_config, seed=base_record["init_seed"], mesh=mesh,
                                          dtype=load_dtype)
                bases[(key, mesh)] = initial
            initial = bases[(key, mesh)]
        else:
            initial = source.initial_weights(mesh=mesh, dtype=load_dtype)
        trainer = AgentTrainer(agent, source.model_config, trainer_config, mesh=mesh, seed=seed, initial=initial,
                               base_record=base_record)
        runtimes[agent] = AgentRuntime(name=agent, model_config=source.model_config, tokenizer=source.tokenizer,
                                       sampling=sampling_for(config, agent), devices=layout[agent], trainer=trainer)
    return runtimes


def trainers_of(runtimes: Mapping[str, AgentRuntime]) -> dict[str, Any]:
    """agent -> the trainer it trains through."""
    return {name: runtime.trainer for name, runtime in runtimes.items()}


def pool_training(runtimes: Mapping[str, AgentRuntime], slice_meshes: Sequence[Mesh] | None = None, *,
                  store: StateStore | None = None, clock: Callable[[], float] = time.perf_counter,
                  acquire_timeout: float | None = None) -> tuple[TrainingPool, dict[str, AgentRuntime]]:
    """Where the agents train, and the runtimes that train there.

    slice_meshes: None or empty = `DedicatedTraining` (each trainer stays on its mesh); else
        `SharedTraining` on these slices, which takes each trainer's state into ``store`` and hands back a
        stand-in per agent: the returned runtimes hold those, and the old runtimes' trainers must not be
        used afterwards. acquire_timeout: seconds an agent may wait for a shared slice (None: forever).
    clock: seconds for the pool's busy accounting (a run passes its timeline's clock).
    """
    trainers = trainers_of(runtimes)
    if slice_meshes:
        training = SharedTraining(trainers, slice_meshes, store=store, acquire_timeout=acquire_timeout, clock=clock)
    else:
        training = DedicatedTraining(trainers, clock=clock)
    return training, {name: dataclasses.replace(runtime, trainer=training.trainers[name])
                      for name, runtime in runtimes.items()}
