"""What a run checks before it writes or allocates anything: its models, its prompts and whether the team fits
in memory (config/memory.py estimates each agent's peak from shapes).

    checked = preflight(config)        # one-line ConfigError naming the field or file on any problem
    build_orchestrator(config, checked=checked)

The agents' model sources are read here (config, tokenizer and weight files of each checkpoint, not the
weights), the workflow is built with chat prompts when every agent runs a chat checkpoint, and every first-turn
prompt the task can produce is rendered with its agent's chat template and tokenised: a prompt longer than
`rollout.max_prompt_length` fails here, naming the problem, instead of in the middle of a run. (Later turns
quote earlier responses; one that outgrows the limit fails only that call: executor.PromptTooLong.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from flexmarl_jax.config import ConfigError, RunConfig
from flexmarl_jax.config.memory import check_team_fits
from flexmarl_jax.config.workflow_from_config import (
    split_task_from_config,
    task_from_config,
    team_agents,
    workflow_from_config,
)
from flexmarl_jax.emulation.spec import parse_emulate
from flexmarl_jax.models.sources import ModelSource, resolve_model
from flexmarl_jax.rollout.backend import encode_prompt
from flexmarl_jax.workflows import Task, Workflow
from flexmarl_jax.workflows.splits import EVAL_PROBLEMS_SEED, TrainEvalSplit

# Generated tasks make problems on the fly; this many of them stand for the rest in the prompt check. A file's
# problems are all checked.
GENERATED_PROBLEMS_CHECKED = 512


@dataclasses.dataclass(frozen=True)
class Preflight:
    """What the checks built, for the run to reuse: each agent's model source, the workflow and the task (with
    `eval.enabled`, its `TrainEvalSplit`: `generate` draws training problems, `eval_problems` the eval list)."""

    sources: dict[str, ModelSource]
    workflow: Workflow
    task: Task


def preflight(config: RunConfig) -> Preflight:
    """Reads every agent's model, builds the workflow and task, and checks prompts and warm-up against them."""
    sources = read_model_sources(config)
    chat = all(source.is_chat for source in sources.values())
    workflow = workflow_from_config(config.workflow, chat_models=chat)
    try:
        task = task_from_config(config.workflow)
    except (ValueError, OSError) as error:  # a data file that is missing or has a bad line
        raise ConfigError(f"config.workflow.task={config.workflow.task!r}: {error}") from None
    # Training and warm-up draw from the split's train side only (RunConfig's check made sure both sides exist).
    task = split_task_from_config(config.workflow, config.eval, task)
    if workflow.chat and config.workflow.warmup_steps > 0:
        raise ConfigError(f"config.workflow.warmup_steps={config.workflow.warmup_steps}: the warm-up teaches "
                          "character-level presets an answer format; chat prompts go to chat checkpoints, which "
                          "have one (set workflow.warmup_steps=0)")
    if config.pipeline.emulate:
        # Emulated devices run no model: the emulated model's context is the limit, and nothing is allocated.
        check_emulated_context_length(config)
        check_first_turn_prompts(config, workflow, task, sources)
        return Preflight(sources, workflow, task)
    check_context_length(config, sources)
    check_first_turn_prompts(config, workflow, task, sources)
    check_team_fits(config, {agent: source.model_config for agent, source in sources.items()})
    return Preflight(sources, workflow, task)


def read_model_sources(config: RunConfig) -> dict[str, ModelSource]:
    """agent -> its model source; a checkpoint that cannot be used is a ConfigError naming the agent's field."""
    sources = {}
    for agent in team_agents(config.workflow):
        try:
            sources[agent] = resolve_model(config.agents[agent].model)
        except (ValueError, OSError) as error:
            raise ConfigError(f"config.agents.{agent}.model={config.agents[agent].model!r}: {error}") from None
    return sources


def check_context_length(config: RunConfig, sources: Mapping[str, ModelSource]) -> None:
    """A prompt plus its response must fit each model's positions (`max_position_embeddings`)."""
    needed = config.rollout.max_prompt_length + config.rollout.max_response_length
    for agent, source in sources.items():
        limit = source.model_config.max_position_embeddings
        if needed > limit:
            raise ConfigError(f"config.rollout.max_prompt_length + max_response_length = {needed} tokens exceeds "
                              f"agent {agent!r}'s model context of {limit} (max_position_embeddings of {source.name})")


def check_emulated_context_length(config: RunConfig) -> None:
    """A prompt plus its response must fit the emulated model's positions (`pipeline.emulate`'s MODEL)."""
    needed = config.rollout.max_prompt_length + config.rollout.max_response_length
    device = parse_emulate(config.pipeline.emulate)
    if needed > device.model.max_position_embeddings:
        raise ConfigError(f"config.rollout.max_prompt_length + max_response_length = {needed} tokens exceeds the "
                          f"emulated model's context of {device.model.max_position_embeddings} "
                          f"(pipeline.emulate={config.pipeline.emulate!r})")


def check_first_turn_prompts(config: RunConfig, workflow: Workflow, task: Task,
                             sources: Mapping[str, ModelSource]) -> None:
    """Renders every root node's prompt for the task's problems (every line of a file, and every eval problem)
    with the node's agent's tokenizer; the first one longer than `rollout.max_prompt_length` is a ConfigError
    naming it."""
    problems = first_turn_problems(config, task)
    limit = config.rollout.max_prompt_length
    for node in workflow.roots():
        agent = workflow.nodes[node].agent
        tokenizer = sources[agent].tokenizer
        for problem in problems:
            length = len(encode_prompt(tokenizer, workflow.render_prompt(node, problem.prompt, {})))
            if length > limit:
                how = "the chat template" if workflow.nodes[node].system else "tokenising"
                raise ConfigError(f"config.rollout.max_prompt_length={limit} is too short: the first-turn prompt "
                                  f"of node {node!r} (agent {agent!r}) for {_where(problem, task)} has {length} "
                                  f"tokens after {how}")


def first_turn_problems(config: RunConfig, task: Task) -> list:
    """The problems whose prompts the run may send: every line of a file (GENERATED_PROBLEMS_CHECKED draws of a
    generated task) and, with a held-out split, the eval problems."""
    split = task if isinstance(task, TrainEvalSplit) else None
    source = split.task if split is not None else task
    records = getattr(source, "records", None)
    problems = source.generate(len(records) if records is not None else GENERATED_PROBLEMS_CHECKED, seed=config.seed)
    if split is not None:
        problems += split.eval_problems(config.eval.problems, seed=EVAL_PROBLEMS_SEED)
    return problems


def _where(problem, task: Task) -> str:
    """"line 3 of data.jsonl" for a file's problem, else its input id."""
    if "line" not in problem.meta:
        return problem.input_id
    path = problem.meta.get("file") or getattr(getattr(task, "task", task), "path", "the task file")
    return f"line {problem.meta['line']} of {path}"
