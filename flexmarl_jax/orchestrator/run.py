"""`flexmarl train`: builds every component from a checked `RunConfig` and runs the iterations.

Resume: a workdir holding checkpoints continues from the last one. An iteration is atomic: its update is
applied and checkpointed before its rows are marked consumed, and a run killed mid-iteration redoes that
iteration from the last checkpoint — nothing it had claimed was applied, so no sample is counted twice
(`journal.RunJournal` keeps the side files this needs).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping

import jax
from jax.sharding import Mesh

from flexmarl_jax import metrics
from flexmarl_jax.config import RunConfig
from flexmarl_jax.mesh.layout import layout_devices
from flexmarl_jax.mesh.meshes import make_mesh
from flexmarl_jax.models import presets
from flexmarl_jax.models.functional import param_shardings
from flexmarl_jax.models.tokenizer import CharTokenizer
from flexmarl_jax.orchestrator.journal import RunJournal
from flexmarl_jax.orchestrator.pipeline import JointOrchestrator, PipelineSettings
from flexmarl_jax.orchestrator.rollout_setup import build_rollout
from flexmarl_jax.orchestrator.shared_training import DedicatedTraining, SharedTraining
from flexmarl_jax.orchestrator.warmup import run_warmup, warmup_examples
from flexmarl_jax.orchestrator.weight_sync import StoreWeightSync
from flexmarl_jax.store import ExperienceStore
from flexmarl_jax.train.algorithms import loss_config_for
from flexmarl_jax.train.checkpoint import restore_trainer, save_all
from flexmarl_jax.train.from_config import trainer_config_for
from flexmarl_jax.train.trainer import AgentTrainer
from flexmarl_jax.transfer import StateStore
from flexmarl_jax.workflows import SamplingParams
from flexmarl_jax.workflows.from_config import task_from_config, team_agents, workflow_from_config

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"


def build_trainers(config: RunConfig, layout, *, train_meshes: Mapping[str, Mesh] | None = None):
    """agent -> AgentTrainer on that agent's training mesh (or on ``train_meshes[agent]``)."""
    trainers = {}
    for index, agent in enumerate(team_agents(config.workflow)):
        # The run trains without truncated importance sampling, also with max_staleness > 0, and pads to
        # prompt + response tokens (one more than the loss needs).
        trainer_config = dataclasses.replace(
            trainer_config_for(config, agent, tis_cap=None),
            max_len=config.rollout.max_prompt_length + config.rollout.max_response_length)
        trainers[agent] = AgentTrainer(agent, presets.get_preset(config.agents[agent].model), trainer_config,
                                       mesh=train_meshes[agent] if train_meshes is not None
                                       else layout[agent].train_mesh(config.mesh.tp),
                                       seed=config.seed * 1000 + index)
    return trainers


def sampling_for(config: RunConfig) -> dict[str, SamplingParams]:
    return {agent: SamplingParams(temperature=config.agents[agent].temperature, top_k=config.agents[agent].top_k,
                                  top_p=config.agents[agent].top_p,
                                  max_new_tokens=config.rollout.max_response_length)
            for agent in team_agents(config.workflow)}


def agent_layout(config: RunConfig):
    """Each agent's rollout and training devices (`mesh.layout.layout_devices`) for a config. With shared
    training slices (`mesh.train_slices`) agents get no training devices of their own."""
    mesh = config.mesh
    return layout_devices(jax.devices(), team_agents(config.workflow),
                          instances_per_agent=config.rollout.instances_per_agent,
                          rollout_devices_per_instance=mesh.rollout_devices_per_instance,
                          train_devices_per_agent=0 if mesh.train_slices else mesh.train_devices_per_agent,
                          colocate=config.pipeline.mode == "serial")


def build_orchestrator(config: RunConfig, *, timeline: metrics.Timeline | None = None,
                       resume: bool = True):
    """Everything a run needs: (orchestrator, trainers, store, rollout handle, start iteration)."""
    agents = team_agents(config.workflow)
    mode = config.pipeline.mode
    train_slices = config.mesh.train_slices
    if train_slices and mode == "serial":
        raise ValueError(f"mesh.train_slices={train_slices} needs disaggregated training (pipeline.mode sync or "
                         "flexmarl); the serial mode colocates each agent's rollout on its training mesh")
    layout = agent_layout(config)
    tokenizer = CharTokenizer()
    slice_meshes = training_slice_meshes(config, layout, train_slices) if train_slices else None
    # With shared slices, agent i starts on slice i mod S (its state is offloaded to host right after setup).
    trainers = build_trainers(config, layout, train_meshes=None if slice_meshes is None else {
        agent: slice_meshes[index % train_slices] for index, agent in enumerate(agents)})
    workflow = workflow_from_config(config.workflow)
    task = task_from_config(config.workflow)
    checkpoint_root = os.path.join(config.workdir, CHECKPOINT_DIR)
    start = 0
    common = _resume_version(checkpoint_root, agents) if resume else None
    if common is not None:
        # Agents are saved one after another; a run killed in between leaves some agents one version
        # ahead. Restore every agent at the newest version that all of them completed.
        for agent, trainer in trainers.items():
            restore_trainer(trainer, os.path.join(checkpoint_root, agent), policy_version=common)
        start = common
        logger.info("resumed from %s at policy version %d", checkpoint_root, common)
    elif config.workflow.warmup_steps > 0:
        examples = warmup_examples(workflow, task, queries=256, samples_per_query=1, accuracy=0.2,
                                   seed=config.seed)
        run_warmup(trainers, examples, tokenizer, steps=config.workflow.warmup_steps, seed=config.seed)
        save_all(trainers, checkpoint_root)
    if timeline is None:
        saved = os.path.join(config.workdir, metrics.TIMELINE_FILENAME)
        # A resumed run keeps recording on its old timeline, so the plots cover the whole run.
        timeline = metrics.Timeline.load(saved) if common is not None and os.path.isfile(saved) else metrics.Timeline()
    store = ExperienceStore.open(config.workdir, agents=agents, backend=config.store.backend)
    rollout = build_rollout(config, layout, trainers, tokenizer, timeline)
    state_store = StateStore()
    if slice_meshes is not None:
        # Agent-centric allocation: agents hold a slice only while they have a micro-batch. The rollout
        # instances above copied the initial weights; the orchestrator syncs every agent before rollout.
        training = SharedTraining(trainers, slice_meshes, store=state_store, clock=timeline.now)
    else:
        training = DedicatedTraining(trainers, clock=timeline.now)
    trainers = training.trainers
    rollout_targets = {agent: param_shardings(trainers[agent].params, layout[agent].rollout_mesh(0))
                       for agent in agents}
    sync_weights = StoreWeightSync(state_store, rollout.sync_weights, target_for=rollout_targets.__getitem__)
    settings = PipelineSettings(
        mode=mode, async_micro_batches=config.pipeline.async_micro_batches,
        queries_per_iteration=config.workflow.queries_per_iteration,
        samples_per_query=config.workflow.samples_per_query, micro_batch_size=config.train.micro_batch_size,
        max_response_length=config.rollout.max_response_length, max_staleness=config.train.max_staleness,
        seed=config.seed, debug_invariants=config.pipeline.debug_invariants)
    loss = loss_config_for(config.train.algorithm)
    orchestrator = JointOrchestrator(
        settings, training=training, store=store, workflow=workflow, task=task, backend=rollout.backend,
        sync_weights=sync_weights, sampling=sampling_for(config), pad_id=tokenizer.pad_id,
        aggregation=loss.aggregation, estimator=loss.advantage_estimator, timeline=timeline,
        on_update_applied=lambda iteration, record, trained: _checkpoint(
            trainers, config.workdir, RunJournal(config.workdir), record, trained))
    return orchestrator, trainers, store, rollout, start


def training_slice_meshes(config: RunConfig, layout, train_slices: int) -> list[Mesh]:
    """``train_slices`` meshes of ``mesh.train_devices_per_agent`` devices each, from the devices that no
    rollout instance uses (in device order)."""
    used = {device for agent_devices in layout.values() for group in agent_devices.rollout_groups
            for device in group}
    free = [device for device in jax.devices() if device not in used]
    per_slice = config.mesh.train_devices_per_agent
    if len(free) < train_slices * per_slice:
        raise ValueError(f"mesh.train_slices={train_slices} x mesh.train_devices_per_agent={per_slice} needs "
                         f"{train_slices * per_slice} devices; {len(free)} are left after the rollout instances")
    return [make_mesh(free[i * per_slice:(i + 1) * per_slice], fsdp=per_slice // config.mesh.tp, tp=config.mesh.tp)
            for i in range(train_slices)]


def _checkpoint(trainers, workdir: str, journal: RunJournal, record: dict, trained: dict[str, list[str]]) -> None:
    """After an iteration's update: the journal keeps its record and trained sample ids, then every agent's
    state is saved (the journal's invariant: this precedes `mark_consumed`)."""
    journal.before_checkpoint(metrics.to_jsonable(record), trained)
    save_all(trainers, os.path.join(workdir, CHECKPOINT_DIR), max_to_keep=2)


def _resume_version(root: str, agents) -> int | None:
    """The newest policy version with a finished checkpoint for every agent (None: nothing to resume).

    Agents are saved one after another; a run killed in between leaves some agents one version ahead.
    Those newer checkpoints belong to the iteration being redone: they are deleted here."""
    import orbax.checkpoint as ocp

    steps = {}
    for agent in agents:
        directory = os.path.abspath(os.path.join(root, agent))
        if not os.path.isdir(directory):
            return None
        with ocp.CheckpointManager(directory) as manager:
            steps[agent] = set(manager.all_steps())
    common = set.intersection(*steps.values())
    if not common:
        return None
    newest = max(common)
    for agent in agents:
        newer = sorted(step for step in steps[agent] if step > newest)
        if newer:
            with ocp.CheckpointManager(os.path.abspath(os.path.join(root, agent))) as manager:
                for step in newer:
                    manager.delete(step)
    return newest


def _begin_attempt(orchestrator: JointOrchestrator, journal: RunJournal, iteration: int) -> None:
    """Records that `iteration` starts. If an earlier run started it and died before its update was
    checkpointed, the durable store still holds that attempt's unapplied rows: drop them and redo it."""
    previous = journal.begin_attempt(iteration)
    orchestrator.attempts[iteration] = previous
    if previous:
        dropped = orchestrator.store.drop_stale_rows(current_versions=iteration + 1, max_staleness=0)
        logger.info("redoing iteration %d (attempt %d); dropped %d unapplied rows", iteration, previous, dropped)


def run_training(config: RunConfig) -> int:
    """Runs `config.iterations` iterations (resuming from the workdir); returns a process exit code."""
    workdir = config.workdir
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as handle:
        handle.write(config.to_json(indent=1))  # the typed config, every field (RunConfig.to_dict)
    started = time.monotonic()
    orchestrator, trainers, store, rollout, start = build_orchestrator(config)
    timeline = orchestrator.timeline
    orchestrator.set_horizon(config.iterations)
    writer = metrics.MetricsWriter(workdir)
    journal = RunJournal(workdir)
    journal.settle(store, writer, start)
    try:
        with metrics.IterationProgress(total=config.iterations, initial=start) as progress:
            for iteration in range(start, config.iterations):
                if config.store.backend == "file":
                    _begin_attempt(orchestrator, journal, iteration)
                record = orchestrator.run_iteration(iteration)
                writer.write(record)
                journal.iteration_logged()
                timeline.save(workdir)
                progress.advance(record)
    finally:
        rollout.shutdown()
        store.close()
        writer.close()
    metrics.print_summary(writer.records)
    from flexmarl_jax.metrics import plots

    paths = plots.plot_all(workdir, timeline)
    print(f"run finished in {time.monotonic() - started:.1f}s; metrics: {os.path.join(workdir, 'metrics.jsonl')}; "
          f"plots: {', '.join(str(p) for p in paths)}")
    return 0
