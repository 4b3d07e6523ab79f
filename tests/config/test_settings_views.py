"""The settings views of a `RunConfig` have no defaults of their own: each is built from `RunConfig()` alone by its
builder, its fields are the config's values, and a rule both check is one rule (docs/architecture.md, "One place
for each setting"). The same holds for the components built from the config's values directly: the router,
health monitor and balancer, the emulation's cost models, timescale and engine, and an agent's LoraSpec."""

import dataclasses
import inspect
import re
import types

import pytest

from flexmarl_jax.config import ConfigError, RunConfig
from flexmarl_jax.emulation import rules as emulation_rules
from flexmarl_jax.emulation.chips import get_chip
from flexmarl_jax.emulation.cost_model import CostModel
from flexmarl_jax.emulation.engine import EmulatedEngine
from flexmarl_jax.emulation.timescale import TimeScale
from flexmarl_jax.models import lora_rules, lora_targets
from flexmarl_jax.models.lora import LoraSpec
from flexmarl_jax.models.presets import get_preset
from flexmarl_jax.models.tokenizer import CharTokenizer
from flexmarl_jax.orchestrator.emulated_setup import Emulation, script_for
from flexmarl_jax.orchestrator.pipeline import PipelineSettings
from flexmarl_jax.rollout import routing_rules
from flexmarl_jax.rollout.balancer import InstanceBalancer
from flexmarl_jax.rollout.health import InstanceHealthMonitor
from flexmarl_jax.rollout.router import RequestRouter
from flexmarl_jax.rollout.routing_settings import balancer_settings_for, health_settings_for, router_settings_for
from flexmarl_jax.rollout.settings import EngineConfig, default_prefill_buckets, engine_config_for
from flexmarl_jax.train.algorithms import loss_config_for
from flexmarl_jax.train.from_config import trainer_config_for
from flexmarl_jax.train.losses import LossConfig
from flexmarl_jax.train.optim import OptimizerConfig
from flexmarl_jax.train.trainer_config import TrainerConfig

VIEWS = (TrainerConfig, LossConfig, OptimizerConfig, EngineConfig, PipelineSettings)


@pytest.mark.parametrize("view", VIEWS, ids=lambda view: view.__name__)
def test_a_view_has_no_defaults_of_its_own(view):
    defaulted = [field.name for field in dataclasses.fields(view)
                 if field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING]
    assert defaulted == []
    with pytest.raises(TypeError, match="missing"):
        view()


def test_the_trainer_view_holds_the_run_configs_values():
    config = RunConfig()
    view, agent = trainer_config_for(config, "solver"), config.agents["solver"]
    assert view.micro_batch_size == config.train.micro_batch_size
    assert view.max_len == config.rollout.max_prompt_length + config.rollout.max_response_length - 1
    assert view.rows_per_pass == config.train.rows_per_pass and view.remat == config.train.remat
    assert agent.learning_rate == -1 and view.optimizer.learning_rate == config.train.learning_rate
    assert view.loss == loss_config_for(config.train.algorithm)
    assert config.train.max_staleness == 0 and view.loss.tis_cap is None  # on-policy: no truncated IS
    assert (view.dtype, view.fp32_master_weights) == (agent.dtype, agent.fp32_master_weights)
    assert (view.sampling_temperature, view.sampling_top_k, view.sampling_top_p) == (
        agent.temperature, agent.top_k, agent.top_p)


def test_the_engine_view_holds_the_run_configs_values():
    config = RunConfig()
    view = engine_config_for(config, "solver")
    assert config.agents["solver"].decode_slots == 0 and view.max_concurrent_decodes == config.rollout.decode_slots
    assert view.max_prefill_length == config.rollout.max_prompt_length
    assert view.max_decode_length == config.rollout.max_response_length
    assert view.prefill_buckets == default_prefill_buckets(config.rollout.max_prompt_length)
    assert not view.truncate_long_prompts and view.prefill_batch_sizes == (1,)


def test_the_pipeline_view_holds_the_run_configs_values():
    config = RunConfig()
    view = PipelineSettings.from_config(config, process_count=1)
    assert (view.mode, view.async_micro_batches, view.debug_invariants, view.deterministic) == (
        config.pipeline.mode, config.pipeline.async_micro_batches, config.pipeline.debug_invariants,
        config.pipeline.deterministic)
    assert (view.queries_per_iteration, view.samples_per_query) == (
        config.workflow.queries_per_iteration, config.workflow.samples_per_query)
    assert (view.micro_batch_size, view.max_staleness) == (config.train.micro_batch_size, config.train.max_staleness)
    assert (view.max_response_length, view.seed, view.stall_timeout_s) == (
        config.rollout.max_response_length, config.seed, config.run.stall_timeout_s)


def test_a_changed_field_reaches_its_view():
    default = RunConfig()
    solver = dataclasses.replace(default.agents["solver"], decode_slots=4, learning_rate=1e-2, top_p=0.9)
    config = dataclasses.replace(
        default, agents={**default.agents, "solver": solver},
        train=dataclasses.replace(default.train, algorithm="dapo", micro_batch_size=16, rows_per_pass=4),
        rollout=dataclasses.replace(default.rollout, max_prompt_length=64, max_response_length=16))
    trainer, engine = trainer_config_for(config, "solver"), engine_config_for(config, "solver")
    assert (trainer.micro_batch_size, trainer.rows_per_pass, trainer.max_len) == (16, 4, 64 + 16 - 1)
    assert (trainer.optimizer.learning_rate, trainer.sampling_top_p) == (1e-2, 0.9)
    assert trainer.loss == loss_config_for("dapo")
    assert (engine.max_concurrent_decodes, engine.max_prefill_length, engine.max_decode_length) == (4, 64, 16)
    assert engine.prefill_buckets == (16, 32, 64)


@pytest.mark.parametrize("section,field,value,view_field,problem", [
    ("train", "rows_per_pass", 3, "rows_per_pass", "rows_per_pass=3 must divide"),
    ("agent", "top_p", 1.5, "sampling_top_p", "must be in (0, 1]"),
    ("agent", "top_k", -1, "sampling_top_k", "must be >= 0 (0 disables top-k)"),
    ("agent", "temperature", 0.0, "sampling_temperature", "must be > 0"),
])
def test_the_config_and_the_trainer_view_check_one_rule(section, field, value, view_field, problem):
    """A value the config rejects, the view built directly rejects with the same words."""
    config = RunConfig()
    with pytest.raises(ConfigError, match=re.escape(problem)):
        if section == "train":
            dataclasses.replace(config, train=dataclasses.replace(config.train, **{field: value}))
        else:
            agent = dataclasses.replace(config.agents["solver"], **{field: value})
            dataclasses.replace(config, agents={**config.agents, "solver": agent})
    with pytest.raises(ValueError, match=re.escape(problem)):
        dataclasses.replace(trainer_config_for(config, "solver"), **{view_field: value})


def test_the_config_and_the_loss_view_check_one_tis_cap_rule():
    config = RunConfig()
    with pytest.raises(ConfigError, match="tis_cap=0.5 must be >= 1"):
        dataclasses.replace(config, train=dataclasses.replace(config.train, tis_cap=0.5))
    with pytest.raises(ValueError, match="tis_cap=0.5 must be >= 1"):
        loss_config_for(config.train.algorithm, tis_cap=0.5)


# ------------------------------------------------------------------------------------ components built directly

# component -> the settings it takes from the config, none of which it may default
CONFIG_SETTINGS = {
    RequestRouter: ("timeout_s", "max_retries"),
    InstanceBalancer: ("delta", "cooldown_s", "poll_interval_s", "min_instances_per_agent"),
    InstanceHealthMonitor: ("stall_s",),
    CostModel: ("mfu",),
    TimeScale: ("compression",),
    EmulatedEngine: ("tokens_per_call", "timescale"),
    LoraSpec: ("rank", "alpha", "targets"),
}


@pytest.mark.parametrize("component", CONFIG_SETTINGS, ids=lambda component: component.__name__)
def test_a_component_has_no_defaults_for_the_configs_settings(component):
    parameters = inspect.signature(component).parameters
    assert [name for name in CONFIG_SETTINGS[component] if name not in parameters] == []
    assert [name for name in CONFIG_SETTINGS[component]
            if parameters[name].default is not inspect.Parameter.empty] == []


def _instances(*counts: int) -> dict[str, list]:
    """What a router needs of its instances (name, capacity, architecture): `counts[k]` for agent k."""
    return {f"agent{k}": [types.SimpleNamespace(name=f"agent{k}/{n}", capacity=1, architecture="tiny")
                          for n in range(count)] for k, count in enumerate(counts)}


def test_the_router_monitor_and_balancer_built_from_the_run_config_hold_its_values():
    config = RunConfig()
    router = RequestRouter(_instances(1, 1, 1), **router_settings_for(config))
    assert config.rollout.request_timeout_s == 0 and router.timeout_s is None  # 0 = no timeout
    assert router.max_retries == config.rollout.max_retries
    monitor = InstanceHealthMonitor(router, **health_settings_for(config))
    assert (monitor.stall_s, monitor.first_step_s) == (config.rollout.instance_stall_s, config.run.stall_timeout_s)
    balancer = InstanceBalancer(router, **balancer_settings_for(config))
    assert (balancer.delta, balancer.cooldown_s, balancer.poll_interval_s, balancer.min_instances) == (
        config.pipeline.balance_delta, config.pipeline.balance_cooldown_s, config.pipeline.balance_poll_s,
        config.rollout.min_instances_per_agent)


def _emulated(config: RunConfig) -> RunConfig:
    return dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline, emulate="v5p:tiny"))


def test_the_emulation_built_from_the_run_config_holds_its_values():
    config = _emulated(RunConfig())
    emulation, pipeline = Emulation.from_config(config), config.pipeline
    assert emulation.timescale == TimeScale(pipeline.emulate_compression)
    assert emulation.rollout.mfu == emulation.train.mfu == pipeline.emulate_mfu
    assert (emulation.rollout.chips, emulation.train.chips) == (
        config.mesh.rollout_devices_per_instance, config.mesh.train_devices_per_agent)
    engine = emulation.engine(engine_config_for(config, "solver"), CharTokenizer(), script_for(config, CharTokenizer()))
    assert engine.tokens_per_call == pipeline.emulate_tokens_per_call == 64
    assert engine.device.timescale is emulation.timescale and engine.cost_model is emulation.rollout


def test_an_emulated_runs_balancer_waits_its_cooldown_and_polls_in_device_time():
    config = _emulated(RunConfig())
    config = dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline, emulate_compression=8.0))
    compression = config.pipeline.emulate_compression
    balancer = InstanceBalancer(RequestRouter(_instances(1, 1, 1), **router_settings_for(config)),
                                **balancer_settings_for(config))
    assert balancer.cooldown_s == pytest.approx(config.pipeline.balance_cooldown_s / compression)
    assert balancer.poll_interval_s == pytest.approx(config.pipeline.balance_poll_s / compression)
    assert balancer.delta == config.pipeline.balance_delta  # a count of requests: no time to scale


def test_the_lora_spec_built_from_the_run_config_holds_its_values():
    config = RunConfig()
    settings = config.agents["solver"].lora
    spec = trainer_config_for(config, "solver").lora
    assert spec == LoraSpec(settings.rank, settings.alpha, settings.target_names)
    assert (spec.rank, spec.alpha, spec.targets) == (0, 16.0, settings.target_names)


def _config_with(path: str, value) -> RunConfig:
    """`RunConfig()` with the field at `path` ("pipeline.emulate_mfu", "agents.solver.lora.rank") set."""
    def replaced(section, names):
        if len(names) == 1:
            return dataclasses.replace(section, **{names[0]: value})
        if isinstance(section, RunConfig) and names[0] == "agents":
            return dataclasses.replace(section, agents={**section.agents,
                                                        names[1]: replaced(section.agents[names[1]], names[2:])})
        return dataclasses.replace(section, **{names[0]: replaced(getattr(section, names[0]), names[1:])})

    return replaced(RunConfig(), path.split("."))


def _router(**settings):
    return RequestRouter(_instances(1, 1, 1), **{**router_settings_for(RunConfig()), **settings})


def _balancer(*counts: int, **settings):
    router = RequestRouter(_instances(*counts), **router_settings_for(RunConfig()))
    return InstanceBalancer(router, **{**balancer_settings_for(RunConfig()), **settings})


def _emulated_engine(**settings):
    config = _emulated(RunConfig())
    emulation = Emulation.from_config(config)
    settings = {"tokens_per_call": emulation.tokens_per_call, "timescale": emulation.timescale, **settings}
    return EmulatedEngine(emulation.rollout, engine_config_for(config, "solver"), CharTokenizer(),
                          script_for(config, CharTokenizer()), **settings)


ONE_RULE = [  # (the config's field, a value it rejects, the one rule, the component built directly with that value)
    ("pipeline.emulate_mfu", 1.5, emulation_rules.mfu_problem,
     lambda mfu: CostModel(get_preset("tiny"), get_chip("v5p"), mfu=mfu)),
    ("pipeline.emulate_compression", 0.5, emulation_rules.compression_problem, TimeScale),
    ("pipeline.emulate_tokens_per_call", 0, emulation_rules.tokens_per_call_problem,
     lambda tokens: _emulated_engine(tokens_per_call=tokens)),
    ("rollout.max_retries", -1, routing_rules.max_retries_problem, lambda retries: _router(max_retries=retries)),
    ("pipeline.balance_delta", 0, routing_rules.balance_delta_problem, lambda delta: _balancer(1, 1, delta=delta)),
    ("pipeline.balance_cooldown_s", -1.0, routing_rules.balance_cooldown_problem,
     lambda cooldown: _balancer(1, 1, cooldown_s=cooldown)),
    ("pipeline.balance_poll_s", 0.0, routing_rules.balance_poll_problem,
     lambda poll: _balancer(1, 1, poll_interval_s=poll)),
    ("rollout.min_instances_per_agent", 0, routing_rules.min_instances_problem,
     lambda minimum: _balancer(1, 1, min_instances_per_agent=minimum)),
    ("agents.solver.lora.rank", -1, lora_rules.lora_rank_problem,
     lambda rank: LoraSpec(rank, 16.0, lora_targets.TARGETS)),
    ("agents.solver.lora.alpha", 0.0, lora_rules.lora_alpha_problem,
     lambda alpha: LoraSpec(0, alpha, lora_targets.TARGETS)),
]


@pytest.mark.parametrize("path,value,rule,build", ONE_RULE, ids=[case[0] for case in ONE_RULE])
def test_the_config_and_the_component_check_one_rule(path, value, rule, build):
    """A value the config rejects, the component built directly rejects with the same rule's words."""
    problem = rule(value)
    assert problem
    with pytest.raises(ConfigError, match=re.escape(f"config.{path}={value!r} {problem}")):
        _config_with(path, value)
    with pytest.raises(ValueError, match=re.escape(f"={value!r} {problem}")):
        build(value)


def test_the_config_and_the_balancer_check_one_rule_for_the_instances_each_agent_keeps():
    problem = routing_rules.instances_to_keep_problem(2, 1, where="rollout.")
    with pytest.raises(ConfigError, match=re.escape(f"config.rollout.{problem}")):
        _config_with("rollout.min_instances_per_agent", 2)
    # three agents, six instances: the device budget holds, but the first agent starts with one
    with pytest.raises(ValueError, match=re.escape(routing_rules.instances_to_keep_problem(2, 1))):
        _balancer(1, 3, 2, min_instances_per_agent=2)
