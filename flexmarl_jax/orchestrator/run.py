"""`flexmarl train`: builds every component from a checked `RunConfig` and runs the iterations.

Resume: a workdir holding checkpoints continues from the last one that every agent holds intact
(`resume.prepare_resume`; one that fails verification is reported and passed over). An iteration is atomic: its
update is applied and checkpointed before its rows are marked consumed, and a run killed mid-iteration redoes that
iteration from the last checkpoint — nothing it had claimed was applied, so no sample is counted twice
(`journal.RunJournal` keeps the side files this needs).

Failures (docs/architecture.md, "Failures"): one live run per workdir (`workdir_lock`); a trainer error is
retried once (`retry`); a stall ends the run through the pipeline's bounded waits or the `watchdog`; SIGTERM
and SIGINT stop it at a consistent point (`stop_signals`). Every early end is recorded in the journal
(`stops.jsonl`) and exits non-zero with one line saying that the workdir resumes.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import NamedTuple

import jax

from flexmarl_jax import faults, metrics, workdir_paths
from flexmarl_jax.config import ConfigError, RunConfig
from flexmarl_jax.config.workflow_from_config import team_agents
from flexmarl_jax.distributed.leader import is_leader, leader_value
from flexmarl_jax.metrics import plots
from flexmarl_jax.orchestrator import emulated_setup as emulated
from flexmarl_jax.orchestrator.agents import (
    AgentRuntime,
    agent_layout,
    build_agent_runtimes,
    pool_training,
    trainers_of,
    training_slice_meshes,
)
from flexmarl_jax.orchestrator.evaluation import TeamEvaluator, evaluation_due
from flexmarl_jax.orchestrator.journal import CHECKPOINTS_KEPT, RunJournal
from flexmarl_jax.orchestrator.liveness import IterationAbandoned, PipelineStalled, ProgressBeacon
from flexmarl_jax.orchestrator.pipeline import JointOrchestrator, PipelineSettings
from flexmarl_jax.orchestrator.preflight import Preflight, preflight
from flexmarl_jax.orchestrator.resume import prepare_resume
from flexmarl_jax.orchestrator.retry import run_with_one_retry
from flexmarl_jax.orchestrator.rollout_setup import RolloutHandle, start_engines
from flexmarl_jax.orchestrator.stop_signals import StopSignals
from flexmarl_jax.orchestrator.warmup import run_warmup, warmup_examples
from flexmarl_jax.orchestrator.watchdog import EXIT_STALLED, Watchdog, exit_now, log_stacks_and_mark, report_stall
from flexmarl_jax.orchestrator.weight_sync import StoreWeightSync
from flexmarl_jax.orchestrator.workdir_lock import WorkdirLock
from flexmarl_jax.store import ExperienceStore
from flexmarl_jax.store.corruption import StoreCorrupted
from flexmarl_jax.train.checkpoint import CHECKPOINT_DIR, restore_trainer, save_all
from flexmarl_jax.train.checkpoint_integrity import CheckpointCorrupted
from flexmarl_jax.train.from_config import run_loss_config
from flexmarl_jax.transfer import StateStore
from flexmarl_jax.workdir_paths import orbax_directory
from flexmarl_jax.workdir_paths import path as workdir_path
from flexmarl_jax.workflows import Task, Workflow
from flexmarl_jax.workflows.splits import EVAL_PROBLEMS_SEED
from flexmarl_jax.workflows.warmup_data import WARMUP_KINDS

logger = logging.getLogger(__name__)


class RunStopped(RuntimeError):
    """The run ended early on an error; the message is one line ending with where the workdir resumes from."""


class BuiltRun(NamedTuple):
    """What `build_orchestrator` builds for a run."""

    orchestrator: JointOrchestrator
    agents: dict[str, AgentRuntime]  # as the orchestrator holds them: trainers (pooled), engines, devices
    store: ExperienceStore
    rollout: RolloutHandle  # the team's backend; shut it down when the run ends
    start: int  # the first iteration to run: 0, or the policy version a resumed run continues from


def pipeline_settings(config: RunConfig) -> PipelineSettings:
    """The orchestrator's knobs from a config."""
    return PipelineSettings.from_config(config, process_count=jax.process_count())


def build_orchestrator(config: RunConfig, *, timeline: metrics.Timeline | None = None,
                       resume: bool = True, checked: Preflight | None = None,
                       beacon: ProgressBeacon | None = None) -> BuiltRun:
    """Everything a run needs, its agents built by `agents.build_agent_runtimes` (see `BuiltRun`).

    checked: what `preflight(config)` returned (it is run here when not given).
    beacon: the run's progress beacon; every engine instance's decode steps count as progress on it.
    """
    checked = preflight(config) if checked is None else checked
    if config.pipeline.emulate:
        return _build_emulated(config, checked, timeline)
    agents = team_agents(config.workflow)
    train_slices = config.mesh.train_slices
    if train_slices and config.pipeline.mode == "serial":
        raise ValueError(f"mesh.train_slices={train_slices} needs disaggregated training (pipeline.mode sync or "
                         "flexmarl); the serial mode colocates each agent's rollout on its training mesh")
    layout = agent_layout(config)
    slice_meshes = training_slice_meshes(config, layout, train_slices) if train_slices else None
    # With shared slices, agent i starts on slice i mod S (its state is offloaded to host right after setup).
    runtimes = build_agent_runtimes(config, layout, sources=checked.sources,
                                    train_meshes=None if slice_meshes is None else {
                                        agent: slice_meshes[index % train_slices]
                                        for index, agent in enumerate(agents)})
    workflow, task = checked.workflow, checked.task
    resumed = prepare_resume(orbax_directory(config.workdir, CHECKPOINT_DIR), agents) if resume else None
    common = None if resumed is None else resumed.version
    for version, problem in ({} if resumed is None else resumed.rejected).items():
        print(f"flexmarl train: checkpoint of policy version {version} fails verification ({problem}); "
              f"resuming from policy version {common}, the newest intact one", file=sys.stderr)
    start = _restore_or_warm_up(config, runtimes, common, workflow, task)
    if timeline is None:
        saved = workdir_path(config.workdir, metrics.TIMELINE_FILENAME)
        # A resumed run keeps recording on its old timeline, so the plots cover the whole run.
        timeline = metrics.Timeline.load(saved) if common is not None and saved.is_file() else metrics.Timeline()
    # One writer per file: with several processes, process 0 keeps the durable store; the others replay the same
    # rollout into memory.
    backend = config.store.backend if is_leader() else "memory"
    store = ExperienceStore.open(config.workdir, agents=agents, backend=backend)
    runtimes, rollout = start_engines(config, runtimes, timeline)
    beacon = beacon or ProgressBeacon()
    for instance in rollout.instances:
        beacon.add_source(f"a decode step of {instance.name}", instance.progress.last_step_at)
    state_store = StateStore()
    # Agent-centric allocation (shared slices): agents hold a slice only while they have a micro-batch. The
    # engines above copied the initial weights; the orchestrator syncs every agent before rollout.
    training, runtimes = pool_training(runtimes, slice_meshes, store=state_store, clock=timeline.now)
    rollout_targets = {agent: runtime.rollout_shardings for agent, runtime in runtimes.items()}
    sync_weights = StoreWeightSync(state_store, rollout.sync_weights, target_for=rollout_targets.__getitem__)
    loss = run_loss_config(config)
    trainers = trainers_of(runtimes)
    orchestrator = JointOrchestrator(
        pipeline_settings(config), agents=runtimes, training=training, store=store, workflow=workflow, task=task,
        backend=rollout.backend, sync_weights=sync_weights, aggregation=loss.aggregation,
        estimator=loss.advantage_estimator, timeline=timeline, beacon=beacon,
        on_update_applied=lambda iteration, record, trained: _checkpoint(
            trainers, config.workdir, RunJournal(config.workdir, writer=is_leader()), record, trained))
    return BuiltRun(orchestrator, runtimes, store, rollout, start)


def _build_emulated(config: RunConfig, checked: Preflight, timeline: metrics.Timeline | None) -> BuiltRun:
    """`pipeline.emulate`: the real orchestrator, store, router, balancer and dispatchers over emulated
    trainers, engines and weight sync (orchestrator/emulated_setup.py). No weights exist, so nothing is
    restored, warmed up or checkpointed (the journal still keeps each iteration's record): an emulated run
    always starts at iteration 0."""
    emulation = emulated.Emulation.from_config(config)
    workdir_path(config.workdir).mkdir(parents=True, exist_ok=True)  # the journal's files (below) live there
    timeline = metrics.Timeline() if timeline is None else timeline
    runtimes = emulated.build_emulated_runtimes(config, emulation, checked.sources, clock=timeline.now)
    store = ExperienceStore.open(config.workdir, agents=team_agents(config.workflow), backend=config.store.backend)
    runtimes, rollout = emulated.start_emulated_engines(config, emulation, runtimes, timeline)
    training = emulated.pool_emulated_training(runtimes, clock=timeline.now)
    loss = run_loss_config(config)
    sync_weights = emulated.EmulatedWeightSync(emulation, rollout.sync_weights)
    orchestrator = JointOrchestrator(
        pipeline_settings(config), agents=runtimes, training=training, store=store, workflow=checked.workflow,
        task=checked.task, backend=rollout.backend, sync_weights=sync_weights,
        aggregation=loss.aggregation, estimator=loss.advantage_estimator, timeline=timeline,
        # The journal's record keeping as after a checkpoint (run_training expects it), with no weights to save.
        on_update_applied=lambda iteration, record, trained: RunJournal(config.workdir).before_checkpoint(
            metrics.to_jsonable(record), trained))
    return BuiltRun(orchestrator, runtimes, store, rollout, 0)


def _restore_or_warm_up(config: RunConfig, runtimes: Mapping[str, AgentRuntime], common: int | None,
                        workflow: Workflow, task: Task) -> int:
    """Sets the trainers' starting state; returns the first iteration to run.

    Resuming (``common``: the newest policy version every agent has an intact checkpoint of, which
    `resume.prepare_resume` has just verified), every agent is restored at that version. Otherwise, with
    `workflow.warmup_steps`, every agent takes its supervised warm-up of kind `workflow.warmup` on training
    problems (saved as the checkpoint of version 0)."""
    trainers = trainers_of(runtimes)
    checkpoint_root = orbax_directory(config.workdir, CHECKPOINT_DIR)
    if common is not None:
        # Agents are saved one after another; a run killed in between leaves some agents one version
        # ahead, and a checkpoint may fail verification. Every agent restores the newest version that all of
        # them hold intact (verified by prepare_resume a moment ago: no second pass over the files).
        for agent, trainer in trainers.items():
            restore_trainer(trainer, checkpoint_root / agent, policy_version=common, verify=False)
        logger.info("resumed from %s at policy version %d", checkpoint_root, common)
        return common
    if config.workflow.warmup_steps > 0:
        # `task` draws training problems only (preflight's TrainEvalSplit): warm-up never sees an eval problem.
        examples = warmup_examples(workflow, task, kind=config.workflow.warmup, queries=256, samples_per_query=1,
                                   seed=config.seed)
        logger.info("warm-up (%s): %s", config.workflow.warmup, WARMUP_KINDS[config.workflow.warmup].teaches)
        run_warmup(runtimes, examples, steps=config.workflow.warmup_steps, seed=config.seed,
                   learning_rate=config.workflow.warmup_learning_rate)
        save_all(trainers, checkpoint_root)
    return 0


def _checkpoint(trainers, workdir: str, journal: RunJournal, record: dict, trained: dict[str, list[str]]) -> None:
    """After an iteration's update: the journal keeps its record and trained sample ids, then every agent's
    state is saved (the journal's invariant: this precedes `mark_consumed`)."""
    journal.before_checkpoint(metrics.to_jsonable(record), trained)
    save_all(trainers, orbax_directory(workdir, CHECKPOINT_DIR), max_to_keep=CHECKPOINTS_KEPT)


def _begin_attempt(orchestrator: JointOrchestrator, journal: RunJournal, iteration: int, *, durable: bool) -> None:
    """Records that `iteration` starts (in the journal when the store is `durable`). If an earlier attempt
    started it and failed, or an earlier run died, before its update was checkpointed, the store still holds
    that attempt's unapplied rows: drop them and redo it with fresh input ids."""
    if durable:  # several processes: process 0 keeps the journal and tells the others
        previous = leader_value(journal.begin_attempt(iteration) if journal.writer else 0)
    else:
        previous = orchestrator.attempts.get(iteration, -1) + 1
    orchestrator.attempts[iteration] = previous
    if previous:
        dropped = orchestrator.prepare_retry(iteration, previous)
        logger.info("redoing iteration %d (attempt %d); dropped %d unapplied rows", iteration, previous, dropped)


def _run_all(*steps) -> BaseException | None:
    """Calls every step; logs each failure and returns the first."""
    first = None
    for step in steps:
        try:
            step()
        except Exception as error:  # noqa: BLE001 - logged; the caller decides whether it matters
            logger.exception("shutdown step %s failed", getattr(step, "__qualname__", step))
            first = first or error
    return first


def build_evaluator(config: RunConfig, orchestrator: JointOrchestrator) -> TeamEvaluator | None:
    """The held-out evaluator of a run (None with `eval.enabled=False`): the orchestrator's workflow, backend
    and sampling on the task split's fixed eval list."""
    if not config.eval.enabled:
        return None
    problems = orchestrator.task.eval_problems(config.eval.problems, seed=EVAL_PROBLEMS_SEED)
    if len(problems) < config.eval.problems:
        logger.warning("the eval split has %d distinct problems; eval.problems=%d asks for more", len(problems),
                       config.eval.problems)
    return TeamEvaluator(orchestrator.workflow, orchestrator.backend, problems, orchestrator.task.verify,
                         orchestrator.sampling, samples=config.eval.samples)


def run_training(config: RunConfig, *, workdir_locked: bool = False, gantt_iterations: int | None = None) -> int:
    """Runs `config.iterations` iterations (resuming from the workdir); returns a process exit code.

    gantt_iterations: the plots' Gantt window, the last k iterations (None: the plots' default; 0: the whole
    run); a presentation choice of `flexmarl train --gantt-iterations`, not part of the config.

    With `eval.enabled`, the team is evaluated on the held-out problems after warm-up (before the first update),
    after every `eval.every` iterations and after the last one (`evaluation.evaluation_due`); an evaluation
    already in metrics.jsonl (a resumed run) is not repeated.

    The workdir is locked first (`workdir_lock.WorkdirBusy` when a live run holds it, before anything is
    written), unless the caller holds its lock already (`workdir_locked`: the CLI takes it before JAX starts).
    A stop by signal returns 128 + its number, a stall `watchdog.EXIT_STALLED`; an error raises
    RunStopped. Each of them is recorded in the journal and leaves a workdir that resumes.

    Fault injection (flexmarl_jax/faults.py) is armed from $FLEXMARL_FAULTS, for tests and `bench faults`."""
    try:
        armed = faults.arm_from_env()
    except ValueError as error:
        raise ConfigError(f"${faults.ENV_VAR}: {error}") from None
    if armed:
        logger.warning("fault injection armed: %s", ", ".join(armed))
    if workdir_locked:
        return _run_locked(config, gantt_iterations)
    with WorkdirLock(config.workdir):
        return _run_locked(config, gantt_iterations)


def _run_locked(config: RunConfig, gantt_iterations: int | None) -> int:
    checked = preflight(config)  # models, prompts and memory checked before anything else is written
    workdir = config.workdir
    leader = is_leader()  # one writer per file: process 0 writes the run's own files
    if leader:  # the typed config, every field (RunConfig.to_dict)
        workdir_paths.write_atomically(workdir_path(workdir, "config.json"), config.to_json(indent=1))
    started = time.monotonic()
    journal = RunJournal(workdir, writer=leader)
    for stop in journal.stops()[-1:]:
        logger.warning("the previous run on this workdir stopped early (%s at iteration %s: %s); resuming",
                       stop["reason"], stop["iteration"], stop["detail"])
    beacon = ProgressBeacon()
    resume_hint = f"the workdir resumes from its last checkpoint: flexmarl train --workdir={workdir} (same config)"
    try:
        orchestrator, _agents, store, rollout, start = build_orchestrator(config, checked=checked, beacon=beacon)
    except (ConfigError, CheckpointCorrupted, StoreCorrupted):
        raise  # bad input or data on disk that changed: the CLI says which in one line
    except Exception as error:
        # The warm-up, its checkpoint, the engines' first weight sync: a failure here is a stop like one in an
        # iteration (journal entry, one line), not a traceback; the resume finds the warm-up saved or redoes it.
        logger.exception("the run's setup failed before its first iteration")
        faults.detected("the run stops (error)")
        journal.record_stop("error", iteration=None, detail=f"setup: {type(error).__name__}: {error}")
        raise RunStopped(f"setup failed before the first iteration: {error}; {resume_hint}") from error
    timeline = orchestrator.timeline
    orchestrator.set_horizon(config.iterations)
    writer = metrics.MetricsWriter(workdir, persist=leader)
    journal.settle(store, writer, start)
    evaluator = build_evaluator(config, orchestrator)
    current = {"iteration": start}

    def evaluate_if_due(step: int, progress: metrics.IterationProgress) -> None:
        """Evaluates the policies after `step` iterations when an eval is due and not yet recorded."""
        if evaluator is None or writer.has_iteration(step, kind=metrics.EVAL_KIND):
            return
        if evaluation_due(step, every=config.eval.every, iterations=config.iterations):
            record = evaluator.evaluate(step, orchestrator.versions())
            writer.write(record)
            progress.report_eval(record)

    def mark(reason: str, detail: str) -> None:
        faults.detected(f"the run stops ({reason})")
        journal.record_stop(reason, iteration=current["iteration"], detail=detail)

    def stalled(idle_s: float, what: str) -> None:  # the watchdog's thread: the run may be hung anywhere
        summary = report_stall(idle_s, what, config.run.stall_timeout_s, lambda text: mark("stalled", text))
        print(f"flexmarl train: stalled: {summary}; {resume_hint}", file=sys.stderr)
        exit_now(EXIT_STALLED)

    def stop_overdue(detail: str) -> None:  # the stop timer's thread
        log_stacks_and_mark(detail, lambda text: mark("signal", text))
        print(f"flexmarl train: {detail}; {resume_hint}", file=sys.stderr)
        exit_now(signals.exit_code)

    signals = StopSignals(config.run.stop_mode, config.run.stop_timeout_s, abandon=orchestrator.abandon_iteration,
                          on_timeout=stop_overdue).install()
    beacon.beat("the iteration loop starts")
    watchdog = Watchdog(beacon, config.run.stall_timeout_s, stalled).start()

    def attempt(iteration: int) -> None:
        _begin_attempt(orchestrator, journal, iteration, durable=config.store.backend == "file")

    try:
        with metrics.IterationProgress(total=config.iterations, initial=start) as progress:
            evaluate_if_due(start, progress)  # the start of RL: after warm-up (or where a resumed run stopped)
            for iteration in range(start, config.iterations):
                if signals.requested.is_set():
                    break
                current["iteration"] = iteration
                record = run_with_one_retry(orchestrator, iteration, attempt)
                writer.write(record)
                journal.iteration_logged()
                if leader:
                    timeline.save(workdir)
                progress.advance(record)
                current["iteration"] = iteration + 1
                if not signals.requested.is_set():
                    evaluate_if_due(iteration + 1, progress)  # on the weights the iteration's update synced
    except IterationAbandoned:
        detail = f"{signals.signal_name or 'a stop'} abandoned iteration {current['iteration']}"
        mark("signal", detail)
        print(f"flexmarl train: stopped: {detail}; {resume_hint}", file=sys.stderr)
        return signals.exit_code
    except PipelineStalled as error:
        report_stall(beacon.idle_s(), str(error), config.run.stall_timeout_s, lambda text: mark("stalled", text))
        print(f"flexmarl train: stalled: {error}; {resume_hint}", file=sys.stderr)
        return EXIT_STALLED
    except Exception as error:
        logger.exception("iteration %d failed", current["iteration"])
        mark("error", f"{type(error).__name__}: {error}")
        raise RunStopped(f"iteration {current['iteration']} failed: {error}; {resume_hint}") from error
    finally:  # the watchdog and the stop timer still bound the shutdown (an instance that never returns)
        # Each step runs even if one before it fails (a broken store fails its close too); a failure here is
        # raised only when the run itself ended well, else it would hide the error that stopped the run.
        shutdown_error = _run_all(rollout.shutdown, store.close, writer.close)
        watchdog.stop()
        signals.restore()
    if shutdown_error is not None:
        raise shutdown_error
    if signals.requested.is_set() and current["iteration"] < config.iterations:
        detail = f"{signals.signal_name} after iteration {current['iteration'] - 1} (checkpointed)"
        mark("signal", detail)
        print(f"flexmarl train: stopped by {detail}; {resume_hint}", file=sys.stderr)
        return signals.exit_code
    metrics.print_summary(writer.records)
    if not leader:
        print(f"run finished in {time.monotonic() - started:.1f}s (process {jax.process_index()}; process 0 wrote "
              f"the metrics and plots)")
        return 0

    paths = plots.plot_all(workdir, timeline, gantt_iterations=gantt_iterations)
    print(f"run finished in {time.monotonic() - started:.1f}s; metrics: {workdir_path(workdir, 'metrics.jsonl')}; "
          f"plots: {', '.join(str(p) for p in paths)}")
    return 0
