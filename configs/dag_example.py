"""A custom workflow from plain data: a planner hints, two solvers answer from the hint, a checker decides.

    planner --> solver_a --> checker
        \\-----> solver_b ---/

Any DAG works the same way: `workflow.options.nodes` lists the calls (agent role, prompt template, output
parser), `edges` the dependencies (`when` makes one conditional), `answer_from` the nodes whose answer is
final (the first that ran). Builds on configs/tiny.py: every knob not set here keeps its value there.
Variants (`--config=configs/dag_example.py:VARIANT`, several joined by commas): those of configs/tiny.py.
"""

import ml_collections

from flexmarl_jax.configs import tiny

AGENTS = ("planner", "solver_a", "solver_b", "checker")


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    return tiny.apply_variants(base_config(), variant, VARIANT_CHANGES, "configs/dag_example.py")


def base_config() -> ml_collections.ConfigDict:
    config = tiny.base_config()
    config.workdir = "runs/dag_example"
    config.iterations = 100
    # The settings this team was tuned with before the default moved to the reverse task with an sft warm-up and
    # RL at 3e-4 (configs/tiny.py); not re-tuned since.
    config.workflow.task = "arithmetic"
    config.workflow.warmup = "format"
    config.train.learning_rate = 3e-3

    config.agents = ml_collections.ConfigDict()
    for name in AGENTS:
        config.agents[name] = tiny.agent_config()

    workflow = config.workflow
    workflow.name = "dag"
    workflow.options = ml_collections.ConfigDict()  # the dag builder's arguments (workflows/builtin.py)
    # One dict per call: agent (a role), and optionally name (default: the agent), template (str.format over
    # {prompt}, {inputs} and upstream node names), parser (answer | verdict) and turn (sample-id turn).
    workflow.options.nodes = (
        {"agent": "planner"},
        {"agent": "solver_a", "template": "{prompt}{planner}>"},
        {"agent": "solver_b", "template": "{prompt}{planner}<"},
        {"agent": "checker", "template": "{prompt}{inputs}?"},
    )
    # (src, dst) pairs or {"src", "dst", "when"} dicts; when: accepted | rejected | always.
    workflow.options.edges = (
        ("planner", "solver_a"), ("planner", "solver_b"), ("solver_a", "checker"), ("solver_b", "checker"))
    workflow.options.answer_from = ("checker",)  # the final answer: the first of these nodes that ran
    workflow.options.max_field_chars = 6  # upstream answers are cut to this many characters in prompts
    workflow.roles = ml_collections.ConfigDict()  # role -> agent that plays it
    for name in AGENTS:
        workflow.roles[name] = name
    workflow.shaping_weights = ml_collections.ConfigDict()
    workflow.shaping_weights.own_answer_correct = 0.5  # a node's own answer is right
    return config


VARIANT_CHANGES = dict(tiny.VARIANT_CHANGES)
VARIANTS = tuple(VARIANT_CHANGES)
