"""Runs a workflow over a batch of queries x n trajectories against one GenerationBackend.

Two modes over the same code path:
  "dependency"  each call is submitted the moment its own inputs exist (its trajectory's upstream calls are
                done), so a fast trajectory never waits for the batch's slowest call. Many queries and all n
                trajectories per query are in flight together (`max_concurrent_queries` caps the queries).
  "staged"      stage by stage: every call at DAG level L of the whole batch is submitted only after all
                calls of level L-1 finished (the baseline that synchronous multi-agent RL uses).

All bookkeeping happens on the thread that calls `run`; backend callbacks only put finished futures on a
queue. Sink calls therefore come from that one thread, in the order described in `records`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import queue
import time
from collections.abc import Callable, Mapping, Sequence

from flexmarl_jax.workflows.generation import (
    ChatPrompt,
    Completion,
    GenerationBackend,
    GenerationRequest,
    PromptTooLong,
    SamplingParams,
)
from flexmarl_jax.workflows.graph import NodeOutput, Workflow
from flexmarl_jax.workflows.records import CallRecord, ExperienceSink, make_group_id, make_sample_id
from flexmarl_jax.workflows.rewards import allocate_rewards
from flexmarl_jax.workflows.tasks import Problem, Task

logger = logging.getLogger(__name__)

MODES = ("dependency", "staged")
DEFAULT_SAMPLING = SamplingParams(max_new_tokens=16, stop=("\n",))


class WorkflowExecutionError(RuntimeError):
    """A generation request failed or returned the wrong number of completions."""


@dataclasses.dataclass
class AgentLoad:
    """Per-agent load: requests sent to the backend, calls (completions = store rows), calls skipped by
    conditional edges, calls skipped because their prompt outgrew `rollout.max_prompt_length` (overflowed),
    prompt tokens (once per request, what the engine prefills), completion tokens."""

    requests: int = 0
    calls: int = 0
    skipped: int = 0
    overflowed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class CallTiming:
    """One backend request as the executor saw it (time.monotonic seconds)."""

    node: str
    agent: str
    input_id: str
    trajectory_ids: tuple[int, ...]
    level: int
    submitted_at: float
    finished_at: float


@dataclasses.dataclass(frozen=True)
class TrajectoryResult:
    input_id: str
    trajectory_id: int
    final_answer: str | None
    team_reward: float
    rewards: Mapping[str, float]  # node -> reward, nodes that ran
    outputs: Mapping[str, NodeOutput]
    skipped: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class RunResult:
    trajectories: list[TrajectoryResult]
    load: dict[str, AgentLoad]
    timeline: list[CallTiming]
    wall_time_s: float

    @property
    def accuracy(self) -> float:
        """Mean team reward indicator: the fraction of trajectories whose final answer verifies."""
        return sum(t.team_reward for t in self.trajectories) / max(1, len(self.trajectories))

    def request_share(self) -> dict[str, float]:
        """agent -> fraction of all agent calls (one call per completion, i.e. per store row)."""
        total = sum(load.calls for load in self.load.values())
        return {agent: load.calls / total if total else 0.0 for agent, load in self.load.items()}


class _Query:
    def __init__(self, index: int, problem: Problem, samples: int):
        self.index, self.problem = index, problem
        self.trajectories = [_Trajectory(self, trajectory_id) for trajectory_id in range(samples)]
        # node -> how many trajectories are past it (call done or skipped); n means the group is final.
        self.resolved: collections.Counter[str] = collections.Counter()
        self.finished = 0


class _Trajectory:
    def __init__(self, query: _Query, trajectory_id: int):
        self.query, self.trajectory_id = query, trajectory_id
        self.state: dict[str, str] = {}  # node -> "submitted" | "done" | "skipped" (absent: pending)
        self.outputs: dict[str, NodeOutput] = {}
        self.finished = False


class WorkflowExecutor:
    """Executes `workflow` for batches of problems.

    Args:
      workflow: the DAG of agent calls.
      backend: where requests go (rollout engine, or ScriptedBackend in tests).
      task: verifies final answers (`task.verify(problem, answer)`), or a bare verify callable.
      samples_per_query: n trajectories per query (= GRPO group size of every non-conditional node).
      sampling: SamplingParams for all agents, or agent -> SamplingParams (missing agents get the default).
      mode: "dependency" or "staged".
      max_concurrent_queries: dependency mode only; None = the whole batch in flight.
      group_root_requests: send each root node as one request with num_samples=n per query (one prefill)
        instead of n requests; the n trajectories then continue only when all n samples are back.
      request_timeout_s: fail if no request finishes for this long (None: wait forever).
    """

    def __init__(
        self,
        workflow: Workflow,
        backend: GenerationBackend,
        task: Task | Callable[[Problem, str | None], bool],
        *,
        samples_per_query: int,
        sampling: SamplingParams | Mapping[str, SamplingParams] = DEFAULT_SAMPLING,
        mode: str = "dependency",
        max_concurrent_queries: int | None = None,
        group_root_requests: bool = False,
        request_timeout_s: float | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; allowed: {list(MODES)}")
        if samples_per_query < 1:
            raise ValueError(f"samples_per_query={samples_per_query} must be >= 1")
        if max_concurrent_queries is not None and max_concurrent_queries < 1:
            raise ValueError(f"max_concurrent_queries={max_concurrent_queries} must be >= 1 or None")
        self.workflow, self.backend = workflow, backend
        self.verify = task.verify if hasattr(task, "verify") else task
        self.samples_per_query = samples_per_query
        if isinstance(sampling, SamplingParams):
            self._sampling = {agent: sampling for agent in workflow.agents}
        else:
            unknown = sorted(set(sampling) - set(workflow.agents))
            if unknown:
                raise ValueError(
                    f"sampling names agents {unknown} not in workflow agents {list(workflow.agents)}"
                )
            self._sampling = {agent: sampling.get(agent, DEFAULT_SAMPLING) for agent in workflow.agents}
        self.mode = mode
        self.max_concurrent_queries = max_concurrent_queries
        self.group_root_requests = group_root_requests
        self.request_timeout_s = request_timeout_s

    # ------------------------------------------------------------------------------------------ public
    def run(self, problems: Sequence[Problem], sink: ExperienceSink | None = None) -> RunResult:
        """Run every problem x samples_per_query trajectories to the end; blocks until all are finished.

        One `run` at a time per executor (it keeps per-run state); sink calls happen on this thread.
        """
        ids = [p.input_id for p in problems]
        if len(set(ids)) != len(ids) or any("_" in i for i in ids):
            raise ValueError("problem input_ids must be unique and contain no '_' (sample ids split on it)")
        self._sink = sink
        self._done_queue: queue.Queue = queue.Queue()
        self._in_flight = 0
        self._load = {agent: AgentLoad() for agent in self.workflow.agents}
        self._timeline: list[CallTiming] = []
        self._results: list[TrajectoryResult] = []
        self._queries = [
            _Query(index, problem, self.samples_per_query) for index, problem in enumerate(problems)
        ]
        start = time.monotonic()
        if self.mode == "dependency":
            self._run_dependency_driven()
        else:
            self._run_staged()
        wall_time_s = time.monotonic() - start
        logger.debug(
            "%s run (%s): %d queries x %d samples in %.3f s, calls per agent %s",
            self.workflow.name,
            self.mode,
            len(problems),
            self.samples_per_query,
            wall_time_s,
            {agent: load.calls for agent, load in self._load.items()},
        )
        position = {input_id: index for index, input_id in enumerate(ids)}
        self._results.sort(key=lambda r: (position[r.input_id], r.trajectory_id))
        return RunResult(
            self._results, self._load, sorted(self._timeline, key=lambda c: c.submitted_at), wall_time_s
        )

    # ------------------------------------------------------------------------------------------- modes
    def _run_dependency_driven(self) -> None:
        waiting = collections.deque(self._queries)
        limit = self.max_concurrent_queries or len(self._queries)
        active = 0
        while waiting or active:
            while waiting and active < limit:
                query = waiting.popleft()
                active += 1
                self._submit_grouped_roots(query)
                for trajectory in query.trajectories:
                    self._advance(trajectory, math.inf)
                if query.finished == self.samples_per_query:  # every node skipped (cannot happen for roots)
                    active -= 1
            if not active:
                break
            finished_query = self._handle_next(math.inf)
            if finished_query is not None:
                active -= 1

    def _run_staged(self) -> None:
        for level in range(self.workflow.num_levels):
            for query in self._queries:
                if level == 0:
                    self._submit_grouped_roots(query)
                for trajectory in query.trajectories:
                    self._advance(trajectory, level)
            while self._in_flight:  # the barrier: wait for the whole batch's stage
                self._handle_next(level)

    # ------------------------------------------------------------------------------------- scheduling
    def _advance(self, trajectory: _Trajectory, max_level: float) -> None:
        """Submit or skip every pending node whose inputs are resolved (up to `max_level`)."""
        workflow = self.workflow
        for node in workflow.order:
            if node in trajectory.state or workflow.level[node] > max_level:
                continue
            if self.group_root_requests and not workflow.upstream[node]:
                continue  # roots go out per query in _submit_grouped_roots
            upstream_states = [trajectory.state.get(u) for u in workflow.upstream[node]]
            if any(state not in ("done", "skipped") for state in upstream_states):
                continue
            runs = all(state == "done" for state in upstream_states) and all(
                edge.holds(trajectory.outputs[edge.src]) for edge in workflow.incoming[node]
            )
            if runs:
                self._submit(node, [trajectory], self._render(node, trajectory))
            else:
                trajectory.state[node] = "skipped"
                self._load[workflow.nodes[node].agent].skipped += 1
                self._resolve(trajectory.query, node)
        self._maybe_finish(trajectory)

    def _submit_grouped_roots(self, query: _Query) -> None:
        if not self.group_root_requests:
            return
        for node in self.workflow.roots():
            self._submit(node, query.trajectories, self._render(node, query.trajectories[0]))

    def _render(self, node: str, trajectory: _Trajectory) -> str | ChatPrompt:
        return self.workflow.render_prompt(node, trajectory.query.problem.prompt, trajectory.outputs)

    def _submit(self, node: str, trajectories: list[_Trajectory], prompt: str | ChatPrompt) -> None:
        workflow = self.workflow
        agent, query = workflow.nodes[node].agent, trajectories[0].query
        turn = workflow.turn[node]
        suffix = str(trajectories[0].trajectory_id) if len(trajectories) == 1 else "*"
        request = GenerationRequest(
            request_id=f"{agent}/{query.problem.input_id}_{turn}_{suffix}",
            agent=agent,
            prompt=prompt,
            num_samples=len(trajectories),
            sampling=self._sampling[agent],
        )
        for trajectory in trajectories:
            trajectory.state[node] = "submitted"
        submitted_at = time.monotonic()
        try:
            future = self.backend.submit(request)
        except PromptTooLong as error:
            if not workflow.upstream[node]:  # a query's own prompt: the run's limits are wrong, not this turn
                raise WorkflowExecutionError(f"request {request.request_id!r}: {error}") from error
            self._skip_overflowing(node, trajectories, error)
            return
        self._in_flight += 1
        self._load[agent].requests += 1
        done_queue = self._done_queue
        future.add_done_callback(lambda f: done_queue.put((node, trajectories, request, submitted_at, f)))

    def _handle_next(self, max_level: float) -> _Query | None:
        """Process one finished request; returns its query if that query just finished."""
        try:
            node, trajectories, request, submitted_at, future = self._done_queue.get(
                timeout=self.request_timeout_s
            )
        except queue.Empty:
            raise TimeoutError(
                f"no generation request finished within request_timeout_s={self.request_timeout_s}"
                f" ({self._in_flight} in flight)"
            ) from None
        self._in_flight -= 1
        completions = self._completions(request, future)
        query = trajectories[0].query
        self._timeline.append(
            CallTiming(
                node,
                request.agent,
                query.problem.input_id,
                tuple(t.trajectory_id for t in trajectories),
                self.workflow.level[node],
                submitted_at,
                time.monotonic(),
            )
        )
        load = self._load[request.agent]
        load.calls += len(completions)
        load.prompt_tokens += len(completions[0].prompt_token_ids)
        load.completion_tokens += sum(len(c.token_ids) for c in completions)
        records = [
            self._record(node, trajectory, request.prompt, completion)
            for trajectory, completion in zip(trajectories, completions, strict=True)
        ]
        if self._sink is not None:
            self._sink.add_calls(records)
        was_finished = query.finished
        for _ in trajectories:
            self._resolve(query, node)
        for trajectory in trajectories:
            self._advance(trajectory, max_level)
        just_finished = was_finished < self.samples_per_query == query.finished
        return query if just_finished else None

    def _completions(self, request: GenerationRequest, future: concurrent.futures.Future) -> list[Completion]:
        try:
            completions = future.result()
        except Exception as error:
            raise WorkflowExecutionError(
                f"request {request.request_id!r} (agent {request.agent!r}) failed: {error!r}"
            ) from error
        if len(completions) != request.num_samples:
            raise WorkflowExecutionError(
                f"request {request.request_id!r} asked for {request.num_samples} samples, "
                f"backend returned {len(completions)}"
            )
        return completions

    def _record(self, node: str, trajectory: _Trajectory, prompt: str, completion: Completion) -> CallRecord:
        workflow, problem = self.workflow, trajectory.query.problem
        agent, turn = workflow.nodes[node].agent, workflow.turn[node]
        sample_id = make_sample_id(problem.input_id, turn, trajectory.trajectory_id)
        upstream_versions: dict[str, int] = {}
        for ancestor in workflow.ancestors[node]:
            if ancestor in trajectory.outputs:
                seen = trajectory.outputs[ancestor]
                upstream_versions[seen.agent] = min(
                    seen.policy_version, upstream_versions.get(seen.agent, seen.policy_version)
                )
        trajectory.state[node] = "done"
        trajectory.outputs[node] = NodeOutput(
            completion.text,
            workflow.nodes[node].parse(completion.text),
            agent,
            completion.policy_version,
            sample_id,
            quoted=self._quoted(agent, completion),
        )
        return CallRecord(
            sample_id=sample_id,
            input_id=problem.input_id,
            turn=turn,
            trajectory_id=trajectory.trajectory_id,
            agent=agent,
            node=node,
            group_id=make_group_id(problem.input_id, turn),
            prompt=str(prompt),
            prompt_token_ids=tuple(completion.prompt_token_ids),
            text=completion.text,
            token_ids=tuple(completion.token_ids),
            logprobs=tuple(completion.logprobs),
            finish_reason=completion.finish_reason,
            policy_version=completion.policy_version,
            upstream_policy_versions=dict(sorted(upstream_versions.items())),
        )

    def _skip_overflowing(self, node: str, trajectories: list[_Trajectory], error: PromptTooLong) -> None:
        """A later turn whose prompt (grown by quoted responses) is too long: that call fails, which skips it and
        the nodes that need it, like a false conditional edge; the trajectory's reward counts what ran."""
        agent = self.workflow.nodes[node].agent
        self._load[agent].overflowed += len(trajectories)
        logger.warning("skipping node %r for %d trajectories: %s", node, len(trajectories), error)
        for trajectory in trajectories:
            trajectory.state[node] = "skipped"
            self._resolve(trajectory.query, node)

    def _quoted(self, agent: str, completion: Completion) -> str | None:
        """The response cut to the workflow's `max_field_tokens` of the producing agent's tokens, for the chat
        prompts that quote it; None when it is not longer. A backend without `decode_tokens` (scripted
        policies) cuts whitespace-separated words instead."""
        limit = self.workflow.max_field_tokens
        if limit is None or len(completion.token_ids) <= limit:
            return None
        decode = getattr(self.backend, "decode_tokens", None)
        if decode is None:
            return " ".join(completion.text.split()[:limit])
        return decode(agent, completion.token_ids[:limit])

    def _resolve(self, query: _Query, node: str) -> None:
        """Count one more trajectory past `node`; close the node's group once all n are past it."""
        query.resolved[node] += 1
        trajectory_made_call = sum(1 for t in query.trajectories if t.state.get(node) == "done")
        if query.resolved[node] == self.samples_per_query and trajectory_made_call and self._sink is not None:
            agent = self.workflow.nodes[node].agent
            self._sink.close_group(
                agent, make_group_id(query.problem.input_id, self.workflow.turn[node]), trajectory_made_call
            )

    def _maybe_finish(self, trajectory: _Trajectory) -> None:
        if trajectory.finished or len(trajectory.state) < len(self.workflow.nodes):
            return
        if any(state == "submitted" for state in trajectory.state.values()):
            return
        trajectory.finished = True
        query = trajectory.query
        rewards, context = allocate_rewards(self.workflow, query.problem, trajectory.outputs, self.verify)
        by_agent: dict[str, tuple[list[str], list[float]]] = {}
        for node, reward in rewards.items():
            ids, values = by_agent.setdefault(trajectory.outputs[node].agent, ([], []))
            ids.append(trajectory.outputs[node].sample_id)
            values.append(reward)
        if self._sink is not None:
            for agent, (ids, values) in by_agent.items():
                self._sink.set_rewards(agent, ids, values)
        skipped = tuple(n for n in self.workflow.order if trajectory.state[n] == "skipped")
        self._results.append(
            TrajectoryResult(
                query.problem.input_id,
                trajectory.trajectory_id,
                context.final_answer,
                context.team_reward,
                rewards,
                dict(trajectory.outputs),
                skipped,
            )
        )
        query.finished += 1
