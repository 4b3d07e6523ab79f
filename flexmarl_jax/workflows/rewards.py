"""Per-agent reward allocation: a team reward plus weighted per-agent shaping terms.

Every call (node that ran) in a trajectory gets
    reward = weights.team * team_reward + sum_k weights.shaping[k] * term_k.score(node, context)
where team_reward = 1.0 if the workflow's final answer verifies, else 0.0, and a shaping term scores only
the nodes it lists. Skipped nodes have no call and no reward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from flexmarl_jax.workflows.graph import NodeOutput, Workflow
from flexmarl_jax.workflows.tasks import Problem


@dataclasses.dataclass(frozen=True)
class TrajectoryContext:
    """Everything a shaping term may look at, for one finished trajectory."""

    problem: Problem
    outputs: Mapping[str, NodeOutput]  # only nodes that ran
    final_answer: str | None
    team_reward: float
    verify: Callable[[Problem, str | None], bool]

    def is_correct(self, node: str) -> bool:
        """True iff `node` ran and its parsed answer verifies against the problem."""
        return node in self.outputs and bool(self.verify(self.problem, self.outputs[node].answer))


def allocate_rewards(
    workflow: Workflow,
    problem: Problem,
    outputs: Mapping[str, NodeOutput],
    verify: Callable[[Problem, str | None], bool],
) -> tuple[dict[str, float], TrajectoryContext]:
    """(node -> reward for every node that ran, the context used). Pure; never raises on bad outputs."""
    final_answer = workflow.answer(outputs)
    team_reward = 1.0 if verify(problem, final_answer) else 0.0
    context = TrajectoryContext(problem, outputs, final_answer, team_reward, verify)
    weights = workflow.reward_weights
    rewards = {node: weights.team * team_reward for node in outputs}
    for name, weight in weights.shaping.items():
        if weight == 0.0:
            continue
        term = workflow.shaping_terms[name]
        for node in term.nodes:
            if node in outputs:
                rewards[node] += weight * float(term.score(node, context))
    return rewards, context


# --------------------------------------------------------------------- shaping scores used by built-ins
def own_answer_correct(node: str, context: TrajectoryContext) -> float:
    """1 if this node's own answer verifies."""
    return float(context.is_correct(node))


def judgement_correct(answer_node: str) -> Callable[[str, TrajectoryContext], float]:
    """1 if this verdict node said "Y" to a correct `answer_node` answer or "N" to a wrong one."""

    def score(node: str, context: TrajectoryContext) -> float:
        verdict = context.outputs[node].answer
        if verdict not in ("Y", "N"):
            return 0.0
        return float((verdict == "Y") == context.is_correct(answer_node))

    return score


def successful_fix(answer_node: str) -> Callable[[str, TrajectoryContext], float]:
    """1 if `answer_node` was wrong and this node's answer is right."""

    def score(node: str, context: TrajectoryContext) -> float:
        return float(context.is_correct(node) and not context.is_correct(answer_node))

    return score


def call_is_right(workflow: Workflow, node: str, context: TrajectoryContext) -> bool:
    """Whether one call did its job: a verdict node ("verdict" parser) said "Y" to an answer that verifies or
    "N" to one that does not (the answer of its first upstream node that is not a verdict); any other node's
    own answer verifies. What warm-up's `sft` keeps and an agent's eval accuracy counts."""
    if node not in context.outputs:
        return False
    if workflow.nodes[node].parser == "verdict":
        judged = [upstream for upstream in workflow.upstream[node] if workflow.nodes[upstream].parser != "verdict"]
        return bool(judged) and bool(judgement_correct(judged[0])(node, context))
    return context.is_correct(node)
