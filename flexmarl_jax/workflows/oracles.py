"""Scripted stand-ins for trained agents: they know the answers and are right with a set probability.

Used by tests and the workflows benchmark with `ScriptedBackend`. A policy finds the query a prompt was
built from by the longest known query prompt that prefixes it, so it works for any template that starts
with `{prompt}` (all built-in templates do).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from flexmarl_jax.workflows.generation import GenerationRequest
from flexmarl_jax.workflows.scripted import Policy
from flexmarl_jax.workflows.tasks import Problem


class PromptOracle:
    """Maps a rendered prompt back to (problem, the text after the query prompt)."""

    def __init__(self, problems: Sequence[Problem]):
        self._by_prompt = {problem.prompt: problem for problem in problems}
        self._lengths = sorted({len(prompt) for prompt in self._by_prompt}, reverse=True)

    def find(self, prompt: str) -> tuple[Problem, str]:
        for length in self._lengths:
            problem = self._by_prompt.get(prompt[:length])
            if problem is not None:
                return problem, prompt[length:]
        raise KeyError(f"prompt {prompt!r} starts with no known query prompt")


def wrong_answer(problem: Problem, rng: random.Random) -> str:
    """A plausible but wrong answer: a nearby number, or a string that cannot match."""
    reference = problem.answer.strip()
    if reference.lstrip("-").isdigit():
        return str(int(reference) + rng.choice((-10, -2, -1, 1, 2, 10)))
    return reference[::-1] + "0"


def answer_policy(oracle: PromptOracle, accuracy: float) -> Policy:
    """Answers the query right with probability `accuracy` (solver, corrector, debater, aggregator)."""

    def policy(request: GenerationRequest, sample_index: int, rng: random.Random) -> str:
        problem, _ = oracle.find(request.prompt)
        return problem.answer if rng.random() < accuracy else wrong_answer(problem, rng)

    return policy


def verdict_policy(
    oracle: PromptOracle, verify: Callable[[Problem, str | None], bool], accuracy: float, end: str = "?"
) -> Policy:
    """Judges the candidate after the query prompt (up to `end`) right with probability `accuracy`."""

    def policy(request: GenerationRequest, sample_index: int, rng: random.Random) -> str:
        problem, rest = oracle.find(request.prompt)
        candidate = rest[: -len(end)] if end and rest.endswith(end) else rest
        truth = verify(problem, candidate)
        says_correct = truth if rng.random() < accuracy else not truth
        return "Y" if says_correct else "N"

    return policy


def chain_policies(
    problems: Sequence[Problem],
    verify: Callable[[Problem, str | None], bool],
    *,
    solver_accuracy: float = 0.5,
    verifier_accuracy: float = 0.8,
    corrector_accuracy: float = 0.7,
) -> dict[str, Policy]:
    """Role -> policy for the chain workflow's default templates."""
    oracle = PromptOracle(problems)
    return {
        "solver": answer_policy(oracle, solver_accuracy),
        "verifier": verdict_policy(oracle, verify, verifier_accuracy),
        "corrector": answer_policy(oracle, corrector_accuracy),
    }
