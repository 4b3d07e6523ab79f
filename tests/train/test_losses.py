import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexmarl_jax.train.algorithms import ALGORITHMS, loss_config_for
from flexmarl_jax.train.batch import build_micro_batch, stack_rows
from flexmarl_jax.train.losses import LOSSES, k3_kl, truncated_importance_weights
from flexmarl_jax.train.normalizers import IterationNormalizers
from tests.settings_views import loss_config


def _batch(num_rows=6, aggregation="token_mean", seed=0, batch_size=None, **extra):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 5, size=num_rows)
    responses = [list(rng.integers(3, 20, size=n)) for n in lengths]
    behaviour = [list(-rng.random(n)) for n in lengths]
    return build_micro_batch(
        agent="a", prompt_ids=[[1, 2]] * num_rows, response_ids=responses, behaviour_logprobs=behaviour,
        advantages=list(rng.normal(size=num_rows)), aggregation=aggregation,
        normalizers=IterationNormalizers.from_response_lengths(lengths, norm_length=4),
        batch_size=batch_size or num_rows, max_len=6,
        ref_logprobs=[list(-rng.random(n)) for n in lengths], **extra)


def _loss(config, logprobs, batch):
    return LOSSES.get(config.name)(logprobs, None, batch, config)


def test_on_policy_gradient_is_weighted_advantage():
    batch = _batch()
    config = loss_config(aggregation="token_mean")
    grad = jax.grad(lambda lp: _loss(config, lp, batch)[0])(jnp.asarray(batch.behaviour_logprobs))
    expected = -batch.token_weights * batch.advantages * batch.loss_mask
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "seq_mean_token_sum_norm"])
def test_loss_of_split_rows_sums_to_full_loss(aggregation):
    batch = _batch(num_rows=8, aggregation=aggregation)
    config = loss_config(aggregation=aggregation, kl_coef=0.1)
    logprobs = jnp.asarray(batch.behaviour_logprobs) - 0.05
    full = _loss(config, logprobs, batch)[0]
    parts = sum(_loss(config, logprobs[s], stack_rows(batch, s))[0] for s in (slice(0, 3), slice(3, 8)))
    np.testing.assert_allclose(float(parts), float(full), rtol=1e-6)


def test_dapo_clip_higher_keeps_gradient_that_symmetric_clip_cuts():
    batch = _batch(num_rows=1).replace(advantages=np.ones((1, 6), np.float32))
    logprobs = jnp.asarray(batch.old_logprobs) + jnp.log(1.25)  # ratio 1.25 everywhere
    symmetric = loss_config(aggregation="token_mean")
    sym = jax.grad(lambda lp: _loss(symmetric, lp, batch)[0])(logprobs)
    dapo = loss_config_for("dapo")
    asym = jax.grad(lambda lp: _loss(dapo, lp, batch)[0])(logprobs)
    assert float(jnp.abs(sym).sum()) == 0.0  # 1.25 > 1 + 0.2: clipped, no gradient
    assert float(jnp.abs(asym).sum()) > 0.0  # 1.25 < 1 + 0.28: still learning
    assert float(_loss(symmetric, logprobs, batch)[1]["clip_fraction"]) == pytest.approx(1.0)


def test_k3_kl_nonnegative_and_zero_at_reference():
    x = jnp.linspace(-5, 0, 11)
    assert float(jnp.min(k3_kl(x, x[::-1]))) >= 0
    np.testing.assert_allclose(np.asarray(k3_kl(x, x)), 0.0, atol=1e-7)


def test_kl_term_pulls_towards_reference():
    batch = _batch()
    config = loss_config(aggregation="token_mean", kl_coef=1.0)
    no_adv = batch.replace(advantages=np.zeros_like(batch.advantages))
    lp = jnp.asarray(batch.ref_logprobs) - 0.3  # below the reference: gradient must push up
    grad = jax.grad(lambda v: _loss(config, v, no_adv)[0])(lp)
    assert np.all(np.asarray(grad)[batch.loss_mask] < 0)


def test_truncated_importance_weights_cap_and_no_gradient():
    old = jnp.asarray([0.0, -1.0, -3.0])
    behaviour = jnp.asarray([-2.0, -1.0, -1.0])
    w = truncated_importance_weights(old, behaviour, 2.0)
    np.testing.assert_allclose(np.asarray(w), [2.0, 1.0, np.exp(-2.0)], rtol=1e-6)
    assert float(jax.grad(lambda o: truncated_importance_weights(o, behaviour, 2.0).sum())(old).sum()) == 0
    np.testing.assert_array_equal(np.asarray(truncated_importance_weights(old, behaviour, None)), 1.0)


def test_stale_samples_are_reweighted_by_tis():
    batch = _batch()
    stale = batch.replace(behaviour_logprobs=batch.old_logprobs - 5.0)  # behaviour far less likely
    config = loss_config(aggregation="token_mean", tis_cap=2.0)
    lp = jnp.asarray(batch.old_logprobs)
    g_fresh = jax.grad(lambda v: _loss(config, v, batch)[0])(lp)
    g_stale = jax.grad(lambda v: _loss(config, v, stale)[0])(lp)
    np.testing.assert_allclose(np.asarray(g_stale), 2.0 * np.asarray(g_fresh), rtol=1e-6, atol=1e-8)


def test_padding_garbage_never_makes_nan():
    batch = _batch(num_rows=3, batch_size=5)
    lp = jnp.where(jnp.asarray(batch.loss_mask), jnp.asarray(batch.old_logprobs), -1e4)
    config = loss_config(aggregation="token_mean", kl_coef=0.5, tis_cap=3.0)
    loss, metrics = _loss(config, lp, batch)
    grad = jax.grad(lambda v: _loss(config, v, batch)[0])(lp)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grad)))
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_ppo_value_loss_clipped_and_requires_values():
    batch = _batch(num_rows=2)
    batch = batch.replace(returns=np.where(batch.loss_mask, 1.0, 0.0).astype(np.float32))
    config = loss_config_for("ppo", value_clip=0.2)
    values = jnp.where(jnp.asarray(batch.loss_mask), 0.5, 0.0)  # moved 0.5 > clip from old_values=0
    _, m = LOSSES.get("ppo")(jnp.asarray(batch.old_logprobs), values, batch, config)
    # max(0.5*(0.5-1)^2, 0.5*(0.2-1)^2) = 0.32 per token, token_mean weights sum to 1
    assert float(m["value_loss"]) == pytest.approx(0.32, rel=1e-5)
    with pytest.raises(ValueError, match="needs critic values"):
        LOSSES.get("ppo")(jnp.asarray(batch.old_logprobs), None, batch, config)


def test_config_errors_list_allowed_names():
    with pytest.raises(ValueError, match="unknown loss 'reinforce'; allowed: \\['grpo', 'ppo'\\]"):
        loss_config(name="reinforce")
    with pytest.raises(ValueError, match="unknown algorithm 'x'; allowed: \\['dapo', 'drgrpo', 'grpo', 'ppo'\\]"):
        loss_config_for("x")
    with pytest.raises(ValueError, match="tis_cap=0.5 must be >= 1"):
        loss_config(tis_cap=0.5)
    assert ALGORITHMS.names() == ["dapo", "drgrpo", "grpo", "ppo"]
