"""A run's LoRA agents of one base are served by their group's engines (issue 34, rollout side): each instance
serves every agent of the group from one adapter table, a weight sync moves the agent's adapter only, and what
the engines decode for an agent is what its merged weights decode."""

import time

import jax
import numpy as np
import pytest

from flexmarl_jax.config import RunConfig, apply_overrides, load_config
from flexmarl_jax.models import lora
from flexmarl_jax.orchestrator.run import build_orchestrator
from flexmarl_jax.rollout.engine import FlexEngine, SlotSampling
from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest
from flexmarl_jax.workflows.generation import GenerationRequest, SamplingParams

GROUP = ("solver", "verifier")  # rank 8 on every projection and rank 4 on q/v; the corrector is a full fine-tune


@pytest.fixture(scope="module")
def run_after_one_iteration(tmp_path_factory):
    config = RunConfig.from_config(apply_overrides(load_config("configs/tiny.py:smoke"), {
        "workdir": str(tmp_path_factory.mktemp("lora_group")), "pipeline.balancing": "false",
        "agents.solver.lora.rank": "8", "agents.verifier.lora.rank": "4",
        "agents.verifier.lora.targets": "q_proj,v_proj",
        "workflow.warmup_steps": "0"}))
    orchestrator, agents, store, rollout, _ = build_orchestrator(config, resume=False)
    orchestrator.on_update_applied = None  # no checkpoints needed here
    try:
        record = orchestrator.run_iteration(0)
        yield orchestrator, agents, rollout, record
    finally:
        rollout.shutdown()
        store.close()


def _router_members(rollout):
    return {member.name: member for member in rollout.backend.router.members()}


@pytest.mark.timeout(600)
def test_a_base_groups_instances_serve_every_agent_of_the_group(run_after_one_iteration):
    _, agents, rollout, record = run_after_one_iteration
    members = _router_members(rollout)
    shared = [m for m in members.values() if m.shared]
    # the group's agents share the leader's rollout devices: one instance per device group, serving both agents
    assert agents["verifier"].devices.rollout_groups == agents["solver"].devices.rollout_groups
    assert len(shared) == len(agents["solver"].instances) == len(agents["solver"].devices.rollout_groups) >= 1
    assert agents["verifier"].instances == ()
    assert all(m.serves == GROUP and m.instance.adapter_agents == GROUP for m in shared)
    assert [m.serves for m in members.values() if not m.shared] == [("corrector",)] * len(agents["corrector"].instances)
    router = rollout.backend.router
    assert set(router.instances_of("solver")) == set(router.instances_of("verifier")) == {m.instance for m in shared}
    # the iteration's sync reaches each shared instance as one adapter version per agent, at its next step boundary
    assert record["policy_version"] == {"solver": 1, "verifier": 1, "corrector": 1}
    deadline = time.monotonic() + 60
    while not all(m.instance.adapter_versions == {"solver": 1, "verifier": 1} for m in shared):
        assert time.monotonic() < deadline, [m.instance.adapter_versions for m in shared]
        time.sleep(0.05)


@pytest.mark.timeout(600)
def test_a_lora_agents_sync_moves_its_adapter_only(run_after_one_iteration):
    orchestrator, agents, _, _ = run_after_one_iteration
    synced = orchestrator.sync_weights.served("solver")
    assert isinstance(synced, lora.AgentAdapter) and synced.spec == agents["solver"].trainer.config.lora
    adapter_bytes = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(synced))
    full = orchestrator.sync_weights.served("corrector")
    model_bytes = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(full))
    assert adapter_bytes == 4 * lora.adapter_count(agents["solver"].trainer.adapters)
    assert adapter_bytes < 0.5 * model_bytes, (adapter_bytes, model_bytes)  # the tiny preset's rank 8 is a large share


@pytest.mark.timeout(600)
def test_the_group_engine_decodes_each_agent_as_its_merged_weights(run_after_one_iteration):
    """Greedy through the run's backend (a shared instance's table, each agent on its current row after the sync)
    against a plain engine on the agent's merged weights: the same tokens, log-probs within 1e-4."""
    _, agents, rollout, _ = run_after_one_iteration
    config = next(m.instance for m in _router_members(rollout).values() if m.shared).engine.config
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    for agent in GROUP:
        futures = [rollout.backend.submit(GenerationRequest(f"{agent}/{i}", agent, text, 1, greedy))
                   for i, text in enumerate(("3+4=", "12+9=", "7+7="))]
        served = [future.result(timeout=300)[0] for future in futures]
        assert {completion.policy_version for completion in served} == {1}
        merged = jax.tree.map(np.asarray, agents[agent].trainer.params)
        engine = FlexEngine(agents[agent].model_config, agents[agent].trainer.graphdef, config,
                            agents[agent].tokenizer, params=merged)
        plain = RolloutLoop(engine, merged).generate(
            [RolloutRequest(prompt_ids=c.prompt_token_ids, num_samples=1, sampling=SlotSampling(temperature=0.0),
                            max_new_tokens=8) for c in served])
        assert [c.token_ids for c in served] == [s[0].token_ids for s in plain], agent
        gap = max(float(np.max(np.abs(np.asarray(c.logprobs) - np.asarray(s[0].logprobs))))
                  for c, s in zip(served, plain, strict=True))
        assert gap < 1e-4, (agent, gap)
