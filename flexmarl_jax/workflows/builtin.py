"""Built-in workflows and the `build_workflow(name, **kwargs)` registry.

chain    solver -> verifier -> corrector (the corrector runs only when the verifier rejects)
debate   N agents, R rounds (round r sees every agent's round r-1 answer); majority vote or a judge
mixture  k proposers -> aggregator
dag      any DAG from plain dicts (for configs)
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from flexmarl_jax.workflows import rewards as shaping
from flexmarl_jax.workflows.chat_prompts import CHAIN_CHAT, DEBATE_CHAT, MIXTURE_CHAT
from flexmarl_jax.workflows.graph import (
    Edge,
    Node,
    NodeOutput,
    RewardWeights,
    ShapingTerm,
    Workflow,
    WorkflowError,
    first_answer_of,
)

WORKFLOW_BUILDERS: dict[str, Callable[..., Workflow]] = {}
# workflow -> the builder arguments whose values name roles (a role name, a list of them, or DAG node
# dicts whose "agent" is a role). `build_configured_workflow` maps these through `workflow.roles`.
ROLE_ARGUMENTS: dict[str, tuple[str, ...]] = {}
# workflow -> its shaping terms with their default weights.
SHAPING_DEFAULTS: dict[str, Mapping[str, float]] = {}


def register_workflow(
    name: str, *, role_arguments: Sequence[str] = (), shaping: Mapping[str, float] | None = None
) -> Callable[[Callable[..., Workflow]], Callable[..., Workflow]]:
    def decorator(builder: Callable[..., Workflow]) -> Callable[..., Workflow]:
        WORKFLOW_BUILDERS[name] = builder
        ROLE_ARGUMENTS[name] = tuple(role_arguments)
        SHAPING_DEFAULTS[name] = dict(shaping or {})
        return builder

    return decorator


def workflow_options(name: str) -> tuple[str, ...]:
    """The options (builder arguments) workflow `name` takes, besides its shaping weights."""
    parameters = inspect.signature(WORKFLOW_BUILDERS[name]).parameters
    return tuple(sorted(set(parameters) - {"shaping_weights"}))


def build_workflow(name: str, **kwargs: Any) -> Workflow:
    """A workflow by registry name; unknown names or options raise naming what is allowed."""
    if name not in WORKFLOW_BUILDERS:
        raise ValueError(f"unknown workflow {name!r}; allowed: {sorted(WORKFLOW_BUILDERS)}")
    builder = WORKFLOW_BUILDERS[name]
    allowed = set(inspect.signature(builder).parameters)
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ValueError(f"workflow {name!r} got unknown options {unknown}; allowed: {sorted(allowed)}")
    return builder(**kwargs)


def _templates(
    defaults: Mapping[str, str], overrides: Mapping[str, str] | None, workflow: str
) -> dict[str, str]:
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise WorkflowError(
            f"workflow {workflow!r}: unknown template keys {unknown}; allowed: {sorted(defaults)}"
        )
    return {**defaults, **overrides}


# Chat models write reasoning before the answer, so answer nodes parse the final answer out of it.
CHAT_ANSWER_PARSER = "math"
# What a chat prompt quotes of an upstream response, in the producing agent's tokens.
DEFAULT_MAX_FIELD_TOKENS = 256


class RolePrompt(NamedTuple):
    """One role's prompt: `system` is None for a plain text prompt; `parser` reads its answers."""

    system: str | None
    template: str
    parser: str


def _role_prompts(
    plain: Mapping[str, str],
    chat_prompts: Mapping[str, tuple[str, str]],
    templates: Mapping[str, str] | None,
    system_prompts: Mapping[str, str] | None,
    chat: bool,
    workflow: str,
) -> dict[str, RolePrompt]:
    """Each role's prompt: the terse plain templates, or with `chat` the natural-language chat prompts;
    `templates` overrides the (user) templates and `system_prompts` the chat system prompts."""
    texts = _templates(plain if not chat else {k: v[1] for k, v in chat_prompts.items()}, templates, workflow)
    if not chat:
        if system_prompts:
            raise WorkflowError(f"workflow {workflow!r}: system_prompts need chat=True")
        return {role: RolePrompt(None, text, "answer") for role, text in texts.items()}
    systems = _templates({k: v[0] for k, v in chat_prompts.items()}, system_prompts, workflow)
    return {role: RolePrompt(systems[role], texts[role], CHAT_ANSWER_PARSER) for role in texts}


def _weights(
    team_weight: float, defaults: Mapping[str, float], overrides: Mapping[str, float] | None, workflow: str
) -> RewardWeights:
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise WorkflowError(
            f"workflow {workflow!r}: unknown shaping weights {unknown}; allowed: {sorted(defaults)}"
        )
    return RewardWeights(
        team=float(team_weight), shaping={**defaults, **{k: float(v) for k, v in overrides.items()}}
    )


CHAIN_TEMPLATES = {
    "solver": "{prompt}",
    "verifier": "{prompt}{solver}?",
    "corrector": "{prompt}{solver} {verifier}:",
}
CHAIN_SHAPING = {"solver_correct": 0.0, "verifier_judgement": 0.5, "corrector_fix": 0.5}


@register_workflow("chain", role_arguments=("agents",), shaping=CHAIN_SHAPING)
def chain(
    agents: Sequence[str] = ("solver", "verifier", "corrector"),
    templates: Mapping[str, str] | None = None,
    corrector_runs: str = "rejected",
    team_weight: float = 1.0,
    shaping_weights: Mapping[str, float] | None = None,
    max_field_chars: int | None = 8,
    chat: bool = False,
    system_prompts: Mapping[str, str] | None = None,
    max_field_tokens: int = DEFAULT_MAX_FIELD_TOKENS,
) -> Workflow:
    """solver -> verifier ("Y"/"N") -> corrector. Final answer: the corrector's if it ran, else the solver's.

    Args:
      agents: agent names for the (solver, verifier, corrector) roles; nodes are named by role.
      templates: overrides of CHAIN_TEMPLATES (keys solver/verifier/corrector).
      corrector_runs: a condition on the verdict ("rejected" by default, "always" for an unconditional chain).
      shaping_weights: overrides of CHAIN_SHAPING: solver_correct (solver's own answer right),
        verifier_judgement (verdict matches the truth of the solver's answer), corrector_fix (wrong -> right).
      chat: chat prompts (chat_prompts.CHAIN_CHAT) for chat models instead of the terse templates;
        system_prompts overrides their system prompts, max_field_tokens caps each quoted response.
    """
    if len(agents) != 3:
        raise WorkflowError(f"chain needs 3 agents (solver, verifier, corrector), got {list(agents)}")
    prompts = _role_prompts(CHAIN_TEMPLATES, CHAIN_CHAT, templates, system_prompts, chat, "chain")
    solver, verifier, corrector = agents
    return Workflow(
        "chain",
        nodes=[
            Node("solver", solver, prompts["solver"].template, prompts["solver"].parser,
                 system=prompts["solver"].system),
            Node("verifier", verifier, prompts["verifier"].template, parser="verdict",
                 system=prompts["verifier"].system),
            Node("corrector", corrector, prompts["corrector"].template, prompts["corrector"].parser,
                 system=prompts["corrector"].system),
        ],
        edges=[
            Edge("solver", "verifier"),
            Edge("solver", "corrector"),
            Edge("verifier", "corrector", when=corrector_runs),
        ],
        answer=first_answer_of(["corrector", "solver"]),
        shaping_terms=[
            ShapingTerm(
                "solver_correct", ("solver",), shaping.own_answer_correct, "solver's answer is right"
            ),
            ShapingTerm(
                "verifier_judgement",
                ("verifier",),
                shaping.judgement_correct("solver"),
                "verdict matches whether the solver was right",
            ),
            ShapingTerm(
                "corrector_fix",
                ("corrector",),
                shaping.successful_fix("solver"),
                "corrector turned a wrong solver answer into a right one",
            ),
        ],
        reward_weights=_weights(team_weight, CHAIN_SHAPING, shaping_weights, "chain"),
        max_field_chars=max_field_chars,
        max_field_tokens=max_field_tokens if chat else None,
    )


def majority_answer(nodes: Sequence[str]) -> Callable[[Mapping[str, NodeOutput]], str | None]:
    """Most common parsed answer among `nodes`; ties go to the answer given first in `nodes` order."""

    def answer(outputs: Mapping[str, NodeOutput]) -> str | None:
        answers = [outputs[n].answer for n in nodes if n in outputs and outputs[n].answer is not None]
        if not answers:
            return None
        counts = collections.Counter(answers)
        best = max(counts.values())
        return next(a for a in answers if counts[a] == best)

    return answer


DEBATE_TEMPLATES = {"first": "{prompt}", "later": "{prompt}{inputs}>", "judge": "{prompt}{inputs}?"}
DEBATE_SHAPING = {"debater_correct": 0.5}


@register_workflow("debate", role_arguments=("debaters", "judge"), shaping=DEBATE_SHAPING)
def debate(
    debaters: Sequence[str] = ("debater0", "debater1", "debater2"),
    rounds: int = 2,
    aggregate: str = "majority",
    judge: str = "judge",
    templates: Mapping[str, str] | None = None,
    team_weight: float = 1.0,
    shaping_weights: Mapping[str, float] | None = None,
    max_field_chars: int | None = 6,
    chat: bool = False,
    system_prompts: Mapping[str, str] | None = None,
    max_field_tokens: int = DEFAULT_MAX_FIELD_TOKENS,
) -> Workflow:
    """N debaters for R rounds; round r > 0 sees all round r-1 answers ({inputs}, in agent order).

    Args:
      debaters: debater agent names (repeat a name to share one policy among debaters).
      rounds: debate rounds; round r > 0 sees every debater's round r-1 answer.
      aggregate: "majority" (vote over last-round answers, ties to the first debater) or "judge" (a judge agent
        sees the last-round answers and answers).
      judge: the judge's agent name (used only with aggregate="judge").
      templates: overrides of DEBATE_TEMPLATES (first round, later rounds, judge).
      shaping_weights: debater_correct (a debater's own answer in that round is right).
      chat: chat prompts (chat_prompts.DEBATE_CHAT; keys first/later/judge) instead of the terse templates.
    """
    if len(debaters) < 2:
        raise WorkflowError(f"debate needs >= 2 debaters, got {list(debaters)}")
    if rounds < 1:
        raise WorkflowError(f"debate rounds={rounds} must be >= 1")
    if aggregate not in ("majority", "judge"):
        raise WorkflowError(f"debate aggregate={aggregate!r}; allowed: ['judge', 'majority']")
    prompts = _role_prompts(DEBATE_TEMPLATES, DEBATE_CHAT, templates, system_prompts, chat, "debate")
    shared = len(set(debaters)) < len(debaters)

    def name(index: int, round_index: int) -> str:
        return f"{debaters[index]}_{index}_r{round_index}" if shared else f"{debaters[index]}_r{round_index}"

    nodes, edges = [], []
    for round_index in range(rounds):
        prompt = prompts["first" if round_index == 0 else "later"]
        for index, agent in enumerate(debaters):
            # Distinct debaters: turn = round. Shared policies need distinct turns per debater slot.
            turn = round_index * len(debaters) + index if shared else round_index
            nodes.append(
                Node(name(index, round_index), agent, prompt.template, prompt.parser, turn=turn, system=prompt.system)
            )
            if round_index:
                edges.extend(
                    Edge(name(peer, round_index - 1), name(index, round_index)) for peer in range(len(debaters))
                )
    last_round = [name(index, rounds - 1) for index in range(len(debaters))]
    if aggregate == "judge":
        judging = prompts["judge"]
        nodes.append(Node("judge", judge, judging.template, judging.parser,
                          turn=rounds * (len(debaters) if shared else 1), system=judging.system))
        edges.extend(Edge(node, "judge") for node in last_round)
        answer = first_answer_of(["judge"])
    else:
        answer = majority_answer(last_round)
    debater_nodes = tuple(n.name for n in nodes if n.name != "judge")
    return Workflow(
        "debate",
        nodes,
        edges,
        answer,
        shaping_terms=[
            ShapingTerm(
                "debater_correct",
                debater_nodes,
                shaping.own_answer_correct,
                "the debater's own answer in that round is right",
            )
        ],
        reward_weights=_weights(team_weight, DEBATE_SHAPING, shaping_weights, "debate"),
        max_field_chars=max_field_chars,
        max_field_tokens=max_field_tokens if chat else None,
    )


MIXTURE_TEMPLATES = {"proposer": "{prompt}", "aggregator": "{prompt}{inputs}>"}
MIXTURE_SHAPING = {"proposal_correct": 0.5}


@register_workflow("mixture", role_arguments=("proposers", "aggregator"), shaping=MIXTURE_SHAPING)
def mixture(
    proposers: Sequence[str] = ("proposer0", "proposer1", "proposer2"),
    aggregator: str = "aggregator",
    templates: Mapping[str, str] | None = None,
    team_weight: float = 1.0,
    shaping_weights: Mapping[str, float] | None = None,
    max_field_chars: int | None = 6,
    chat: bool = False,
    system_prompts: Mapping[str, str] | None = None,
    max_field_tokens: int = DEFAULT_MAX_FIELD_TOKENS,
) -> Workflow:
    """k proposers answer independently; the aggregator sees their answers ({inputs}) and gives the final one.

    Args:
      proposers: proposer agent names (repeat a name to share one policy).
      shaping_weights: proposal_correct (a proposer's own answer is right).
      chat: chat prompts (chat_prompts.MIXTURE_CHAT) instead of the terse templates.
    """
    if not proposers:
        raise WorkflowError("mixture needs >= 1 proposer")
    prompts = _role_prompts(MIXTURE_TEMPLATES, MIXTURE_CHAT, templates, system_prompts, chat, "mixture")
    proposing, aggregating = prompts["proposer"], prompts["aggregator"]
    shared = len(set(proposers)) < len(proposers)
    names = [f"{agent}_{index}" if shared else agent for index, agent in enumerate(proposers)]
    if "aggregator" in names:
        raise WorkflowError("a proposer may not be named 'aggregator' (the aggregator node's name)")
    nodes = [
        Node(node, agent, proposing.template, proposing.parser, turn=index if shared else 0,
             system=proposing.system)
        for index, (node, agent) in enumerate(zip(names, proposers, strict=True))
    ]
    nodes.append(Node("aggregator", aggregator, aggregating.template, aggregating.parser,
                      turn=len(proposers) if shared else 1, system=aggregating.system))
    return Workflow(
        "mixture",
        nodes,
        [Edge(node, "aggregator") for node in names],
        first_answer_of(["aggregator"]),
        shaping_terms=[
            ShapingTerm(
                "proposal_correct",
                tuple(names),
                shaping.own_answer_correct,
                "the proposer's own answer is right",
            )
        ],
        reward_weights=_weights(team_weight, MIXTURE_SHAPING, shaping_weights, "mixture"),
        max_field_chars=max_field_chars,
        max_field_tokens=max_field_tokens if chat else None,
    )


DAG_SHAPING = {"own_answer_correct": 0.0}


@register_workflow("dag", role_arguments=("nodes",), shaping=DAG_SHAPING)
def dag(
    nodes: Sequence[Mapping[str, Any]],
    edges: Sequence[Mapping[str, Any] | Sequence[str]] = (),
    answer_from: Sequence[str] | None = None,
    team_weight: float = 1.0,
    shaping_weights: Mapping[str, float] | None = None,
    max_field_chars: int | None = 16,
    max_field_tokens: int = DEFAULT_MAX_FIELD_TOKENS,
) -> Workflow:
    """A custom DAG from plain data (e.g. a config).

    Args:
      nodes: dicts with "agent" and optional "name" (default: the agent), "template", "parser", "turn", and
        "system" (a chat node: its prompt is a system message plus the template as the user turn).
      edges: dicts {"src", "dst", "when"?} or (src, dst) pairs naming nodes (= agents when names are omitted).
      answer_from: final answer = the first of these nodes that ran (default: the last node in order).
      shaping_weights: overrides of DAG_SHAPING: own_answer_correct (a node's own answer is right; every node).
    """
    built_nodes = []
    for spec in nodes:
        extra = sorted(set(spec) - {"name", "agent", "template", "parser", "turn", "system"})
        if "agent" not in spec or extra:
            raise WorkflowError(
                f"dag node {dict(spec)} needs 'agent' and only name/template/parser/turn/system; "
                f"unknown keys: {extra}"
            )
        built_nodes.append(
            Node(
                spec.get("name", spec["agent"]),
                spec["agent"],
                spec.get("template", "{prompt}"),
                spec.get("parser", "answer"),
                spec.get("turn"),
                spec.get("system"),
            )
        )
    built_edges = []
    for spec in edges:
        if isinstance(spec, Mapping):
            built_edges.append(Edge(spec["src"], spec["dst"], spec.get("when")))
        else:
            src, dst = spec
            built_edges.append(Edge(src, dst))
    names = [node.name for node in built_nodes]
    terms = [ShapingTerm("own_answer_correct", tuple(names), shaping.own_answer_correct)]
    # Validate the graph first, so the default answer node below is the true last node in order.
    probe = Workflow("dag", built_nodes, built_edges, first_answer_of(names), max_field_chars=max_field_chars)
    answer_nodes = list(answer_from) if answer_from else [probe.order[-1]]
    unknown = [n for n in answer_nodes if n not in probe.nodes]
    if unknown:
        raise WorkflowError(
            f"dag answer_from names unknown nodes {unknown}; known nodes: {sorted(probe.nodes)}"
        )
    return Workflow(
        "dag",
        built_nodes,
        built_edges,
        first_answer_of(answer_nodes),
        shaping_terms=terms,
        reward_weights=_weights(team_weight, DAG_SHAPING, shaping_weights, "dag"),
        max_field_chars=max_field_chars,
        max_field_tokens=max_field_tokens if any("system" in spec for spec in nodes) else None,
    )


def _map_role_argument(value: Any, roles: Mapping[str, str]) -> Any:
    """A role argument with every role name replaced by the agent that plays it."""
    if isinstance(value, str):
        return roles.get(value, value)
    mapped = []
    for item in value:
        if isinstance(item, Mapping):  # a DAG node: its "agent" is a role, and names the node by default
            item = dict(item)
            if "agent" in item:
                item.setdefault("name", item["agent"])
                item["agent"] = roles.get(item["agent"], item["agent"])
            mapped.append(item)
        else:
            mapped.append(roles.get(item, item))
    return mapped


def workflow_roles(name: str, options: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The roles of workflow `name` with these options, in call order (each played by one agent)."""
    return build_workflow(name, **dict(options or {})).agents


def build_configured_workflow(
    name: str,
    *,
    options: Mapping[str, Any] | None = None,
    roles: Mapping[str, str] | None = None,
    shaping_weights: Mapping[str, float] | None = None,
) -> Workflow:
    """A registered workflow as a config describes it (`config.workflow`).

    Args:
      name: registry name (chain, debate, mixture, dag).
      options: the builder's own arguments (debate: rounds, aggregate, judge, debaters; mixture: proposers,
        aggregator; dag: nodes, edges, answer_from; ...). Role arguments hold role names.
      roles: role -> agent. Roles not listed are played by the agent of the same name; two roles mapped to
        one agent share its policy and trainer.
      shaping_weights: overrides of the workflow's default shaping weights.
    """
    options, roles = dict(options or {}), dict(roles or {})
    if "shaping_weights" in options:
        raise WorkflowError("set shaping weights in config.workflow.shaping_weights, not in workflow options")
    known_roles = workflow_roles(name, options)
    unknown = sorted(set(roles) - set(known_roles))
    if unknown:
        raise WorkflowError(
            f"workflow {name!r} has no role(s) {unknown} to map to agents; its roles: {list(known_roles)}"
        )
    for argument in ROLE_ARGUMENTS.get(name, ()):
        if argument in options:
            options[argument] = _map_role_argument(options[argument], roles)
        elif roles:
            default = inspect.signature(WORKFLOW_BUILDERS[name]).parameters[argument].default
            if default is not inspect.Parameter.empty:
                options[argument] = _map_role_argument(default, roles)
    return build_workflow(name, shaping_weights=shaping_weights or None, **options)
