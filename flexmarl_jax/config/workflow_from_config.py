"""The workflow and task a config describes (`config.workflow`, a `WorkflowConfig`), built from its values.

Pure Python (no JAX), so config validation can build both once and report their errors before any work.

- `config.workflow.options`: the workflow builder's own arguments (see `builtin.py`); arguments that name
  agents hold role names. `chat` (chain, debate, mixture) selects natural-language chat prompts; it defaults
  to True when every agent runs a chat checkpoint.
- `config.workflow.roles`: role -> agent. A role not listed is played by the agent of its name; two roles
  played by one agent share that agent's policy, trainer and rollout instances.
- `config.workflow.task_options.<task>`: keyword arguments of each task's constructor; only the section of
  the selected task is read (`jsonl` for a `.jsonl` path), so switching `workflow.task` on the command line
  uses that task's own options or defaults.
- `config.eval` (enabled, fraction, file): the task's held-out split (`splits.TrainEvalSplit`); a run draws its
  training and warm-up problems from `split_task_from_config`, never from the bare task.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING

from flexmarl_jax.config.fields import thaw
from flexmarl_jax.workflows.builtin import WORKFLOW_BUILDERS, build_configured_workflow
from flexmarl_jax.workflows.graph import Workflow
from flexmarl_jax.workflows.splits import TrainEvalSplit
from flexmarl_jax.workflows.tasks import TASK_BUILDERS, Task, resolve_task

if TYPE_CHECKING:
    from flexmarl_jax.config.schema import EvalConfig, WorkflowConfig

# The config file each built-in workflow ships with: where to start when switching workflows.
SHIPPED_CONFIGS = {
    "chain": "configs/tiny.py",
    "debate": "configs/debate.py",
    "mixture": "configs/mixture.py",
    "dag": "configs/dag_example.py",
}


def workflow_from_config(workflow_config: WorkflowConfig, *, chat_models: bool = False) -> Workflow:
    """The workflow `config.workflow` describes (name, options, roles, shaping_weights).

    chat_models: every agent runs a chat checkpoint; then a workflow with chat prompts uses them unless
        `workflow.options.chat` says otherwise.
    """
    options = thaw(workflow_config.options)
    if chat_models and "chat" in inspect.signature(WORKFLOW_BUILDERS[workflow_config.name]).parameters:
        options.setdefault("chat", True)
    return build_configured_workflow(
        workflow_config.name,
        options=options,
        roles=thaw(workflow_config.roles),
        shaping_weights=thaw(workflow_config.shaping_weights),
    )


def task_key(task: str) -> str:
    """The registry name whose `task_options` section a `workflow.task` value reads."""
    return "jsonl" if task.endswith(".jsonl") else task


def task_option_names(name: str) -> set[str]:
    """The keyword arguments task `name`'s constructor takes (for checking config sections)."""
    builder = TASK_BUILDERS[name]
    if dataclasses.is_dataclass(builder):
        return {field.name for field in dataclasses.fields(builder)}
    return set(inspect.signature(builder).parameters) - {"path"}


def task_from_config(workflow_config: WorkflowConfig) -> Task:
    """The task `config.workflow.task` names, with its own section of `config.workflow.task_options`."""
    options = workflow_config.task_options.get(task_key(workflow_config.task), {})
    return resolve_task(workflow_config.task, **thaw(options))


def split_task_from_config(workflow_config: WorkflowConfig, eval_config: EvalConfig, task: Task | None = None) -> Task:
    """The task a run trains on: with `eval.enabled`, a `TrainEvalSplit` of it (`eval.file` for a .jsonl task,
    else `eval.fraction` of its problem contents held out); otherwise the bare task (`task`, if already built).
    Raises `splits.EmptySplit` (a ValueError) when a side would be empty."""
    task = task_from_config(workflow_config) if task is None else task
    if not eval_config.enabled:
        return task
    return TrainEvalSplit(task, eval_fraction=eval_config.fraction, eval_file=eval_config.file or None)


def team_agents(workflow_config: WorkflowConfig) -> tuple[str, ...]:
    """The agents a config's workflow calls, in first-call order (the order trainers are seeded in)."""
    return workflow_from_config(workflow_config).agents
