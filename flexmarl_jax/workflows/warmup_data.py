"""What the supervised warm-up fits each agent to: the calls of a scripted run of the workflow on training problems.

Randomly initialised tiny models emit noise, so RL would first spend many iterations discovering that an answer
is a few characters followed by EOS. Before RL, the workflow runs once with scripted policies on problems drawn
from the task (a `TrainEvalSplit` draws training problems only), and every agent is fitted to what it said there
(prompt -> completion). The warm-up kind (`config.workflow.warmup`) says what those completions teach:

- `format`: every answer is drawn independently of the problem's truth (another training problem's reference
  answer; a verdict is a fair coin). The agents learn the output format and the answers' overall
  distribution, nothing about any problem: RL's first eval is what the format alone gets right.
- `sft`: right answers only (a cold start as in the usual SFT-then-RL recipe). The answering agents are scripted
  to be right half of the time, so that verdict agents see right and wrong answers to judge and correctors get
  called; then only the calls that did their job (`rewards.call_is_right`) are kept.

Pure Python: `orchestrator/warmup.py` runs the supervised steps.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Callable, Sequence

from flexmarl_jax.workflows.executor import WorkflowExecutor
from flexmarl_jax.workflows.generation import GenerationRequest, SamplingParams
from flexmarl_jax.workflows.graph import Workflow
from flexmarl_jax.workflows.oracles import PromptOracle
from flexmarl_jax.workflows.records import InMemorySink
from flexmarl_jax.workflows.rewards import allocate_rewards, call_is_right
from flexmarl_jax.workflows.scripted import Policy, ScriptedBackend
from flexmarl_jax.workflows.tasks import Problem, Task


@dataclasses.dataclass(frozen=True)
class WarmupKind:
    """How the scripted team answers (`answer_accuracy`: None = independently of the truth, else right with this
    probability; `verdict_accuracy` likewise), whether only right calls are kept, and what that teaches."""

    answer_accuracy: float | None
    verdict_accuracy: float | None
    keep_right_calls_only: bool
    teaches: str


WARMUP_KINDS: dict[str, WarmupKind] = {
    "format": WarmupKind(answer_accuracy=None, verdict_accuracy=None, keep_right_calls_only=False,
                         teaches="the output format only (answers drawn independently of the truth)"),
    "sft": WarmupKind(answer_accuracy=0.5, verdict_accuracy=1.0, keep_right_calls_only=True,
                      teaches="right answers (a supervised cold start)"),
}


def warmup_examples(workflow: Workflow, task: Task, *, kind: str, queries: int, samples_per_query: int,
                    seed: int) -> dict[str, list[tuple[str, str]]]:
    """agent -> [(prompt, completion)]: the calls of a scripted run of `workflow` on `queries` problems that
    `task.generate` draws (pass a `TrainEvalSplit` to keep eval problems out), as warm-up `kind` answers."""
    if kind not in WARMUP_KINDS:
        raise ValueError(f"unknown warm-up kind {kind!r}; allowed: {sorted(WARMUP_KINDS)}")
    settings = WARMUP_KINDS[kind]
    problems = warmup_problems(task, queries=queries, seed=seed)
    policies = _scripted_team(workflow, problems, task.verify, settings)
    sink = InMemorySink()
    with ScriptedBackend(policies, seed=seed) as backend:
        executor = WorkflowExecutor(workflow, backend, task, samples_per_query=samples_per_query,
                                    sampling=SamplingParams(max_new_tokens=64))
        result = executor.run(problems, sink)
    keep = None
    if settings.keep_right_calls_only:
        by_id = {problem.input_id: problem for problem in problems}
        keep = set()
        for trajectory in result.trajectories:
            _, context = allocate_rewards(workflow, by_id[trajectory.input_id], trajectory.outputs, task.verify)
            keep.update(output.sample_id for node, output in trajectory.outputs.items()
                        if call_is_right(workflow, node, context))
    examples: dict[str, list[tuple[str, str]]] = {agent: [] for agent in workflow.agents}
    for (agent, sample_id), record in sorted(sink.records.items()):
        if keep is None or sample_id in keep:
            examples[agent].append((str(record.prompt), record.text))
    return examples


def warmup_problems(task: Task, *, queries: int, seed: int) -> list[Problem]:
    """The problems the warm-up of run seed `seed` runs the workflow on (its own seed: not an iteration's)."""
    return task.generate(queries, seed=zlib.crc32(f"warmup/{seed}".encode()))


def _scripted_team(workflow: Workflow, problems: Sequence[Problem], verify: Callable[[Problem, str | None], bool],
                   settings: WarmupKind) -> dict[str, Policy]:
    """agent -> its scripted policy; an agent that plays several nodes answers each by the node's parser (the
    request id's turn says which node a request is for)."""
    oracle = PromptOracle(problems)
    answers = [problem.answer for problem in problems]
    node_of = {(node.agent, workflow.turn[name]): name for name, node in workflow.nodes.items()}
    by_node = {}
    for name, node in workflow.nodes.items():
        if node.parser == "verdict":
            # The judged answer sits between the query prompt and the template's closing text ("{solver}?").
            closing = node.template.rsplit("}", 1)[-1]
            by_node[name] = _verdict_policy(oracle, verify, settings.verdict_accuracy, closing)
        else:
            by_node[name] = _answer_policy(oracle, answers, settings.answer_accuracy)

    def for_agent(agent: str) -> Policy:
        def policy(request: GenerationRequest, sample_index: int, rng: random.Random) -> str:
            turn = int(request.request_id.rsplit("_", 2)[1])  # "{agent}/{input_id}_{turn}_{trajectory}"
            return by_node[node_of[(agent, turn)]](request, sample_index, rng)

        return policy

    return {agent: for_agent(agent) for agent in workflow.agents}


def _answer_policy(oracle: PromptOracle, answers: Sequence[str], accuracy: float | None) -> Policy:
    """The reference answer with probability `accuracy`, else a training problem's answer drawn at random
    (with `accuracy` None: always the random draw, whatever the problem)."""

    def policy(request: GenerationRequest, sample_index: int, rng: random.Random) -> str:
        if accuracy is not None and rng.random() < accuracy:
            return oracle.find(request.prompt)[0].answer
        return rng.choice(answers)

    return policy


def _verdict_policy(oracle: PromptOracle, verify: Callable[[Problem, str | None], bool], accuracy: float | None,
                    closing: str) -> Policy:
    """The right verdict on the quoted answer with probability `accuracy` (None: a fair coin, whatever it is)."""

    def policy(request: GenerationRequest, sample_index: int, rng: random.Random) -> str:
        if accuracy is None:
            return rng.choice("YN")
        problem, rest = oracle.find(request.prompt)
        candidate = rest[: len(rest) - len(closing)] if closing and rest.endswith(closing) else rest
        right = verify(problem, candidate)
        says_right = right if rng.random() < accuracy else not right
        return "Y" if says_right else "N"

    return policy


