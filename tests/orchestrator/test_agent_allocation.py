"""Agent-centric allocation through the real JointOrchestrator: 4 agents on 2 shared training slices train
exactly like 4 agents on 4 dedicated meshes, and a suspended agent leaves nothing on the slice devices."""

import gc

import jax
import numpy as np
import pytest

from flexmarl_jax.config import AgentConfig, LoraConfig, RolloutConfig, RunConfig, TrainConfig, WorkflowConfig
from flexmarl_jax.mesh.meshes import make_mesh
from flexmarl_jax.metrics import Timeline
from flexmarl_jax.models.tokenizer import CharTokenizer
from flexmarl_jax.orchestrator.agents import agent_layout, build_agent_runtimes, pool_training
from flexmarl_jax.orchestrator.pipeline import JointOrchestrator
from flexmarl_jax.orchestrator.run import pipeline_settings
from flexmarl_jax.orchestrator.weight_sync import StoreWeightSync
from flexmarl_jax.store import ExperienceStore
from flexmarl_jax.train.algorithms import loss_config_for
from flexmarl_jax.train.protocol import Trainer
from flexmarl_jax.transfer import StateStore
from flexmarl_jax.workflows import ArithmeticTask, ScriptedAgent, ScriptedBackend, build_workflow
from flexmarl_jax.workflows.oracles import PromptOracle, answer_policy
from flexmarl_jax.workflows.scripted import long_tail_latency
from tests.settings_views import optimizer_config

PROPOSERS = ("proposer0", "proposer1", "proposer2")
AGENTS = (*PROPOSERS, "aggregator")
QUERIES, SAMPLES, MICRO_BATCH = 4, 4, 8
MAX_PROMPT, MAX_RESPONSE = 32, 6
# Adam's eps well above float rounding: with eps=1e-8 a gradient that is zero up to rounding (its value
# depends on how the iteration was cut into micro-batches, which follows thread timing) still moves a
# parameter by ~lr, so even two static runs differ by ~1e-6. The moments still travel with every swap.
OPTIMIZER = optimizer_config(name="adam", learning_rate=1e-2, eps=1e-4)
ACCURACY = {"proposer0": 0.3, "proposer1": 0.5, "proposer2": 0.7, "aggregator": 0.6}


def agent_meshes():
    """One single-device mesh per agent; a pool of S slices takes the first S (shared compiled steps)."""
    return [make_mesh(jax.devices()[i:i + 1], fsdp=1) for i in range(len(AGENTS))]


def build(num_slices: int, *, latency=None, lora_rank: int = 0):
    """The mixture workflow (3 proposers -> aggregator) with scripted answers and real trainers and store.

    num_slices: 0 = a dedicated mesh per agent (static binding), else that many shared slices.
    """
    meshes = agent_meshes()
    # No debug invariants (the default): the checker keys samples by id alone, and the mixture's proposers
    # share ids.
    config = RunConfig(
        agents={agent: AgentConfig(lora=LoraConfig(rank=lora_rank if agent in PROPOSERS else 0)) for agent in AGENTS},
        workflow=WorkflowConfig(
            name="mixture", queries_per_iteration=QUERIES, samples_per_query=SAMPLES),
        rollout=RolloutConfig(max_prompt_length=MAX_PROMPT, max_response_length=MAX_RESPONSE),
        train=TrainConfig(learning_rate=OPTIMIZER.learning_rate, micro_batch_size=MICRO_BATCH))
    # Built without engines (the scripted backend below answers for the agents), each on its own mesh.
    runtimes = build_agent_runtimes(config, agent_layout(config), train_meshes=dict(zip(AGENTS, meshes, strict=True)),
                                    trainer_overrides={"optimizer": OPTIMIZER})
    timeline = Timeline()
    training, runtimes = pool_training(runtimes, meshes[:num_slices], acquire_timeout=60, clock=timeline.now)
    # The orchestrator types against the Trainer protocol: pooled stand-ins and dedicated trainers both fit it.
    assert all(isinstance(runtime.trainer, Trainer) for runtime in runtimes.values())
    task = ArithmeticTask(max_digits=1, operators="+")
    oracle = PromptOracle([p for s in range(200) for p in task.generate(QUERIES, seed=s)])
    tokenizer = CharTokenizer()
    backend = ScriptedBackend({a: ScriptedAgent(answer_policy(oracle, ACCURACY[a]), latency) for a in AGENTS},
                              seed=0, encode=lambda text: tokenizer.encode(text, add_bos=False))
    loss = loss_config_for(config.train.algorithm)
    orchestrator = JointOrchestrator(
        pipeline_settings(config), agents=runtimes, training=training,
        store=ExperienceStore.open(None, agents=AGENTS, backend="memory"),
        workflow=build_workflow("mixture", proposers=PROPOSERS, aggregator="aggregator"), task=task,
        backend=backend, sync_weights=lambda agent, params, version: backend.set_policy_version(agent, version),
        aggregation=loss.aggregation, estimator=loss.advantage_estimator, timeline=timeline)
    return orchestrator, backend, training if num_slices else None


def host_params(trainer) -> list[np.ndarray]:
    return [np.asarray(leaf, np.float64) for leaf in jax.tree.leaves(trainer.params)]


def relative_difference(a, b) -> float:
    diff = sum(float(np.sum((x - y) ** 2)) for x, y in zip(a, b, strict=True))
    return (diff / sum(float(np.sum(y ** 2)) for y in b)) ** 0.5


def live_bytes_on(devices) -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted() and a.devices() & devices)


def train(num_slices: int, iterations: int = 2, lora_rank: int = 0):
    orchestrator, backend, shared = build(num_slices, latency=long_tail_latency(0.002, 0.05, 0.2), lora_rank=lora_rank)
    initial = {agent: host_params(t) for agent, t in orchestrator.trainers.items()}
    records = []
    try:
        for iteration in range(iterations):
            records.append(orchestrator.run_iteration(iteration))
    finally:
        backend.shutdown()
    final = {agent: host_params(t) for agent, t in orchestrator.trainers.items()}
    return orchestrator, shared, records, initial, final


@pytest.mark.timeout(180)
def test_four_agents_on_two_slices_match_dedicated_meshes_and_suspend_frees_the_slices():
    _, _, static_records, initial, on_four = train(0)
    slice_devices = frozenset().union(*(set(m.devices.flat) for m in agent_meshes()[:2]))
    baseline = live_bytes_on(slice_devices)

    orchestrator, shared, records, initial_two, on_two = train(2)
    for agent in AGENTS:
        assert orchestrator.trainers[agent].policy_version == 2
        assert relative_difference(initial_two[agent], initial[agent]) == 0.0  # same seeds, same start
        assert relative_difference(on_two[agent], initial[agent]) > 1e-3  # training changed the params
        assert relative_difference(on_two[agent], on_four[agent]) < 1e-6, agent
        assert all(record["agent"][agent]["samples"] == QUERIES * SAMPLES for record in records)
    # 4 agents on 2 slices: states were swapped in from host, and a swapped-out agent resumed with its
    # accumulated gradients (the parameters above match, so nothing was lost in between).
    stats = records[-1]["train_pool"]
    assert stats["slices"] == 2 and stats["agents"] == 4
    assert stats["swapped_in"] > len(AGENTS) and stats["swapped_out"] > 0
    assert 0 < stats["utilization"] <= 1 and 0 < stats["held"] <= 1
    assert static_records[-1]["train_pool"]["slices"] == 4

    with pytest.raises(RuntimeError, match="handed over by swap_state"):
        _ = shared._inner["aggregator"].params  # the wrapped trainer gave its state to the store

    # Released agents stay parked on their slice; suspending them frees every byte on the slice devices.
    parked = [agent for agent in AGENTS if shared.residency.location(agent)[0] == "device"]
    assert parked and live_bytes_on(slice_devices) > baseline
    shared.residency.suspend_all()
    assert all(shared.residency.location(agent) == ("host", None) for agent in AGENTS)
    assert live_bytes_on(slice_devices) == baseline


@pytest.mark.timeout(300)
def test_a_lora_group_on_two_slices_matches_dedicated_meshes_with_one_base_per_slice(tmp_path):
    """The proposers as rank-4 adapters on one base (the aggregator a full fine-tune): on 2 shared slices they
    train as on 4 dedicated meshes; the group's base is not in any agent's moving state, each slice holds one copy
    of it for the whole group, and a pooled LoRA agent's checkpoint restores its policy."""
    from flexmarl_jax.train.checkpoint import restore_policy, save_trainer

    _, _, _, initial, on_four = train(0, lora_rank=4)
    orchestrator, shared, records, _, on_two = train(2, lora_rank=4)
    for agent in AGENTS:
        assert orchestrator.trainers[agent].policy_version == 2
        assert relative_difference(on_two[agent], initial[agent]) > 1e-4, agent
        assert relative_difference(on_two[agent], on_four[agent]) < 1e-6, agent
    shared.residency.suspend_all()
    for agent in PROPOSERS:
        assert "base" not in shared.residency.read(agent) and "adapters" in shared.residency.read(agent)["trainable"]
    save_trainer(orchestrator.trainers["proposer1"], tmp_path / "proposer1")
    restored = restore_policy(tmp_path / "proposer1")
    assert restored.policy_version == 2 and restored.lora.rank == 4
    assert relative_difference(host_params(restored), on_two["proposer1"]) < 1e-6
    for mesh in agent_meshes()[:2]:
        placed = [shared.base_on(agent, mesh) for agent in PROPOSERS]
        assert all(leaf_a is leaf_b for other in placed[1:]
                   for leaf_a, leaf_b in zip(jax.tree.leaves(placed[0]), jax.tree.leaves(other), strict=True))


def test_weight_sync_goes_through_the_state_store_onto_the_rollout_shardings():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    train_mesh = make_mesh(jax.devices()[:2], fsdp=2)
    rollout_mesh = make_mesh(jax.devices()[4:8], fsdp=4)
    rng = np.random.default_rng(0)
    params = {"w": jax.device_put(rng.standard_normal((8, 4)).astype(np.float32), NamedSharding(train_mesh, P("fsdp"))),
              "b": jax.device_put(np.arange(4, dtype=np.float32), NamedSharding(train_mesh, P()))}
    target = {"w": NamedSharding(rollout_mesh, P("fsdp")), "b": NamedSharding(rollout_mesh, P())}
    pushed = []
    store = StateStore()
    sync = StoreWeightSync(store, lambda agent, value, version: pushed.append((agent, value, version)),
                           target_for=lambda agent: target)
    sync("solver", params, 3)
    (agent, value, version), = pushed
    assert (agent, version, sync.synced) == ("solver", 3, {"solver": 3})
    for name in params:
        assert value[name].sharding.is_equivalent_to(target[name], value[name].ndim)
        np.testing.assert_array_equal(np.asarray(value[name]), np.asarray(params[name]))
        assert not params[name].is_deleted()  # the trainer's arrays are never freed by a sync
    # The store keeps the rollout copy, not the trainer's arrays (a trainer swap-out can free its slice).
    served = sync.served("solver")
    assert all(served[name] is value[name] for name in params)
    with pytest.raises(KeyError, match="no value stored under key 'weights/verifier'"):
        sync.served("verifier")
