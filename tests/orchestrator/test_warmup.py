"""flexmarl_jax/orchestrator/warmup.py: the supervised warm-up is its own training, with its own learning rate,
and RL starts after it from a fresh optimizer at the agent's learning rate."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from flexmarl_jax.models import functional
from flexmarl_jax.models.presets import get_preset
from flexmarl_jax.models.tokenizer import CharTokenizer
from flexmarl_jax.orchestrator.warmup import run_warmup
from flexmarl_jax.train.trainer import AgentTrainer
from tests.settings_views import loss_config, optimizer_config, trainer_config

RL = optimizer_config(name="adam", learning_rate=1e-2, eps=1e-6, max_grad_norm=None)


def _leaves(tree):
    return [np.asarray(x, np.float64) for x in jax.device_get(jax.tree.leaves(tree))]


@pytest.mark.timeout(300)
def test_warm_up_runs_at_its_own_rate_and_leaves_a_fresh_optimizer_at_the_agents_rate():
    config = dataclasses.replace(get_preset("tiny"), num_layers=1)
    initial = functional.init_params(config, seed=0)
    trainer = AgentTrainer("solver", config, trainer_config(micro_batch_size=4, max_len=16,
                                                            loss=loss_config(aggregation="token_mean"), optimizer=RL),
                           initial=initial)
    before = _leaves(trainer.params)
    runtime = types.SimpleNamespace(trainer=trainer, tokenizer=CharTokenizer())
    examples = {"solver": [("rev:abc=", "cba"), ("rev:dab=", "bad"), ("rev:cc=", "cc")]}
    losses = run_warmup({"solver": runtime}, examples, steps=3, seed=0, learning_rate=1e-3)

    assert np.isfinite(losses["solver"]) and trainer.policy_version == 0
    # Adam moves a parameter by at most ~lr per step: three steps at 1e-3, not at the agent's 1e-2
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(_leaves(trainer.params), before, strict=True))
    assert 1e-4 < moved <= 3 * 1e-3 * 1.01
    # RL starts from zero moments and step count, at the agent's own learning rate
    assert trainer.config.optimizer == RL
    assert all(not np.any(leaf) for leaf in _leaves(trainer._opt_state))


@pytest.mark.timeout(300)
def test_with_a_kl_the_reference_is_the_warmed_up_policy_not_the_initial_one():
    config = dataclasses.replace(get_preset("tiny"), num_layers=1)
    loss = loss_config(aggregation="token_mean", kl_coef=0.1)
    trainer = AgentTrainer("solver", config, trainer_config(micro_batch_size=4, max_len=16, loss=loss, optimizer=RL),
                           initial=functional.init_params(config, seed=0))
    initial = _leaves(trainer.params)
    runtime = types.SimpleNamespace(trainer=trainer, tokenizer=CharTokenizer())
    run_warmup({"solver": runtime}, {"solver": [("rev:abc=", "cba"), ("rev:cc=", "cc")]}, steps=2, seed=0)

    warmed, reference = _leaves(trainer.params), _leaves(trainer._reference)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(warmed, initial, strict=True)) > 1e-4
    assert all(np.array_equal(a, b) for a, b in zip(reference, warmed, strict=True))
