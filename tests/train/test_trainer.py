"""AgentTrainer: exact micro-batch accumulation, versioned updates, sharding, bad input."""

import dataclasses

import jax
import numpy as np
import pytest

from flexmarl_jax.mesh.meshes import make_mesh
from flexmarl_jax.models import functional
from flexmarl_jax.train.advantages import gae
from flexmarl_jax.train.algorithms import loss_config_for
from flexmarl_jax.train.batch import build_iteration
from flexmarl_jax.train.optim import OptimizerConfig
from flexmarl_jax.train.trainer import AgentTrainer, TrainerConfig
from tests.train.conftest import FULL, LOSS, MAX_LEN, all_zero, make_trainer, random_rows, rel_err, run_iteration


@pytest.mark.parametrize("agent,num_samples", [("solver", 29), ("verifier", 13)])
def test_accumulated_gradient_equals_full_batch(tiny_model_config, initial, agent, num_samples):
    """k in {2, 4, 8} micro-batches (uneven counts: the last one is partly padding), KL on."""
    rows = random_rows(num_samples, seed=num_samples)
    full = make_trainer(tiny_model_config, initial, FULL, agent=agent)
    run_iteration(full, rows, FULL)
    reference = full.accumulated_gradients()
    assert not all_zero(reference)
    for k in (2, 4, 8):
        micro = FULL // k
        trainer = make_trainer(tiny_model_config, initial, micro, agent=agent)
        run_iteration(trainer, rows, micro)
        assert trainer.pending_micro_batches == -(-num_samples // micro)
        err = rel_err(trainer.accumulated_gradients(), reference)
        assert err < 1e-5, (k, err)


def test_params_after_iteration_equal_full_batch_update(tiny_model_config, initial):
    rows = random_rows(29, seed=1)
    full, split = (make_trainer(tiny_model_config, initial, m) for m in (FULL, FULL // 4))
    run_iteration(full, rows, FULL)
    run_iteration(split, rows, FULL // 4)
    before = jax.device_get(split.params)
    metrics_full, metrics_split = full.apply(), split.apply()
    assert full.policy_version == split.policy_version == 1
    assert split.pending_micro_batches == 0
    assert rel_err(split.params, before) > 1e-4  # the update did something
    assert rel_err(split.params, full.params) < 1e-6
    assert metrics_split["num_tokens"] == metrics_full["num_tokens"] == sum(len(r) for r in rows["response_ids"])
    assert metrics_split["loss"] == pytest.approx(metrics_full["loss"], rel=1e-5, abs=1e-7)
    # the accumulator was cleared: a new iteration starts from zero
    assert all_zero(split.accumulated_gradients())


@pytest.mark.parametrize("fsdp,tp", [(8, 1), (4, 2)])
def test_sharded_run_equals_one_device(tiny_model_config, initial, fsdp, tp):
    assert jax.device_count() >= 8, "tests/conftest.py fakes 8 CPU devices"
    rows = random_rows(16, seed=2)
    one = make_trainer(tiny_model_config, initial, 8)
    mesh = make_mesh(jax.devices()[:fsdp * tp], fsdp=fsdp, tp=tp)
    sharded = make_trainer(tiny_model_config, initial, 8, mesh=mesh)
    # parameters and optimizer moments are split over the mesh, not replicated
    embedding = sharded.params["embed"]["embedding"][...]
    assert embedding.sharding.spec == jax.sharding.PartitionSpec("tp", "fsdp")  # [vocab, embed]
    assert embedding.addressable_shards[0].data.size == embedding.size // (fsdp * tp)
    moments = [x for x in jax.tree.leaves(sharded._opt_state) if x.shape == embedding.shape]
    assert moments and all(m.addressable_shards[0].data.size == embedding.size // (fsdp * tp) for m in moments)
    for trainer in (one, sharded):
        run_iteration(trainer, rows, 8)
    assert rel_err(sharded.accumulated_gradients(), one.accumulated_gradients()) < 1e-5
    one.apply()
    sharded.apply()
    assert rel_err(sharded.params, one.params) < 1e-5
    assert rel_err(sharded._opt_state, one._opt_state) < 1e-5


def test_bad_micro_batches_are_rejected_before_anything_is_applied(tiny_model_config, initial):
    trainer = make_trainer(tiny_model_config, initial, 8)
    good = build_iteration(agent="solver", aggregation="token_mean", micro_batch_size=8, max_len=MAX_LEN,
                           **random_rows(8))[0]
    wrong_agent = build_iteration(agent="verifier", aggregation="token_mean", micro_batch_size=8,
                                  max_len=MAX_LEN, **random_rows(8))[0]
    wrong_rows = build_iteration(agent="solver", aggregation="token_mean", micro_batch_size=4,
                                 max_len=MAX_LEN, **random_rows(4))[0]
    cases = [
        (wrong_agent, "belongs to agent 'verifier', but this trainer trains 'solver'"),
        (wrong_rows, r"shape \(4, 12\); agent 'solver' needs \(8, 12\)"),
        (good.replace(loss_mask=good.loss_mask.astype(np.int32)), "'loss_mask' has dtype int32; allowed: bool"),
        (good.replace(advantages=good.advantages[:, :5]), r"'advantages' has shape \(8, 5\)"),
    ]
    for batch, message in cases:
        with pytest.raises(ValueError, match=message):
            trainer.accumulate(batch)
    assert trainer.pending_micro_batches == 0
    assert all_zero(trainer.accumulated_gradients())
    with pytest.raises(RuntimeError, match="apply\\(\\) with no accumulated micro-batch"):
        trainer.apply()
    assert trainer.policy_version == 0
    assert trainer.apply(allow_empty=True) == {} and trainer.policy_version == 1


def test_logprobs_are_the_old_policy_of_the_iteration(tiny_model_config, initial):
    """Old log-probs read from the trainer make the PPO ratio exactly 1 (nothing clipped)."""
    trainer = make_trainer(tiny_model_config, initial, 8)
    batch = build_iteration(agent="solver", aggregation="token_mean", micro_batch_size=8, max_len=MAX_LEN,
                            **random_rows(8, seed=5))[0]
    old = trainer.logprobs(batch)
    assert old.shape == (8, MAX_LEN) and np.all(old[batch.loss_mask] < 0)
    ref = trainer.logprobs(batch, which="reference")
    np.testing.assert_allclose(ref, old, rtol=1e-6)  # reference == initial policy
    trainer.accumulate(batch.replace(old_logprobs=np.where(batch.loss_mask, old, 0).astype(np.float32)))
    metrics = trainer.apply()
    assert metrics["clip_fraction"] == 0.0 and metrics["ratio"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)
    moved = trainer.logprobs(batch)
    assert np.abs(moved - old)[batch.loss_mask].max() > 1e-4  # params changed
    np.testing.assert_allclose(trainer.logprobs(batch, which="reference"), ref)  # reference frozen


def test_heterogeneous_agents_have_own_model_optimizer_and_mesh(tiny_model_config, initial):
    solver = make_trainer(tiny_model_config, initial, 8, agent="solver")
    other_model = dataclasses.replace(tiny_model_config, hidden_size=32, intermediate_size=64, num_heads=2,
                                      num_kv_heads=1)
    sgd = OptimizerConfig(name="sgd", learning_rate=0.5, max_grad_norm=None)
    verifier = AgentTrainer("verifier", other_model,
                            TrainerConfig(micro_batch_size=4, max_len=MAX_LEN, optimizer=sgd),
                            mesh=make_mesh(jax.devices()[4:8], fsdp=4), seed=1)
    assert functional.param_count(verifier.params) < functional.param_count(solver.params)
    assert verifier.params["embed"]["embedding"][...].sharding.mesh.devices.flat[0] == jax.devices()[4]

    run_iteration(solver, random_rows(16, seed=7), 8)
    run_iteration(verifier, random_rows(6, seed=8), 4, aggregation=verifier.config.loss.aggregation)
    with pytest.raises(ValueError, match="belongs to agent 'solver'"):
        verifier.accumulate(build_iteration(agent="solver", aggregation="token_mean", micro_batch_size=4,
                                            max_len=MAX_LEN, **random_rows(4))[0])
    grads = jax.device_get(verifier.accumulated_gradients()["policy"])
    before = jax.device_get(verifier.params)
    solver.apply()
    verifier.apply()
    assert solver.policy_version == verifier.policy_version == 1
    expected = jax.tree.map(lambda p, g: p - 0.5 * g, before, grads)  # plain SGD with this agent's lr
    assert rel_err(verifier.params, expected) < 1e-6


def test_ppo_critic_learns_returns(tiny_model_config, initial):
    trainer = make_trainer(tiny_model_config, initial, 8, loss=loss_config_for("ppo", gae_lambda=1.0))
    rows = random_rows(16, seed=9)
    rewards = np.where(np.arange(16) % 2 == 0, 1.0, -1.0).astype(np.float32)
    batches = build_iteration(agent="solver", aggregation="token_mean", micro_batch_size=8, max_len=MAX_LEN,
                              **rows)
    value_losses = []
    for _ in range(6):
        prepared = []
        for i, batch in enumerate(batches):
            values = trainer.values(batch)
            mask = batch.loss_mask
            last = mask & ~np.roll(mask, -1, axis=1)  # the last response token of each row
            token_rewards = np.where(last, rewards[i * 8:(i + 1) * 8, None], 0.0)
            advantages, returns = gae(token_rewards, values, mask, gamma=1.0, lam=1.0)
            expected_returns = np.where(mask, rewards[i * 8:(i + 1) * 8, None], 0.0)
            np.testing.assert_allclose(np.asarray(returns), expected_returns, atol=1e-5)
            prepared.append(batch.replace(advantages=np.asarray(advantages, np.float32),
                                          old_values=np.where(mask, values, 0).astype(np.float32),
                                          returns=np.asarray(returns, np.float32)))
        for batch in prepared:
            trainer.accumulate(batch)
        value_losses.append(trainer.apply()["value_loss"])
    assert value_losses[0] == pytest.approx(0.5, rel=1e-3)  # zero-initialised head: 0.5 * (0 - +-1)^2
    assert value_losses[-1] < 0.5 * value_losses[0], value_losses


def test_stale_samples_get_truncated_importance_weights_in_the_step(tiny_model_config, initial):
    """With old log-probs taken in-step, a sample whose behaviour policy made it e^5 less likely than
    the current policy counts tis_cap times; a fresh one counts once. (The KL term is on but has zero
    gradient here: a fresh trainer's policy equals its reference.)"""
    assert LOSS.tis_cap == 2.0
    trainer = make_trainer(tiny_model_config, initial, 8)
    batch = build_iteration(agent="solver", aggregation="token_mean", micro_batch_size=8, max_len=MAX_LEN,
                            **random_rows(8, seed=4))[0]
    current = trainer.logprobs(batch)
    fresh = batch.replace(behaviour_logprobs=np.where(batch.loss_mask, current, 0).astype(np.float32))
    stale = batch.replace(behaviour_logprobs=np.where(batch.loss_mask, current - 5, 0).astype(np.float32))
    trainer.accumulate(fresh)
    g_fresh = jax.device_get(trainer.accumulated_gradients())
    trainer.discard_accumulated()
    trainer.accumulate(stale)
    g_stale = jax.device_get(trainer.accumulated_gradients())
    assert rel_err(g_stale, jax.tree.map(lambda g: 2 * g, g_fresh)) < 1e-5
