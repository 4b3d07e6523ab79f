"""The pipeline's settings are a view of the run config: no defaults and no rules of their own."""

import dataclasses

from flexmarl_jax.config import RunConfig, apply_overrides, load_config
from flexmarl_jax.orchestrator.pipeline import PipelineSettings


def test_pipeline_settings_come_from_the_run_config_alone():
    assert all(field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
               for field in dataclasses.fields(PipelineSettings))
    config = RunConfig.from_config(apply_overrides(load_config(), {
        "pipeline.mode": "sync", "pipeline.async_micro_batches": "false", "workflow.queries_per_iteration": "6",
        "workflow.samples_per_query": "8", "train.micro_batch_size": "16", "rollout.max_response_length": "24",
        "train.max_staleness": "2", "seed": "7", "pipeline.debug_invariants": "true", "run.stall_timeout_s": "300"}))
    settings = PipelineSettings.from_config(config, process_count=3)
    assert settings == PipelineSettings(
        mode="sync", async_micro_batches=False, queries_per_iteration=6, samples_per_query=8, micro_batch_size=16,
        max_response_length=24, max_staleness=2, seed=7, debug_invariants=True, deterministic=False,
        stall_timeout_s=300.0, process_count=3)
    assert not settings.overlaps_training  # sync trains after the rollout
