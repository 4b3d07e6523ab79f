import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexmarl_jax.train.advantages import ADVANTAGES, gae, gae_from_rewards, group_advantages, whiten


def test_grpo_advantages_match_numpy_per_group():
    rewards = [1.0, 0.0, 0.5, 0.5, 2.0, 4.0, 0.0]
    groups = ["a", "a", "b", "b", "c", "c", "c"]
    got = group_advantages(rewards, groups, "grpo")
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        r = np.asarray(rewards)[idx]
        np.testing.assert_allclose(got[idx], (r - r.mean()) / (r.std() + 1e-6), rtol=1e-5, atol=1e-6)
    # group "b" has equal rewards: no signal, exactly zero advantage
    assert got[2] == 0 and got[3] == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.floats(-5, 5)), min_size=1, max_size=40))
def test_group_estimators_sum_to_zero_per_group(samples):
    groups = [g for g, _ in samples]
    rewards = [r for _, r in samples]
    for name in ("grpo", "drgrpo", "rloo"):
        adv = group_advantages(rewards, groups, name)
        for g in set(groups):
            idx = [i for i, x in enumerate(groups) if x == g]
            assert abs(adv[idx].sum()) < 1e-3 * max(1.0, len(idx)), (name, g)


def test_rloo_is_leave_one_out():
    adv = group_advantages([1.0, 2.0, 6.0], [0, 0, 0], "rloo")
    np.testing.assert_allclose(adv, [1 - 4.0, 2 - 3.5, 6 - 1.5], rtol=1e-6)


def test_unknown_estimator_names_allowed():
    with pytest.raises(ValueError, match="allowed: \\['drgrpo', 'grpo', 'rloo'\\]"):
        group_advantages([1.0], [0], "nope")
    assert "grpo" in ADVANTAGES


def _gae_reference(rewards, values, mask, gamma, lam):
    out = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = np.nonzero(mask[b])[0]
        next_value, next_adv = 0.0, 0.0
        for t in idx[::-1]:
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            next_adv = delta + gamma * lam * next_adv
            out[b, t] = next_adv
            next_value = values[b, t]
    return out


def test_gae_matches_loop_reference():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(3, 7)).astype(np.float32)
    values = rng.normal(size=(3, 7)).astype(np.float32)
    mask = np.zeros((3, 7), bool)
    mask[0, 2:5] = True
    mask[1, 0:7] = True
    mask[2, 3:4] = True
    adv, ret = gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma=0.9, lam=0.8)
    ref = _gae_reference(rewards * mask, values * mask, mask, 0.9, 0.8)
    np.testing.assert_allclose(np.asarray(adv), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret), (ref + values) * mask, rtol=1e-5, atol=1e-6)


def test_gae_from_row_rewards_matches_a_hand_computed_case():
    """Row 0: 3 response tokens at positions 2..4 with values (0.5, 0.2, -0.1) and reward 1 on the last one;
    gamma 0.9, lambda 0.8 (gamma * lambda = 0.72), the value after the last token is 0:
        delta_4 = 1 + 0.9 * 0 - (-0.1) = 1.1                   A_4 = 1.1
        delta_3 = 0 + 0.9 * (-0.1) - 0.2 = -0.29               A_3 = -0.29 + 0.72 * 1.1 = 0.502
        delta_2 = 0 + 0.9 * 0.2 - 0.5 = -0.32                  A_2 = -0.32 + 0.72 * 0.502 = 0.04144
    returns = A + V = (0.54144, 0.702, 1.0). Row 1 (one token, value 0.25, reward -1): A = -1.25, return -1.
    Row 2 is padding."""
    mask = np.zeros((3, 6), bool)
    mask[0, 2:5] = True
    mask[1, 0] = True
    values = np.full((3, 6), 9.0, np.float32)  # garbage outside the response must not leak in
    values[0, 2:5] = (0.5, 0.2, -0.1)
    values[1, 0] = 0.25
    advantages, returns = gae_from_rewards([1.0, -1.0], values, mask, gamma=0.9, lam=0.8)
    expected_advantages = np.zeros((3, 6))
    expected_advantages[0, 2:5] = (0.04144, 0.502, 1.1)
    expected_advantages[1, 0] = -1.25
    expected_returns = np.zeros((3, 6))
    expected_returns[0, 2:5] = (0.54144, 0.702, 1.0)
    expected_returns[1, 0] = -1.0
    np.testing.assert_allclose(advantages, expected_advantages, atol=1e-6)
    np.testing.assert_allclose(returns, expected_returns, atol=1e-6)
    assert advantages.dtype == returns.dtype == np.float32
    with pytest.raises(ValueError, match="one reward per row with response tokens"):
        gae_from_rewards([1.0, 1.0, 1.0], values, mask, gamma=0.9, lam=0.8)  # row 2 has no response


def test_whiten_has_zero_mean_unit_std_on_mask():
    x = jnp.asarray(np.random.default_rng(1).normal(3.0, 2.0, size=(4, 9)).astype(np.float32))
    mask = jnp.asarray(np.random.default_rng(2).random((4, 9)) > 0.3)
    w = np.asarray(whiten(x, mask))[np.asarray(mask)]
    assert abs(w.mean()) < 1e-5 and abs(w.std() - 1) < 1e-3
    assert np.all(np.asarray(whiten(x, mask))[~np.asarray(mask)] == 0)


@pytest.mark.parametrize("value", [1.6768610039025296, 0.1, -3.3, 1e3])
def test_equal_rewards_give_exactly_zero_advantage(value):
    rewards, groups = [value] * 3 + [0.0, 1.0], [0, 0, 0, 1, 1]
    assert np.all(group_advantages(rewards, groups, "grpo")[:3] == 0)
    # Dr.GRPO does not divide by the std, so only the rounding of the mean remains
    assert np.all(np.abs(group_advantages(rewards, groups, "drgrpo")[:3]) < 1e-6 * (1 + abs(value)))
