"""A small orchestrator over real trainers and a real store, with scripted (model-free) rollouts."""

import jax
import numpy as np
import pytest

from flexmarl_jax.config import (
    PipelineConfig,
    RolloutConfig,
    RunConfig,
    RunControlConfig,
    TrainConfig,
    WorkflowConfig,
)
from flexmarl_jax.mesh.layout import layout_devices
from flexmarl_jax.models.tokenizer import CharTokenizer
from flexmarl_jax.orchestrator.agents import agent_layout, build_agent_runtimes, pool_training
from flexmarl_jax.orchestrator.pipeline import JointOrchestrator
from flexmarl_jax.orchestrator.run import pipeline_settings
from flexmarl_jax.store import ExperienceStore
from flexmarl_jax.train.algorithms import loss_config_for
from flexmarl_jax.workflows import ArithmeticTask, ScriptedAgent, ScriptedBackend, build_workflow
from flexmarl_jax.workflows.oracles import chain_policies
from flexmarl_jax.workflows.scripted import long_tail_latency

AGENTS = ("solver", "verifier", "corrector")
QUERIES, SAMPLES, MICRO_BATCH = 4, 4, 8
MAX_PROMPT, MAX_RESPONSE = 24, 6


class ScriptedRollout:
    """A ScriptedBackend whose answers come from noisy oracles over every problem the task can generate."""

    def __init__(self, task, latency=None, seed=0):
        problems = [p for s in range(200) for p in task.generate(QUERIES, seed=s)]
        policies = chain_policies(problems, task.verify, solver_accuracy=0.4, verifier_accuracy=0.7,
                                  corrector_accuracy=0.5)
        tokenizer = CharTokenizer()
        self.backend = ScriptedBackend({a: ScriptedAgent(policies[a], latency) for a in AGENTS}, seed=seed,
                                       encode=lambda text: tokenizer.encode(text, add_bos=False))
        self.synced = []

    def sync_weights(self, agent, params, version):
        self.synced.append((agent, version))
        self.backend.set_policy_version(agent, version)


def make_orchestrator(mode="flexmarl", *, max_staleness=0, latency=None, debug=True, async_micro_batches=True,
                      seed=0, workdir=None, backend="memory", algorithm="grpo", deterministic=False,
                      stall_timeout_s=600.0):
    # The chain team of configs/tiny.py (solver, verifier, corrector) at this file's sizes.
    config = RunConfig(
        seed=seed, run=RunControlConfig(stall_timeout_s=stall_timeout_s),
        rollout=RolloutConfig(max_prompt_length=MAX_PROMPT, max_response_length=MAX_RESPONSE,
                              instance_stall_s=stall_timeout_s / 2),
        workflow=WorkflowConfig(queries_per_iteration=QUERIES, samples_per_query=SAMPLES),
        train=TrainConfig(algorithm=algorithm, learning_rate=1e-2, micro_batch_size=MICRO_BATCH,
                          max_staleness=max_staleness),
        pipeline=PipelineConfig(mode=mode, async_micro_batches=async_micro_batches, debug_invariants=debug,
                                deterministic=deterministic))
    # Every trainer on one device mesh: compiled steps are then shared by agents and tests (the consistency
    # model does not depend on where trainers run; tests/mesh covers the disaggregated layout).
    mesh = layout_devices(jax.devices(), ["all"], instances_per_agent=1, rollout_devices_per_instance=1,
                          train_devices_per_agent=1)["all"].train_mesh()
    # The agents are built without engines (no `start_engines`): the scripted backend below answers for them.
    runtimes = build_agent_runtimes(config, agent_layout(config), train_meshes={agent: mesh for agent in AGENTS})
    training, runtimes = pool_training(runtimes)
    task = ArithmeticTask(max_digits=1, operators="+")
    rollout = ScriptedRollout(task, latency, seed=seed)
    store = ExperienceStore.open(workdir, agents=AGENTS, backend=backend)
    loss = loss_config_for(config.train.algorithm)
    orchestrator = JointOrchestrator(
        pipeline_settings(config), agents=runtimes, training=training, store=store,
        workflow=build_workflow("chain", agents=AGENTS), task=task,
        backend=rollout.backend, sync_weights=rollout.sync_weights, aggregation=loss.aggregation,
        estimator=loss.advantage_estimator)
    return orchestrator, rollout


def flat_params(trainer):
    return np.concatenate([np.ravel(np.asarray(leaf)) for leaf in jax.tree.leaves(trainer.params)])


@pytest.fixture
def orchestrator_factory():
    made = []

    def factory(*args, **kwargs):
        orchestrator, rollout = make_orchestrator(*args, **kwargs)
        made.append(rollout)
        return orchestrator, rollout

    yield factory
    for rollout in made:
        rollout.backend.shutdown()


__all__ = ["flat_params", "long_tail_latency"]
