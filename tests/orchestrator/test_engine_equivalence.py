"""Through the real engines: strict `flexmarl` and `sync` learn the same parameters (async changes timing only)."""

import jax
import numpy as np
import pytest

from flexmarl_jax.config import RunConfig, apply_overrides, load_config
from flexmarl_jax.orchestrator.run import build_orchestrator


def _params_after_two_iterations(mode, workdir):
    config = RunConfig.from_config(apply_overrides(load_config("configs/tiny.py:smoke"), {
        "pipeline.mode": mode, "workdir": str(workdir), "pipeline.balancing": "false",
        "pipeline.debug_invariants": "true"}))
    orchestrator, agents, store, rollout, _ = build_orchestrator(config, resume=False)
    orchestrator.on_update_applied = None  # no checkpoints needed here
    try:
        records = [orchestrator.run_iteration(iteration) for iteration in range(2)]
    finally:
        rollout.shutdown()
        store.close()
    flat = {agent: np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(runtime.trainer.params)])
            for agent, runtime in agents.items()}
    return flat, records


@pytest.mark.timeout(600)
def test_flexmarl_and_sync_reach_the_same_parameters_on_real_engines(tmp_path):
    async_params, async_records = _params_after_two_iterations("flexmarl", tmp_path / "flexmarl")
    sync_params, sync_records = _params_after_two_iterations("sync", tmp_path / "sync")
    for a, b in zip(async_records, sync_records, strict=True):
        assert a["generated_tokens"] == b["generated_tokens"]  # the same rollouts
        assert a["team_accuracy"] == b["team_accuracy"]
    for agent in async_params:
        difference = np.linalg.norm(async_params[agent] - sync_params[agent])
        assert difference / np.linalg.norm(sync_params[agent]) < 1e-5, agent
