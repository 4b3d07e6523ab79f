"""The workflow section against the workflow and task registries (pure Python, no JAX).

Builds the workflow and the task once, so that their errors surface when the config is built, and checks that
the workflow's roles are played by exactly the declared agents and that the task's eval split has problems on
both sides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flexmarl_jax.config.errors import ConfigError
from flexmarl_jax.config.fields import thaw
from flexmarl_jax.config.workflow_from_config import (
    SHIPPED_CONFIGS,
    split_task_from_config,
    task_from_config,
    task_key,
    task_option_names,
    workflow_from_config,
)
from flexmarl_jax.workflows.builtin import SHAPING_DEFAULTS, workflow_options, workflow_roles
from flexmarl_jax.workflows.splits import EmptySplit
from flexmarl_jax.workflows.tasks import TASK_BUILDERS

if TYPE_CHECKING:
    from flexmarl_jax.config.schema import EvalConfig, WorkflowConfig


def check_workflow(workflow: WorkflowConfig, agents: tuple[str, ...]) -> None:
    """Raises ConfigError when `workflow`'s options, shaping weights, roles or task options do not fit its
    registry entries, or when its roles are not played by exactly `agents`."""
    start_from = (f"; a workflow's options, roles, agents and shaping weights go together: start from "
                  f"--config={SHIPPED_CONFIGS[workflow.name]}" if workflow.name in SHIPPED_CONFIGS else "")
    allowed_options, allowed_weights = workflow_options(workflow.name), sorted(SHAPING_DEFAULTS[workflow.name])
    unknown = {"options": sorted(set(workflow.options) - set(allowed_options)),
               "shaping_weights": sorted(set(workflow.shaping_weights) - set(allowed_weights))}
    foreign = [f"{section} {keys}" for section, keys in unknown.items() if keys]
    if foreign:  # typically another workflow's sections, after switching workflow.name
        raise ConfigError(f"config.workflow.name={workflow.name!r} does not take config.workflow "
                          f"{' and '.join(foreign)}; it takes options {', '.join(allowed_options)} and "
                          f"shaping weights {', '.join(allowed_weights) or '(none)'}{start_from}")
    try:
        built = workflow_from_config(workflow)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"config.workflow (name={workflow.name!r}): {error}") from None
    declared, played = set(agents), set(built.agents)
    if declared != played:
        missing, idle = sorted(played - declared), sorted(declared - played)
        problems = ([f"roles are played by undeclared agent(s) {missing}"] if missing else []) + (
            [f"agent(s) {idle} play no role"] if idle else [])
        raise ConfigError(f"config.agents={sorted(declared)} does not match workflow {workflow.name!r}: "
                          f"{' and '.join(problems)} (role -> agent: {_roles_played(workflow)}){start_from}")
    _check_task(workflow)


def _check_task(workflow: WorkflowConfig) -> None:
    for name, section in workflow.task_options.items():
        if name not in TASK_BUILDERS:
            raise ConfigError(f"config.workflow.task_options.{name}: no task {name!r}; "
                              f"tasks: {', '.join(sorted(TASK_BUILDERS))}")
        unknown = sorted(set(section) - task_option_names(name))
        if unknown:
            raise ConfigError(f"config.workflow.task_options.{name}: task {name!r} has no option(s) {unknown}; "
                              f"allowed: {', '.join(sorted(task_option_names(name)))}")
    try:
        task_from_config(workflow)
    except (ValueError, TypeError, OSError) as error:
        raise ConfigError(f"config.workflow.task={workflow.task!r} with task_options.{task_key(workflow.task)}: "
                          f"{error}") from None


def check_eval_split(eval_config: EvalConfig, workflow: WorkflowConfig) -> None:
    """Raises ConfigError naming the eval field when the held-out split would leave either side empty, or when
    `eval.file` is set for a task that is not a .jsonl file (generated tasks hold out `eval.fraction`)."""
    if not eval_config.enabled:
        return
    if eval_config.file and not workflow.task.endswith(".jsonl"):
        raise ConfigError(f"config.eval.file={eval_config.file!r} takes the eval problems of a .jsonl task, but "
                          f"config.workflow.task={workflow.task!r} generates its problems: it holds out "
                          "eval.fraction of them (set eval.file='')")
    field = (f"config.eval.file={eval_config.file!r}" if eval_config.file
             else f"config.eval.fraction={eval_config.fraction}")
    try:
        split_task_from_config(workflow, eval_config)
    except EmptySplit as error:
        remedy = ("an eval file that is not a copy of the training file" if eval_config.file else
                  {"eval": "raise eval.fraction", "train": "lower eval.fraction"}[error.side])
        raise ConfigError(f"{field} leaves the {error.side} split empty: {error} ({remedy})") from None
    except (ValueError, OSError) as error:  # an eval file that is missing or has a bad line
        raise ConfigError(f"{field}: {error}") from None


def _roles_played(workflow: WorkflowConfig) -> str:
    """"role->agent, ..." for every role of the configured workflow, in call order."""
    return ", ".join(f"{role}->{workflow.roles.get(role, role)}"
                     for role in workflow_roles(workflow.name, thaw(workflow.options)))
