"""Checks a loaded config against the schema; every failure is one line naming field, value and rule.

The schema is the set of fields of `configs/tiny.py`; a user config may rename and add agents but every
agent has the same fields. Called at load time, before any JAX work, so a bad value never surfaces as a
traceback from deep inside a jit.
"""

from __future__ import annotations

import os

import ml_collections

from flexmarl_jax.config.errors import ConfigError

PIPELINE_MODES = ("serial", "sync", "flexmarl")
# The algorithm names registered in flexmarl_jax.train; kept here so validation stays JAX-free.
ALGORITHMS = ("grpo", "drgrpo", "dapo", "ppo")
STORE_BACKENDS = ("memory", "file")

SECTION_FIELDS = {
    "": {"seed": int, "workdir": str, "iterations": int, "agents": dict, "workflow": dict, "rollout": dict,
         "train": dict, "mesh": dict, "store": dict, "pipeline": dict},
    "agents.*": {"model": str, "temperature": float, "top_k": int, "top_p": float, "learning_rate": float},
    "workflow": {"name": str, "options": dict, "roles": dict, "task": str, "task_options": dict,
                 "shaping_weights": dict, "queries_per_iteration": int,
                 "samples_per_query": int, "warmup_steps": int},
    "rollout": {"instances_per_agent": int, "decode_slots": int, "max_prompt_length": int,
                "max_response_length": int, "min_instances_per_agent": int, "request_timeout_s": float,
                "max_retries": int},
    "train": {"algorithm": str, "learning_rate": float, "global_batch_size": int, "micro_batch_size": int,
              "max_staleness": int},
    "mesh": {"fake_cpu_devices": int, "rollout_devices_per_instance": int, "train_devices_per_agent": int,
             "tp": int, "train_slices": int},
    "store": {"backend": str, "path": str},
    "pipeline": {"mode": str, "async_micro_batches": bool, "balancing": bool, "debug_invariants": bool,
                 "balance_delta": int, "balance_cooldown_s": float, "balance_poll_s": float},
}

POSITIVE_FIELDS = (
    "iterations", "workflow.queries_per_iteration", "workflow.samples_per_query", "rollout.instances_per_agent",
    "rollout.decode_slots", "rollout.max_prompt_length", "rollout.max_response_length",
    "train.global_batch_size", "train.micro_batch_size", "mesh.fake_cpu_devices",
    "mesh.rollout_devices_per_instance", "mesh.train_devices_per_agent", "mesh.tp",
    "rollout.min_instances_per_agent", "pipeline.balance_delta",
)


def _get(config: ml_collections.ConfigDict, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def _check_fields(node, section: str, expected: dict[str, type]) -> None:
    prefix = f"{section}." if section else ""
    for key in node.keys():
        if key not in expected:
            raise ConfigError(f"unknown config key {prefix + key!r}; allowed in "
                              f"{section or 'config'}: {', '.join(sorted(expected))}")
    for key, kind in expected.items():
        if key not in node:
            raise ConfigError(f"missing config key {prefix + key!r}")
        value = node[key]
        if kind is dict:
            if not isinstance(value, ml_collections.ConfigDict):
                raise ConfigError(f"config.{prefix + key} must be a section (ConfigDict), got {value!r}")
            continue
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ConfigError(f"config.{prefix + key}={value!r} has type {type(value).__name__}; "
                              f"expected {kind.__name__}")


def _check_choice(config, dotted: str, allowed) -> None:
    value = _get(config, dotted)
    if value not in allowed:
        raise ConfigError(f"config.{dotted}={value!r} is not allowed; choose one of: {', '.join(allowed)}")


def devices_needed(config: ml_collections.ConfigDict) -> int:
    """Devices the run binds: every agent's rollout instances plus its training mesh (or the S shared
    training slices when mesh.train_slices = S > 0)."""
    rollout = config.rollout.instances_per_agent * config.mesh.rollout_devices_per_instance
    slices = config.mesh.train_slices or len(config.agents)
    return len(config.agents) * rollout + slices * config.mesh.train_devices_per_agent


def _check_model(name: str, field: str) -> None:
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ConfigError(f"config.{field}={name!r} is a directory without config.json")
        return
    try:
        from flexmarl_jax.models import presets
    except ImportError:  # the model package is optional for config-only use
        return
    if name not in presets.PRESETS:
        raise ConfigError(f"config.{field}={name!r} is neither a model preset nor a checkpoint directory; "
                          f"presets: {', '.join(sorted(presets.PRESETS))}")


def _check_workflow(config: ml_collections.ConfigDict) -> None:
    """Builds the workflow and task once (pure Python, no JAX) so their errors surface at load time, and
    checks that the workflow's roles are played by exactly the agents of `config.agents`."""
    from flexmarl_jax.workflows.builtin import SHAPING_DEFAULTS, workflow_options
    from flexmarl_jax.workflows.from_config import (
        SHIPPED_CONFIGS,
        task_from_config,
        task_key,
        task_option_names,
        workflow_from_config,
    )
    from flexmarl_jax.workflows.tasks import TASK_BUILDERS

    workflow = config.workflow
    start_from = (f"; a workflow's options, roles, agents and shaping weights go together: start from "
                  f"--config={SHIPPED_CONFIGS[workflow.name]}" if workflow.name in SHIPPED_CONFIGS else "")
    allowed_options, allowed_weights = workflow_options(workflow.name), sorted(SHAPING_DEFAULTS[workflow.name])
    foreign = [f"options {sorted(set(workflow.options.keys()) - set(allowed_options))}",
               f"shaping_weights {sorted(set(workflow.shaping_weights.keys()) - set(allowed_weights))}"]
    foreign = [part for part in foreign if not part.endswith("[]")]
    if foreign:  # typically another workflow's sections, after switching workflow.name
        raise ConfigError(f"config.workflow.name={workflow.name!r} does not take config.workflow "
                          f"{' and '.join(foreign)}; it takes options {', '.join(allowed_options)} and "
                          f"shaping weights {', '.join(allowed_weights) or '(none)'}{start_from}")
    for role, agent in workflow.roles.items():
        if not isinstance(agent, str):
            raise ConfigError(f"config.workflow.roles.{role}={agent!r} must be an agent name (str)")
    try:
        built = workflow_from_config(workflow)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"config.workflow (name={workflow.name!r}): {error}") from None
    declared, played = set(config.agents.keys()), set(built.agents)
    if declared != played:
        missing, idle = sorted(played - declared), sorted(declared - played)
        problems = ([f"roles are played by undeclared agent(s) {missing}"] if missing else []) + (
            [f"agent(s) {idle} play no role"] if idle else [])
        raise ConfigError(f"config.agents={sorted(declared)} does not match workflow {workflow.name!r}: "
                          f"{' and '.join(problems)} (role -> agent: {_roles_played(workflow)}){start_from}")

    for name in workflow.task_options.keys():
        section = workflow.task_options[name]
        if name == "jsonl":
            from flexmarl_jax.workflows import dataset  # noqa: F401  (registers "jsonl")
        if name not in TASK_BUILDERS:
            raise ConfigError(f"config.workflow.task_options.{name}: no task {name!r}; "
                              f"tasks: {', '.join(sorted(set(TASK_BUILDERS) | {'jsonl'}))}")
        if not isinstance(section, ml_collections.ConfigDict):
            raise ConfigError(f"config.workflow.task_options.{name} must be a section of task {name!r}'s options")
        unknown = sorted(set(section.keys()) - task_option_names(name))
        if unknown:
            raise ConfigError(f"config.workflow.task_options.{name}: task {name!r} has no option(s) {unknown}; "
                              f"allowed: {', '.join(sorted(task_option_names(name)))}")
    try:
        task_from_config(workflow)
    except (ValueError, TypeError, OSError) as error:
        raise ConfigError(f"config.workflow.task={workflow.task!r} with task_options.{task_key(workflow.task)}: "
                          f"{error}") from None


def _roles_played(workflow: ml_collections.ConfigDict) -> str:
    """"role->agent, ..." for every role of the configured workflow, in call order."""
    from flexmarl_jax.workflows.builtin import workflow_roles

    roles = workflow.roles.to_dict()
    return ", ".join(f"{role}->{roles.get(role, role)}"
                     for role in workflow_roles(workflow.name, workflow.options.to_dict()))


def validate_config(config: ml_collections.ConfigDict, *, available_devices: int | None = None) -> None:
    """Raises ConfigError on the first problem found; `available_devices` enables the mesh-size check."""
    _check_fields(config, "", SECTION_FIELDS[""])
    for section, fields in SECTION_FIELDS.items():
        if section in ("", "agents.*"):
            continue
        _check_fields(config[section], section, fields)
    if len(config.agents) == 0:
        raise ConfigError("config.agents is empty; declare at least one agent")
    for name in config.agents.keys():
        _check_fields(config.agents[name], f"agents.{name}", SECTION_FIELDS["agents.*"])
        agent = config.agents[name]
        if not agent.temperature > 0:
            raise ConfigError(f"config.agents.{name}.temperature={agent.temperature} must be > 0")
        if agent.top_k < 0:
            raise ConfigError(f"config.agents.{name}.top_k={agent.top_k} must be >= 0 (0 disables top-k)")
        if not 0 < agent.top_p <= 1:
            raise ConfigError(f"config.agents.{name}.top_p={agent.top_p} must be in (0, 1]")
        if agent.learning_rate != -1.0 and not agent.learning_rate > 0:
            raise ConfigError(f"config.agents.{name}.learning_rate={agent.learning_rate} must be > 0 "
                              "or -1 (use train.learning_rate)")
        _check_model(agent.model, f"agents.{name}.model")

    for dotted in POSITIVE_FIELDS:
        value = _get(config, dotted)
        if value <= 0:
            raise ConfigError(f"config.{dotted}={value} must be a positive integer")
    if config.rollout.min_instances_per_agent > config.rollout.instances_per_agent:
        raise ConfigError(f"config.rollout.min_instances_per_agent={config.rollout.min_instances_per_agent} "
                          f"exceeds rollout.instances_per_agent={config.rollout.instances_per_agent}: an agent "
                          "cannot keep more instances than it starts with")
    for dotted in ("rollout.request_timeout_s", "rollout.max_retries", "pipeline.balance_cooldown_s"):
        if _get(config, dotted) < 0:
            raise ConfigError(f"config.{dotted}={_get(config, dotted)} must be >= 0")
    if not config.pipeline.balance_poll_s > 0:
        raise ConfigError(f"config.pipeline.balance_poll_s={config.pipeline.balance_poll_s} must be > 0")
    if config.train.max_staleness < 0:
        raise ConfigError(f"config.train.max_staleness={config.train.max_staleness} must be >= 0")
    if config.workflow.warmup_steps < 0:
        raise ConfigError(f"config.workflow.warmup_steps={config.workflow.warmup_steps} must be >= 0")
    if not config.train.learning_rate > 0:
        raise ConfigError(f"config.train.learning_rate={config.train.learning_rate} must be > 0")
    _check_choice(config, "pipeline.mode", PIPELINE_MODES)
    _check_choice(config, "train.algorithm", ALGORITHMS)
    from flexmarl_jax.workflows.builtin import WORKFLOW_BUILDERS

    _check_choice(config, "workflow.name", sorted(WORKFLOW_BUILDERS))
    _check_choice(config, "store.backend", STORE_BACKENDS)

    _check_workflow(config)
    train, workflow = config.train, config.workflow
    samples = workflow.queries_per_iteration * workflow.samples_per_query
    if train.global_batch_size != samples:
        raise ConfigError(f"config.train.global_batch_size={train.global_batch_size} must equal "
                          f"workflow.queries_per_iteration x workflow.samples_per_query = {samples}")
    if train.global_batch_size % train.micro_batch_size:
        raise ConfigError(f"config.train.micro_batch_size={train.micro_batch_size} must divide "
                          f"train.global_batch_size={train.global_batch_size}")
    if train.micro_batch_size % workflow.samples_per_query:
        raise ConfigError(f"config.train.micro_batch_size={train.micro_batch_size} must be a multiple of the "
                          f"GRPO group size workflow.samples_per_query={workflow.samples_per_query}")
    if config.mesh.train_devices_per_agent % config.mesh.tp:
        raise ConfigError(f"config.mesh.tp={config.mesh.tp} must divide "
                          f"mesh.train_devices_per_agent={config.mesh.train_devices_per_agent}")
    if not 0 <= config.mesh.train_slices <= len(config.agents):
        raise ConfigError(f"config.mesh.train_slices={config.mesh.train_slices} must be in 0..{len(config.agents)} "
                          "(the number of agents; 0 = a dedicated training slice per agent)")
    if available_devices is not None:
        check_devices(config, available_devices)


def check_devices(config: ml_collections.ConfigDict, available_devices: int) -> None:
    """Raises ConfigError when the config's meshes need more devices than exist."""
    needed = devices_needed(config)
    if needed <= available_devices:
        return
    agents, mesh = len(config.agents), config.mesh
    instances = f"{config.rollout.instances_per_agent} instances x {mesh.rollout_devices_per_instance}"
    if mesh.train_slices:
        breakdown = (f"{agents} agents x {instances} + mesh.train_slices={mesh.train_slices} x "
                     f"mesh.train_devices_per_agent={mesh.train_devices_per_agent}")
    else:
        breakdown = f"{agents} agents x ({instances} + mesh.train_devices_per_agent={mesh.train_devices_per_agent})"
    raise ConfigError(f"config.mesh needs {needed} devices ({breakdown}) but {available_devices} exist")
