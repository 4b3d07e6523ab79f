"""A workflow is a DAG of agent calls: nodes, dependency edges and conditional edges.

A node is one agent call per trajectory: a prompt template over the query and its upstream nodes' answers,
and an output parser. An edge `src -> dst` makes `dst` wait for `src`; a conditional edge also skips `dst`
unless its predicate on `src`'s output holds (the corrector runs only when the verifier rejects). A node
runs iff every upstream node ran and every conditional edge into it holds; otherwise it is skipped, and
skipping propagates downstream.
"""

from __future__ import annotations

import dataclasses
import re
import string
from collections.abc import Callable, Mapping, Sequence

from flexmarl_jax.workflows import verifiers
from flexmarl_jax.workflows.generation import ChatPrompt
from flexmarl_jax.workflows.math_answers import extract_final_answer

_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)*")
# Fields every template may use besides upstream node names.
BUILTIN_FIELDS = ("prompt", "inputs")


class WorkflowError(ValueError):
    """The workflow definition itself is invalid (cycle, unknown node, bad template, ...)."""


# ---------------------------------------------------------------------------------------------- parsers
def parse_answer(text: str) -> str | None:
    """The first non-empty line, stripped."""
    return verifiers.first_line(text)


def parse_verdict(text: str) -> str | None:
    """ "Y"/"N" from "Y", "yes", " n." ...; None when it is neither."""
    line = verifiers.first_line(text)
    if line is None:
        return None
    word = line.split()[0].strip(".,!:;").lower()
    if word in ("y", "yes", "true", "correct"):
        return "Y"
    if word in ("n", "no", "false", "wrong", "incorrect"):
        return "N"
    return None


# "math": the final answer of a worked solution (\boxed{}, "#### x", "answer is x", else the last number), for
# chat models that reason before answering.
PARSERS: dict[str, Callable[[str], str | None]] = {
    "answer": parse_answer,
    "verdict": parse_verdict,
    "math": extract_final_answer,
}


@dataclasses.dataclass(frozen=True)
class NodeOutput:
    """What one node produced in one trajectory: the raw text and the parsed answer (None if malformed)."""

    text: str
    answer: str | None
    agent: str
    policy_version: int
    sample_id: str
    # The response as chat prompts quote it: the whole text, cut to the workflow's `max_field_tokens` in the
    # producing agent's tokens (the executor cuts it; None when nothing was cut).
    quoted: str | None = None

    def field_value(self, max_chars: int | None) -> str:
        """What downstream plain templates see: the parsed answer, else the stripped raw text; maybe truncated."""
        value = self.answer if self.answer is not None else self.text.strip().replace("\n", " ")
        return value if max_chars is None else value[:max_chars]

    def quoted_value(self) -> str:
        """What downstream chat prompts see: the response itself (reasoning included), maybe cut in tokens."""
        return (self.quoted if self.quoted is not None else self.text).strip()


# ------------------------------------------------------------------------------------------- conditions
CONDITIONS: dict[str, Callable[[NodeOutput], bool]] = {
    "accepted": lambda output: output.answer == "Y",
    "rejected": lambda output: output.answer == "N",
    "always": lambda output: True,
}


@dataclasses.dataclass(frozen=True)
class Node:
    """One agent call per trajectory.

    Args:
      name: unique node name; upstream answers appear in templates as `{name}`.
      agent: whose policy answers (several nodes may share an agent).
      template: str.format template over {prompt} (the query), {inputs} (upstream answers joined by
        `Workflow.input_separator`, in edge order) and `{<upstream node name>}`.
      parser: completion text -> parsed answer, or a name in PARSERS.
      turn: the `turn` in sample ids `{input_id}_{turn}_{trajectory_id}`; default: the node's position in
        topological order. (agent, turn) must be unique so an agent's sample ids never collide.
      system: with a system prompt the node's prompt is a `ChatPrompt` (system, and `template` rendered as the
        user turn, upstream responses quoted whole); without, `template` renders to plain text.
    """

    name: str
    agent: str
    template: str = "{prompt}"
    parser: Callable[[str], str | None] | str = "answer"
    turn: int | None = None
    system: str | None = None

    def parse(self, text: str) -> str | None:
        parser = PARSERS[self.parser] if isinstance(self.parser, str) else self.parser
        try:
            return parser(text)
        except Exception:  # a parser must not take the rollout down: malformed output is just malformed
            return None


@dataclasses.dataclass(frozen=True)
class Edge:
    """`dst` waits for `src`; with `when` (a predicate or a CONDITIONS name) `dst` runs only if it holds."""

    src: str
    dst: str
    when: Callable[[NodeOutput], bool] | str | None = None

    def holds(self, output: NodeOutput) -> bool:
        if self.when is None:
            return True
        predicate = CONDITIONS[self.when] if isinstance(self.when, str) else self.when
        return bool(predicate(output))


@dataclasses.dataclass(frozen=True)
class ShapingTerm:
    """A per-agent reward term: `score(node_name, trajectory_context) -> float` for each node in `nodes`.

    The weight comes from the workflow's `RewardWeights.shaping[name]`.
    """

    name: str
    nodes: tuple[str, ...]
    score: Callable[[str, object], float]
    description: str = ""


AnswerFn = Callable[[Mapping[str, NodeOutput]], str | None]


def first_answer_of(nodes: Sequence[str]) -> AnswerFn:
    """The final answer is the answer of the first node in `nodes` that ran (e.g. corrector, else solver)."""

    def answer(outputs: Mapping[str, NodeOutput]) -> str | None:
        for node in nodes:
            if node in outputs:
                return outputs[node].answer
        return None

    return answer


@dataclasses.dataclass(frozen=True)
class RewardWeights:
    """Reward of one call = team * (final answer correct) + sum_k shaping[k] * term_k(call)."""

    team: float = 1.0
    shaping: Mapping[str, float] = dataclasses.field(default_factory=dict)


class Workflow:
    """A validated DAG of nodes. Raises WorkflowError naming the problem for any invalid definition."""

    def __init__(
        self,
        name: str,
        nodes: Sequence[Node],
        edges: Sequence[Edge],
        answer: AnswerFn,
        *,
        shaping_terms: Sequence[ShapingTerm] = (),
        reward_weights: RewardWeights = RewardWeights(),
        input_separator: str = ",",
        max_field_chars: int | None = 16,
        max_field_tokens: int | None = None,
    ):
        self.name = name
        self.nodes: dict[str, Node] = {}
        for node in nodes:
            if not _IDENTIFIER.fullmatch(node.name):
                raise WorkflowError(
                    f"workflow {name!r}: node name {node.name!r} must be an identifier "
                    "(letters, digits, single underscores) so templates can name it"
                )
            if node.name in self.nodes:
                raise WorkflowError(f"workflow {name!r}: duplicate node name {node.name!r}")
            if node.name in BUILTIN_FIELDS:
                raise WorkflowError(
                    f"workflow {name!r}: node name {node.name!r} is reserved ({BUILTIN_FIELDS})"
                )
            if isinstance(node.parser, str) and node.parser not in PARSERS:
                raise WorkflowError(
                    f"node {node.name!r}: unknown parser {node.parser!r}; allowed: {sorted(PARSERS)}"
                )
            self.nodes[node.name] = node
        if not self.nodes:
            raise WorkflowError(f"workflow {name!r} has no nodes")
        self.edges = tuple(edges)
        for edge in self.edges:
            for end in (edge.src, edge.dst):
                if end not in self.nodes:
                    raise WorkflowError(
                        f"workflow {name!r}: edge {edge.src!r} -> {edge.dst!r} names unknown "
                        f"agent/node {end!r}; known nodes: {sorted(self.nodes)}"
                    )
            if isinstance(edge.when, str) and edge.when not in CONDITIONS:
                raise WorkflowError(
                    f"edge {edge.src!r} -> {edge.dst!r}: unknown condition {edge.when!r}; "
                    f"allowed: {sorted(CONDITIONS)}"
                )
        self.upstream: dict[str, tuple[str, ...]] = {
            node: tuple(dict.fromkeys(e.src for e in self.edges if e.dst == node)) for node in self.nodes
        }
        self.incoming: dict[str, tuple[Edge, ...]] = {
            node: tuple(e for e in self.edges if e.dst == node) for node in self.nodes
        }
        self.downstream: dict[str, tuple[str, ...]] = {
            node: tuple(dict.fromkeys(e.dst for e in self.edges if e.src == node)) for node in self.nodes
        }
        self.order: tuple[str, ...] = self._topological_order()
        self.level: dict[str, int] = {}
        for node in self.order:  # longest path from a root: the stage in stage-by-stage execution
            self.level[node] = 1 + max((self.level[u] for u in self.upstream[node]), default=-1)
        self.ancestors: dict[str, frozenset[str]] = {}
        for node in self.order:
            self.ancestors[node] = frozenset(self.upstream[node]).union(
                *(self.ancestors[u] for u in self.upstream[node])
            )
        self.turn = {
            node: self.nodes[node].turn if self.nodes[node].turn is not None else index
            for index, node in enumerate(self.order)
        }
        self._check_turns()
        self._check_templates()
        self.answer = answer
        self.shaping_terms = {term.name: term for term in shaping_terms}
        for term in shaping_terms:
            unknown = [n for n in term.nodes if n not in self.nodes]
            if unknown:
                raise WorkflowError(f"shaping term {term.name!r} names unknown nodes {unknown}")
        self.reward_weights = reward_weights
        unknown_terms = sorted(set(reward_weights.shaping) - set(self.shaping_terms))
        if unknown_terms:
            raise WorkflowError(
                f"workflow {name!r}: unknown shaping weights {unknown_terms}; "
                f"allowed: {sorted(self.shaping_terms)}"
            )
        self.input_separator = input_separator
        self.max_field_chars = max_field_chars
        if max_field_tokens is not None and max_field_tokens < 1:
            raise WorkflowError(f"workflow {name!r}: max_field_tokens={max_field_tokens} must be >= 1 (or None)")
        self.max_field_tokens = max_field_tokens

    @property
    def agents(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.nodes[n].agent for n in self.order))

    @property
    def num_levels(self) -> int:
        return 1 + max(self.level.values())

    def roots(self) -> tuple[str, ...]:
        return tuple(n for n in self.order if not self.upstream[n])

    @property
    def chat(self) -> bool:
        """Whether its prompts are chat messages (every node has a system prompt)."""
        return all(node.system is not None for node in self.nodes.values())

    def render_prompt(self, node: str, query_prompt: str, outputs: Mapping[str, NodeOutput]) -> str | ChatPrompt:
        """The prompt of `node` given the query and the outputs of (at least) its upstream nodes: plain text, or
        a `ChatPrompt` for a node with a system prompt (upstream responses quoted whole, cut in tokens)."""
        spec = self.nodes[node]
        if spec.system is None:
            fields = {u: outputs[u].field_value(self.max_field_chars) for u in self.upstream[node]}
            fields["inputs"] = self.input_separator.join(fields[u] for u in self.upstream[node])
        else:
            fields = {u: outputs[u].quoted_value() for u in self.upstream[node]}
            fields["inputs"] = "\n\n".join(
                f"Response {index + 1}:\n{fields[u]}" for index, u in enumerate(self.upstream[node]))
        fields["prompt"] = query_prompt
        text = spec.template.format(**fields)
        return text if spec.system is None else ChatPrompt(system=spec.system, user=text)

    def max_prompt_chars(self, max_query_chars: int) -> int:
        """Worst-case rendered prompt length over all nodes, for checking against an engine's prompt limit.

        Needs `max_field_chars` (upstream answers are unbounded otherwise).
        """
        if self.max_field_chars is None:
            raise WorkflowError(
                f"workflow {self.name!r} has max_field_chars=None: prompt length is unbounded"
            )
        longest = 0
        for node in self.order:
            upstream = self.upstream[node]
            field_chars = {u: self.max_field_chars for u in upstream}
            field_chars["prompt"] = max_query_chars
            field_chars["inputs"] = len(upstream) * self.max_field_chars + max(0, len(upstream) - 1) * len(
                self.input_separator
            )
            length = 0
            for literal, field, _, _ in string.Formatter().parse(self.nodes[node].template):
                length += len(literal) + (field_chars[field] if field is not None else 0)
            longest = max(longest, length)
        return longest

    def _topological_order(self) -> tuple[str, ...]:
        # Kahn's algorithm, ties broken by declaration order so turns are deterministic.
        remaining = {node: len(self.upstream[node]) for node in self.nodes}
        ready = [node for node in self.nodes if remaining[node] == 0]
        order = []
        while ready:
            node = ready.pop(0)
            order.append(node)
            for child in self.downstream[node]:
                remaining[child] -= 1
                if remaining[child] == 0:
                    ready.append(child)
        if len(order) < len(self.nodes):
            raise WorkflowError(
                f"workflow {self.name!r} has a cycle: {' -> '.join(self._find_cycle(order))}; "
                "a workflow must be a DAG (use rounds, i.e. one node per round, for debate)"
            )
        return tuple(order)

    def _find_cycle(self, acyclic: Sequence[str]) -> list[str]:
        # Every node outside the topological prefix has an upstream node that is also outside it (or is on
        # a cycle), so walking upstream must revisit a node.
        outside = [n for n in self.nodes if n not in set(acyclic)]
        path, seen = [outside[0]], {outside[0]: 0}
        while True:
            parent = next(u for u in self.upstream[path[-1]] if u in outside)
            if parent in seen:
                cycle = path[seen[parent] :] + [parent]
                return cycle[::-1]
            seen[parent] = len(path)
            path.append(parent)

    def _check_turns(self) -> None:
        seen: dict[tuple[str, int], str] = {}
        for node in self.order:
            key = (self.nodes[node].agent, self.turn[node])
            if key in seen:
                raise WorkflowError(
                    f"workflow {self.name!r}: nodes {seen[key]!r} and {node!r} are both agent "
                    f"{key[0]!r} at turn {key[1]}; sample ids would collide, give distinct turns"
                )
            seen[key] = node

    def _check_templates(self) -> None:
        for node in self.order:
            allowed = set(BUILTIN_FIELDS) | set(self.upstream[node])
            try:
                fields = [
                    field
                    for _, field, _, _ in string.Formatter().parse(self.nodes[node].template)
                    if field is not None
                ]
            except ValueError as error:
                raise WorkflowError(
                    f"node {node!r}: bad template {self.nodes[node].template!r}: {error}"
                ) from None
            for field in fields:
                if field not in allowed:
                    raise WorkflowError(
                        f"node {node!r}: template {self.nodes[node].template!r} uses {{{field}}}; "
                        f"allowed: {sorted(allowed)} (a template may name only upstream nodes)"
                    )
