"""The joint orchestrator: one iteration of multi-agent RL in any pipeline mode, with one code path.

An iteration (docs/architecture.md): the workflow rolls out queries x samples trajectories through the
generation backend; every agent call streams into the experience store; each agent's dispatcher claims
micro-batches of complete groups and accumulates their gradients — while rollout still runs in the
`flexmarl` mode, after it in `sync` and `serial`; once everything is consumed all agents apply their update
together (version v -> v+1) and the new weights reach the rollout instances before the next rollout.

`max_staleness = k > 0`: the next iteration's rollout starts as soon as the current rollout ends (on the
weights rollout has then), overlapping the current iteration's training; its rows are held back until the
current iteration's micro-batches are done, are trained one version later, and any row beyond the bound is
dropped, never trained.

Failures: a trainer error (`dispatch.TrainerFailed`) gives every claim of the iteration back and stops the
other agents' dispatchers; `prepare_retry` then sets up a second attempt (run.py retries once). Every wait
here is bounded by `liveness.Liveness`: it ends with `PipelineStalled` when nothing made progress for
`stall_timeout_s`, or with `IterationAbandoned` after `abandon_iteration()`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from flexmarl_jax.distributed.ordered_issue import OrderedIssuer
from flexmarl_jax.metrics import GENERATED_TOKENS, REQUESTS, Timeline
from flexmarl_jax.orchestrator.dispatch import AgentDispatcher, DispatchStats, TrainerFailed
from flexmarl_jax.orchestrator.invariants import ConsistencyChecker
from flexmarl_jax.orchestrator.iteration_record import agent_records, train_pool_record
from flexmarl_jax.orchestrator.liveness import IterationAbandoned, Liveness, ProgressBeacon
from flexmarl_jax.orchestrator.shared_training import TrainingPool
from flexmarl_jax.orchestrator.sink import StoreSink
from flexmarl_jax.orchestrator.threads import run_threads, threads_running
from flexmarl_jax.store import ExperienceStore
from flexmarl_jax.train.advantages import group_advantages
from flexmarl_jax.train.normalizers import IterationNormalizers
from flexmarl_jax.train.protocol import Trainer
from flexmarl_jax.workflows import GenerationBackend, RunResult, Task, Workflow, WorkflowExecutor

if TYPE_CHECKING:
    from flexmarl_jax.config import RunConfig
    from flexmarl_jax.orchestrator.agents import AgentRuntime

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """The pipeline's view of a `RunConfig` (`from_config`): no defaults and no rules of its own, the config's
    fields and their checks are the one source (config/schema.py)."""

    mode: str  # pipeline.mode
    async_micro_batches: bool  # pipeline.async_micro_batches: flexmarl trains micro-batches while rollout runs
    queries_per_iteration: int  # workflow.queries_per_iteration
    samples_per_query: int  # workflow.samples_per_query
    micro_batch_size: int  # train.micro_batch_size
    max_response_length: int  # rollout.max_response_length
    max_staleness: int  # train.max_staleness
    seed: int  # seed
    debug_invariants: bool  # pipeline.debug_invariants
    deterministic: bool  # pipeline.deterministic: train after the rollout, micro-batches cut in group-id order
    stall_timeout_s: float | None  # run.stall_timeout_s: a wait ends after this long without progress
    process_count: int  # processes of the run (config.distributed); > 1: training goes through the issuer

    @classmethod
    def from_config(cls, config: RunConfig, *, process_count: int) -> PipelineSettings:
        return cls(mode=config.pipeline.mode, async_micro_batches=config.pipeline.async_micro_batches,
                   queries_per_iteration=config.workflow.queries_per_iteration,
                   samples_per_query=config.workflow.samples_per_query,
                   micro_batch_size=config.train.micro_batch_size,
                   max_response_length=config.rollout.max_response_length,
                   max_staleness=config.train.max_staleness, seed=config.seed,
                   debug_invariants=config.pipeline.debug_invariants, deterministic=config.pipeline.deterministic,
                   stall_timeout_s=config.run.stall_timeout_s, process_count=process_count)

    @property
    def overlaps_training(self) -> bool:
        return self.mode == "flexmarl" and self.async_micro_batches and not self.deterministic


def conditional_agents(workflow: Workflow) -> set[str]:
    """Agents with a node that runs only under a condition (directly or through an ancestor): their GRPO
    groups can hold fewer than samples_per_query rows."""
    conditional: set[str] = set()
    for node in workflow.order:
        if any(edge.when is not None for edge in workflow.incoming[node]) or workflow.ancestors[node] & conditional:
            conditional.add(node)
    return {workflow.nodes[node].agent for node in conditional}


class _Rollout:
    """One iteration's workflow execution on a background thread."""

    def __init__(self, iteration: int, sink: StoreSink, executor: WorkflowExecutor,
                 problems: Sequence[Any], timeline: Timeline, wake_claims: Callable[[], None]):
        self.iteration, self.sink = iteration, sink
        self._wake_claims = wake_claims  # blocked trainer claims re-check `done`
        self.done = threading.Event()
        self.result: RunResult | None = None
        self.error: BaseException | None = None
        self.start_time = timeline.now()
        self.end_time: float | None = None
        self._timeline = timeline
        self._thread = threading.Thread(target=self._run, args=(executor, problems),
                                        name=f"rollout-{iteration}", daemon=True)
        self._thread.start()

    def _run(self, executor: WorkflowExecutor, problems) -> None:
        try:
            self.result = executor.run(problems, self.sink)
            self.sink.flush()  # every finished group is in the store before the rollout counts as done
        except BaseException as error:  # surfaced by wait()
            self.error = error
        finally:
            self.end_time = self._timeline.now()
            self.done.set()
            self._wake_claims()

    def wait(self, liveness: Liveness) -> RunResult:
        liveness.join(self._thread, f"the rollout of iteration {self.iteration}")
        if self.error is not None:
            raise RuntimeError(f"rollout of iteration {self.iteration} failed: {self.error}") from self.error
        return self.result


class JointOrchestrator:
    """Runs iterations over the team's agents, one store, one workflow and one generation backend.

    Args:
      agents: agent -> its `agents.AgentRuntime`: the trainer the orchestrator trains it through, its
        rollout sampling (seeds are derived per request) and its pad id (micro-batch padding).
      training: where the agents' trainers run (`shared_training.DedicatedTraining`, one mesh per agent, or
        `shared_training.SharedTraining`, agent-centric allocation on shared slices); every runtime's trainer
        must be this pool's trainer of its agent (`agents.pool_training` returns runtimes that are).
      sync_weights: (agent, params, version) -> None; puts new weights on that agent's rollout instances.
      aggregation, estimator: the loss aggregation and advantage estimator of the algorithm.
      on_update_applied: called with (iteration, metrics record, {agent: sample ids trained}) after every
        agent applied its update and before the iteration's rows are marked consumed (run.py checkpoints
        there, so a crash never loses a sample, and keeps the record and the trained ids with the checkpoint,
        so a crash never loses an iteration's metrics and a resume can mark its rows consumed).
      beacon: the run's progress beacon (rows stored, micro-batches, iteration phases beat it); every wait of
        the pipeline ends once it was quiet for `settings.stall_timeout_s`.
    """

    def __init__(self, settings: PipelineSettings, *, agents: Mapping[str, AgentRuntime], training: TrainingPool,
                 store: ExperienceStore, workflow: Workflow, task: Task, backend: GenerationBackend,
                 sync_weights: Callable[[str, Any, int], None], aggregation: str, estimator: str,
                 timeline: Timeline | None = None,
                 on_update_applied: Callable[[int, dict, dict[str, list[str]]], None] | None = None,
                 beacon: ProgressBeacon | None = None):
        self.settings = settings
        self.agents = dict(agents)
        self.training = training
        if {name: runtime.trainer for name, runtime in self.agents.items()} != dict(training.trainers):
            # A shared pool holds the agents' states: a runtime still holding its own trainer would train
            # beside the pool, on a state the pool has taken.
            raise ValueError("every agent must train through the training pool's trainer of its agent "
                             "(build the runtimes with agents.pool_training)")
        self.trainers: dict[str, Trainer] = {name: runtime.trainer for name, runtime in self.agents.items()}
        self.store, self.workflow, self.task, self.backend = store, workflow, task, backend
        self.sync_weights = sync_weights
        self.on_update_applied = on_update_applied
        self.sampling = {name: runtime.sampling for name, runtime in self.agents.items()}
        self.timeline = timeline or Timeline()
        self.checker = ConsistencyChecker(settings.max_staleness) if settings.debug_invariants else None
        self.aggregation, self.estimator = aggregation, estimator
        calls = collections.Counter(node.agent for node in workflow.nodes.values())  # calls per trajectory
        self._conditional = conditional_agents(workflow)
        self.normalizers = {}
        for agent in self.trainers:
            # Fixed before any micro-batch: an upper bound of the agent's rows and tokens in one iteration.
            rows = settings.queries_per_iteration * settings.samples_per_query * calls.get(agent, 1)
            self.normalizers[agent] = IterationNormalizers(
                total_tokens=rows * settings.max_response_length, num_sequences=rows,
                norm_length=settings.max_response_length)
        for agent in self.trainers:
            self.timeline.declare(f"train/{agent}")
        self.beacon = beacon or ProgressBeacon()
        self.liveness = Liveness(self.beacon, settings.stall_timeout_s)
        self._stop_dispatchers: threading.Event | None = None  # the running iteration's (see _dispatchers)
        self._pending_rollout: _Rollout | None = None
        self.attempts: dict[int, int] = {}  # iteration -> times it was restarted after a crash
        self._synced = {}
        # Several processes: each agent's training (its micro-batches, its update) may run on a mesh that spans
        # them, so it is issued from one thread in agent order on every process (distributed/ordered_issue.py).
        self._issuer = OrderedIssuer("spanning-issue") if settings.process_count > 1 else None
        self._issue_round = 0
        self.sync_all()

    # ------------------------------------------------------------------------------------------ weights
    def versions(self) -> dict[str, int]:
        return {agent: trainer.policy_version for agent, trainer in self.trainers.items()}

    def sync_all(self) -> None:
        """Pushes every agent's current weights to its rollout instances (skips ones already there).

        The agents' syncs run at once, a thread each: each goes from its own training mesh over its own links to
        its own instances, so none need wait behind another's (an emulated run's sync times overlap as the
        devices' would; syncs that share a device still queue on it). Several processes issue them one by one
        in agent order instead, as every transfer that spans processes must be (distributed/ordered_issue.py).
        An agent whose sync failed stays unsynced; the first error is raised once the others are done.
        """
        due = {agent: trainer.policy_version for agent, trainer in self.trainers.items()
               if self._synced.get(agent) != trainer.policy_version}
        landed: list[str] = []

        def sync(agent: str) -> None:
            with self.timeline.busy(f"train/{agent}", "sync", agent=agent):
                self.sync_weights(agent, self.trainers[agent].rollout_weights, due[agent])
            landed.append(agent)

        try:
            if self._issuer is not None or len(due) <= 1:
                for agent in due:
                    sync(agent)
            else:
                run_threads({f"sync-{agent}": functools.partial(sync, agent) for agent in due})
        finally:
            for agent in [agent for agent in due if agent in landed]:  # agent order, whatever the threads' order
                self._synced[agent] = due[agent]
                self.timeline.record_policy_version(agent, due[agent])
                if self.checker is not None:
                    self.checker.weights_synced(agent, due[agent])

    # ------------------------------------------------------------------------------------------ rollout
    def _advantages(self, rewards: np.ndarray) -> np.ndarray:
        """Advantages of one GRPO group's rewards [group] with the algorithm's estimator."""
        return group_advantages(rewards, [0] * len(rewards), self.estimator)

    def problems_for(self, iteration: int):
        """The iteration's queries: fixed by (seed, iteration). A redone iteration (`attempts`) keeps the
        queries but gets fresh input ids, since a durable store still holds the dropped first attempt."""
        seed = zlib.crc32(f"{self.settings.seed}/{iteration}".encode())
        problems = self.task.generate(self.settings.queries_per_iteration, seed=seed)
        attempt = self.attempts.get(iteration, 0)
        if attempt:
            problems = [dataclasses.replace(p, input_id=f"{p.input_id}r{attempt}") for p in problems]
        return problems

    def _start_rollout(self, iteration: int, *, hold_rows: bool) -> _Rollout:
        checker, beacon = self.checker, self.beacon

        def on_generated(record, deps) -> None:
            beacon.beat(f"a row of {record.agent} reached the store")
            if checker is not None:
                checker.generated(record.sample_id, record.agent, deps)

        # Rows reach the store a micro-batch at a time: fewer, larger appends, each one claimable at once.
        # Fewer rows than that are not claimable before the rollout ends (when the sink is flushed), so the
        # delay bound only keeps a long rollout's store from lagging far behind for observers.
        sink = StoreSink(self.store, self._advantages, on_generated=on_generated, hold=hold_rows,
                         rows_per_write=self.settings.micro_batch_size, max_delay_s=5.0)
        serial = self.settings.mode == "serial"
        # No explicit seed: the backend derives each request's seed from its id, which holds the
        # iteration's problem seed, so every request samples independently and reproducibly.
        sampling = self.sampling
        executor = WorkflowExecutor(
            self.workflow, self.backend, self.task, samples_per_query=self.settings.samples_per_query,
            sampling=sampling, mode="dependency", max_concurrent_queries=1 if serial else None,
            group_root_requests=not serial,  # parallel sampling: one prefill for a query's n samples
            request_timeout_s=self.settings.stall_timeout_s)  # a rollout where no call ends for that long fails
        return _Rollout(iteration, sink, executor, self.problems_for(iteration), self.timeline,
                        wake_claims=lambda: self.store.wake_claims())

    # ------------------------------------------------------------------------------------------ training
    def _dispatchers(self) -> dict[str, AgentDispatcher]:
        on_trained = self.checker.trained if self.checker is not None else None
        stop = threading.Event()  # shared: one agent's failure, or an abandoned iteration, stops them all
        self._stop_dispatchers = stop
        if self.liveness.abandon.is_set():
            stop.set()
        return {
            agent: AgentDispatcher(
                agent, trainer, self.store, micro_batch_size=self.settings.micro_batch_size,
                normalizers=self.normalizers[agent], aggregation=self.aggregation,
                pad_id=self.agents[agent].pad_id, max_staleness=self.settings.max_staleness,
                variable_groups=agent in self._conditional, timeline=self.timeline, resource=f"train/{agent}",
                on_trained=on_trained, ordered=self.settings.deterministic, on_progress=self.beacon.beat,
                stop=stop)
            for agent, trainer in self.trainers.items()
        }

    def _drain_all(self, dispatchers, stats, rollout: _Rollout, *, concurrent: bool) -> None:
        """Every agent's dispatcher claims and accumulates micro-batches until the rollout is done and its
        rows are consumed; concurrently (one thread per agent) or one agent after another."""
        versions = self.versions()

        def drain(agent: str) -> None:
            try:
                dispatchers[agent].drain(versions, rollout.done, stats[agent], iteration_start=rollout.start_time)
            except BaseException:
                dispatchers[agent].stop.set()  # the other agents claim nothing more
                self.store.wake_claims()
                # The rollout still owns its threads: fail only once it is over (or the run stalled).
                self.liveness.wait_event(rollout.done, f"the rollout of iteration {rollout.iteration} to end")
                raise

        if concurrent:
            units = self._in_schedule("drain", {agent: functools.partial(drain, agent) for agent in dispatchers})
            run_threads({f"dispatch-{agent}": unit for agent, unit in units.items()}, liveness=self.liveness)
        else:
            for agent in dispatchers:
                drain(agent)

    def run_iteration(self, iteration: int) -> dict:
        """Runs one iteration end to end and returns its metrics record.

        Phases: rollout (with micro-batches drained as they complete in the async mode), drain the rest,
        apply every agent's update, checkpoint (`on_update_applied`), commit the trained rows as consumed,
        sync the new weights to the rollout instances.
        """
        t0 = self.timeline.now()
        pool_t0 = self.training.clock()
        self.beacon.beat(f"iteration {iteration} started")
        rollout = self._begin_rollout(iteration)
        dispatchers = self._dispatchers()
        stats = {agent: DispatchStats() for agent in dispatchers}
        try:
            result = self._rollout_and_drain(iteration, rollout, dispatchers, stats)
            train_metrics = self._apply_all()
        except BaseException:
            for agent, dispatcher in dispatchers.items():
                if self.checker is not None:
                    self.checker.training_discarded([i for rows in dispatcher.claimed for i in rows.sample_ids], agent)
                try:
                    dispatcher.release_all()  # nothing of this iteration was applied: its rows are claimable again
                except Exception:  # noqa: BLE001 - the error being raised says why the iteration failed
                    # Its rows are released first; what can fail is dropping the gradients, when the failed step
                    # consumed the trainer's (donated) state. Logged, so that it does not hide the cause.
                    logger.exception("agent %r: releasing the failed iteration's work", agent)
            self._abandon_pending_rollout()
            raise
        trained = {agent: [sample_id for rows in dispatcher.claimed for sample_id in rows.sample_ids]
                   for agent, dispatcher in dispatchers.items()}
        record = self._record(iteration, t0, rollout, result, stats, train_metrics,
                              {agent: len(ids) for agent, ids in trained.items()})
        record["train_pool"] = train_pool_record(self.timeline, self.trainers, self.training, t0, self.timeline.now(),
                                                 pool_t0)
        if self.on_update_applied is not None:
            self.on_update_applied(iteration, record, trained)  # checkpoint: before the rows count as consumed
            self.beacon.beat(f"iteration {iteration} checkpointed")
        for dispatcher in dispatchers.values():
            dispatcher.commit()
        if self.checker is not None and self.settings.max_staleness == 0:
            self.checker.check_all_consumed()
        self.sync_all()
        self.beacon.beat(f"iteration {iteration} done")
        # The wall-clock fields cover the whole iteration, checkpoint and weight sync included; the record
        # the journal kept with the checkpoint has none (a resumed run writes it without them).
        t1 = self.timeline.now()
        record.update(self.timeline.iteration_timing(t0, t1, record["generated_tokens"]))
        self.timeline.record_iteration(iteration, t0, t1)  # the Gantt chart's windows (metrics/iteration_windows.py)
        return record

    def _begin_rollout(self, iteration: int) -> _Rollout:
        """The iteration's rollout: started now, or (max_staleness > 0) the one started during the previous
        iteration, whose held rows now go to the store; rows beyond the staleness bound are dropped first."""
        if self.settings.max_staleness > 0:
            self.store.drop_stale_rows(current_versions=self.versions(), max_staleness=self.settings.max_staleness)
        rollout = self._pending_rollout or self._start_rollout(iteration, hold_rows=False)
        self._pending_rollout = None
        rollout.sink.release_held()
        return rollout

    def _rollout_and_drain(self, iteration: int, rollout: _Rollout, dispatchers, stats) -> RunResult:
        """Waits for the rollout while (async mode) the dispatchers train on its complete micro-batches, or
        drains them after it; starts the next iteration's rollout early when staleness allows."""
        settings = self.settings
        train_alongside = {"train-side": functools.partial(self._drain_all, dispatchers, stats, rollout,
                                                           concurrent=True)}
        with threads_running(train_alongside if settings.overlaps_training else {}, liveness=self.liveness):
            result = rollout.wait(self.liveness)
            if settings.max_staleness > 0 and iteration + 1 < self._last_iteration:
                self._pending_rollout = self._start_rollout(iteration + 1, hold_rows=True)
        if not settings.overlaps_training:
            self._drain_all(dispatchers, stats, rollout, concurrent=settings.mode != "serial")
        if self.liveness.abandon.is_set():  # the dispatchers stopped claiming: the iteration is incomplete
            raise IterationAbandoned(f"iteration {iteration} was abandoned")
        rollout.sink.close()
        unfinished = rollout.sink.unfinished()
        if unfinished:
            raise RuntimeError(f"iteration {iteration}: workflow calls never closed into groups: {unfinished}")
        return result

    def _apply_all(self) -> dict[str, dict]:
        """Every agent applies its update, concurrently (each on its own training mesh)."""
        metrics = {}

        def apply(agent: str, trainer: Trainer) -> None:
            try:
                if trainer.pending_micro_batches:
                    trainer.activate()  # waiting for a shared slice is not training time
                with self.timeline.busy(f"train/{agent}", "train", agent=agent):
                    metrics[agent] = trainer.apply(allow_empty=True)
            except Exception as error:
                raise TrainerFailed(agent, "applying the update", error) from error

        units = self._in_schedule("apply", {agent: functools.partial(apply, agent, trainer)
                                            for agent, trainer in self.trainers.items()})
        run_threads({f"apply-{agent}": unit for agent, unit in units.items()}, liveness=self.liveness)
        return metrics

    def _in_schedule(self, phase: str, units: dict[str, Callable[[], None]]) -> dict[str, Callable[[], None]]:
        """One process: the units as they are. Several: each unit runs on the issuer's thread, in agent order
        (first-call order, the same on every process), whenever its own thread gets there; the keys count
        the phases run so far, which every process counts alike."""
        if self._issuer is None:
            return units
        self._issue_round += 1
        keys = {agent: (self._issue_round, phase, agent) for agent in units}
        self._issuer.expect(keys.values())
        return {agent: functools.partial(self._issuer.run, keys[agent], unit) for agent, unit in units.items()}

    # ------------------------------------------------------------------------------------------ failures
    def abandon_iteration(self) -> None:
        """Gives up the running iteration (a stop that does not wait for it): every wait of the pipeline ends
        with IterationAbandoned, dispatchers claim nothing more, and nothing of the iteration is applied.

        Safe in a signal handler: it only sets events here; the store's blocked claims are woken from a thread
        of their own, since the interrupted main thread may hold a table's (non-reentrant) lock."""
        self.liveness.abandon.set()
        if self._stop_dispatchers is not None:
            self._stop_dispatchers.set()
        threading.Thread(target=self.store.wake_claims, name="abandon-wake", daemon=True).start()

    def prepare_retry(self, iteration: int, attempt: int) -> int:
        """Before attempt number `attempt` (>= 1) of an iteration whose earlier attempt failed with every agent
        still at the iteration's starting version: the new attempt gets fresh input ids, and the earlier
        attempt's rows (released when it failed) are dropped, never trained. Returns the rows dropped."""
        self._abandon_pending_rollout()
        self.attempts[iteration] = attempt
        if self.checker is not None:
            self.checker.drop_untrained()
        next_versions = {agent: version + 1 for agent, version in self.versions().items()}
        return self.store.drop_stale_rows(current_versions=next_versions, max_staleness=0)

    def _abandon_pending_rollout(self) -> None:
        """Forgets a next-iteration rollout started early (max_staleness > 0): its rows were held, never
        stored, so dropping it loses nothing; the next iteration rolls out again."""
        pending, self._pending_rollout = self._pending_rollout, None
        if pending is None:
            return
        try:
            pending.wait(self.liveness)
        except Exception:  # noqa: BLE001 - its results are dropped anyway; the failure that got us here counts
            logger.warning("the early rollout of iteration %d did not end cleanly; dropped", pending.iteration)
            return
        pending.sink.close()

    def set_horizon(self, last_iteration: int) -> None:
        """The iteration number after the last one (a stale-mode rollout never starts beyond it)."""
        self._last_iteration = last_iteration

    _last_iteration = 1 << 30

    # ------------------------------------------------------------------------------------------ metrics
    def _record(self, iteration, t0, rollout: _Rollout, result: RunResult, stats, train_metrics, consumed) -> dict:
        t1 = self.timeline.now()
        tokens = sum(load.completion_tokens for load in result.load.values())
        for agent, load in result.load.items():
            self.timeline.increment(REQUESTS, agent, load.requests, time=rollout.end_time)
            self.timeline.increment(GENERATED_TOKENS, agent, load.completion_tokens, time=rollout.end_time)
        agents = agent_records(self.trainers, result, stats, train_metrics, consumed)
        return {
            "iteration": iteration,
            "team_accuracy": result.accuracy,
            "rollout_wall_s": (rollout.end_time or t1) - rollout.start_time,
            "generated_tokens": tokens,
            "policy_version": self.versions(),
            "agent": agents,
        }
