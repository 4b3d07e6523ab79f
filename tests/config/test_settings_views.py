"""The settings views of a `RunConfig` have no defaults of their own: each is built from `RunConfig()` alone by its
builder, its fields are the config's values, and a rule both check is one rule (docs/architecture.md, "One place
for each setting")."""

import dataclasses
import re

import pytest

from flexmarl_jax.config import ConfigError, RunConfig
from flexmarl_jax.orchestrator.pipeline import PipelineSettings
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
