"""Held-out evaluation: the team runs the task's eval problems with its current policies, outside training.

    evaluator = TeamEvaluator(workflow, backend, task.eval_problems(200, seed=EVAL_PROBLEMS_SEED), task.verify,
                              sampling, samples=8)
    record = evaluator.evaluate(step, orchestrator.versions())    # a metrics record of kind "eval"

Each evaluation runs the workflow twice over the same fixed list of eval problems, through the rollout backend
the training rollouts use (so on the weights the last sync put there), with no experience sink: nothing of it
reaches the store or a trainer.

- greedy: one trajectory per problem, every agent at temperature 0 -> `eval_team_accuracy` (the fraction of
  problems whose final answer verifies) and, per agent, `eval_accuracy`: the fraction of its calls that did
  their job (`rewards.call_is_right`: an answer that verifies, a verdict that matches the truth);
- sampled: `samples` = k trajectories per problem with every agent's own sampling -> `eval_pass_at_k` (the
  fraction of problems with at least one of k final answers right) and `eval_sampled_accuracy` (the mean over
  all k x problems trajectories). `samples=0` skips this pass (both are None then): on a real model on a CPU
  the sampled pass costs k times the greedy one, and the greedy accuracy is the figure that is tracked.

An eval record's `iteration` is the number of RL iterations done when it ran, i.e. the policy version it
evaluates: eval `iteration` s and the training record of iteration s describe the same policies. `run.py`
evaluates at s = 0 (after warm-up, before the first update), whenever s is a multiple of `eval.every`, and at
s = `iterations` (`evaluation_due`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from flexmarl_jax.metrics.writer import EVAL_KIND
from flexmarl_jax.workflows import GenerationBackend, Problem, RunResult, SamplingParams, Workflow, WorkflowExecutor
from flexmarl_jax.workflows.rewards import allocate_rewards, call_is_right

logger = logging.getLogger(__name__)


def evaluation_due(step: int, *, every: int, iterations: int) -> bool:
    """Whether the policy after `step` RL iterations is evaluated: at the start (0), every `every` iterations,
    and at the end (`iterations`)."""
    return step == 0 or step % every == 0 or step == iterations


class TeamEvaluator:
    """Evaluates the team on a fixed list of eval problems.

    Args:
      workflow: the team's workflow.
      backend: the generation backend the training rollouts use (its instances hold the current weights).
      problems: the eval problems (distinct contents; `TrainEvalSplit.eval_problems`).
      verify: the task's answer check.
      sampling: agent -> how its rollouts sample (the sampled pass uses it as is; the greedy pass at
        temperature 0).
      samples: k, sampled trajectories per problem; 0 = the greedy pass only.
    """

    def __init__(self, workflow: Workflow, backend: GenerationBackend, problems: Sequence[Problem],
                 verify: Callable[[Problem, str | None], bool], sampling: Mapping[str, SamplingParams], *,
                 samples: int):
        if not problems:
            raise ValueError("no eval problems")
        if samples < 0:
            raise ValueError(f"samples={samples} must be >= 0 (0 = the greedy pass only)")
        self.workflow, self.backend, self.verify = workflow, backend, verify
        self.problems = list(problems)
        self.samples = samples
        self.sampling = dict(sampling)
        self.greedy_sampling = {agent: dataclasses.replace(params, temperature=0.0)
                                for agent, params in self.sampling.items()}

    def evaluate(self, step: int, policy_versions: Mapping[str, int]) -> dict:
        """Runs the greedy and (samples > 0) the sampled pass; returns the eval record (module docstring)."""
        started = time.monotonic()
        greedy_problems, greedy = self._run(self.greedy_sampling, samples=1, tag=f"{step}g")
        sampled = self._run(self.sampling, samples=self.samples, tag=f"{step}s")[1] if self.samples else None
        self._check_versions(step, policy_versions, (greedy,) if sampled is None else (greedy, sampled))
        by_agent = agent_accuracy(self.workflow, greedy_problems, greedy, self.verify)
        record = {
            "kind": EVAL_KIND,
            "iteration": step,
            "policy_version": dict(policy_versions),
            "eval_team_accuracy": greedy.accuracy,
            "eval_pass_at_k": None if sampled is None else pass_at_k(sampled),
            "eval_sampled_accuracy": None if sampled is None else sampled.accuracy,
            "eval_k": self.samples,
            "eval_problems": len(self.problems),
            "eval_wall_s": time.monotonic() - started,
            "agent": {agent: {"eval_accuracy": accuracy} for agent, accuracy in by_agent.items()},
        }
        sampled_text = f", pass@{self.samples} {record['eval_pass_at_k']:.3f}" if sampled is not None else ""
        logger.info("eval after %d iterations: greedy team accuracy %.3f%s (%d problems, %.1f s)", step,
                    record["eval_team_accuracy"], sampled_text, len(self.problems), record["eval_wall_s"])
        return record

    def _run(self, sampling: Mapping[str, SamplingParams], *, samples: int,
             tag: str) -> tuple[list[Problem], RunResult]:
        """(the problems as run, the result) of one pass over the eval problems."""
        # Fresh input ids per pass: request ids (and the seeds derived from them) never repeat across evals.
        problems = [dataclasses.replace(problem, input_id=f"{problem.input_id}-{tag}") for problem in self.problems]
        executor = WorkflowExecutor(self.workflow, self.backend, self.verify, samples_per_query=samples,
                                    sampling=sampling, mode="dependency", group_root_requests=samples > 1)
        return problems, executor.run(problems, sink=None)  # no sink: nothing is stored, nothing is trained

    def _check_versions(self, step: int, expected: Mapping[str, int], results: Sequence[RunResult]) -> None:
        seen = {(output.agent, output.policy_version) for result in results for trajectory in result.trajectories
                for output in trajectory.outputs.values()}
        stale = sorted((agent, version) for agent, version in seen if version != expected.get(agent, version))
        if stale:
            logger.warning("eval after %d iterations: some calls ran on other policy versions than %s: %s", step,
                           dict(expected), stale)


def pass_at_k(result: RunResult) -> float:
    """The fraction of problems with at least one trajectory whose final answer verifies."""
    solved: dict[str, bool] = {}
    for trajectory in result.trajectories:
        solved[trajectory.input_id] = solved.get(trajectory.input_id, False) or trajectory.team_reward > 0
    return sum(solved.values()) / max(1, len(solved))


def agent_accuracy(workflow: Workflow, problems: Sequence[Problem], result: RunResult,
                   verify: Callable[[Problem, str | None], bool]) -> dict[str, float | None]:
    """agent -> the fraction of its calls in `result` (a run over `problems`) that did their job
    (`rewards.call_is_right`); None for an agent that was never called (a corrector whose verifier accepted
    everything)."""
    by_id = {problem.input_id: problem for problem in problems}
    right: dict[str, list[bool]] = {agent: [] for agent in workflow.agents}
    for trajectory in result.trajectories:
        problem = by_id[trajectory.input_id]
        _, context = allocate_rewards(workflow, problem, trajectory.outputs, verify)
        for node, output in trajectory.outputs.items():
            right[output.agent].append(call_is_right(workflow, node, context))
    return {agent: float(np.mean(calls)) if calls else None for agent, calls in right.items()}
