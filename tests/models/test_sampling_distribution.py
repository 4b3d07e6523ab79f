"""The sampling distribution as training evaluates it: one setting for every position of a [batch, seq] batch."""

import jax.numpy as jnp
import numpy as np
import pytest

from flexmarl_jax.models.sampling_distribution import is_plain_softmax, sampling_token_logprobs


def _reference(logits: np.ndarray, target: int, temperature: float, top_k: int, top_p: float) -> float:
    """log q(target) by the rule: scale, keep the top k, then the smallest prefix whose mass above is < top_p."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    keep = np.zeros(len(scaled), bool)
    keep[order[:top_k if top_k > 0 else len(scaled)]] = True
    probs = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    mass_above = np.cumsum(probs[order]) - probs[order]
    keep[order[mass_above >= top_p]] = False
    if not keep[target]:
        return -np.inf
    kept = np.where(keep, scaled, -np.inf)
    return float(kept[target] - np.log(np.exp(kept - kept.max()).sum()) - kept.max())


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 4, 1.0), (0.9, 0, 0.6),
                                                       (0.5, 5, 0.8)])
def test_token_logprobs_follow_the_sampling_rule(temperature, top_k, top_p):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 3, 11)).astype(np.float32) * 2
    targets = rng.integers(0, 11, size=(2, 3))
    got = np.asarray(sampling_token_logprobs(jnp.asarray(logits), jnp.asarray(targets), temperature=temperature,
                                             top_k=top_k, top_p=top_p))
    expected = np.array([[_reference(logits[b, t], targets[b, t], temperature, top_k, top_p) for t in range(3)]
                         for b in range(2)])
    assert got.shape == (2, 3)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-5, atol=1e-6)
    if top_k or top_p < 1:
        assert np.isinf(expected).any()  # the case masks some targets out
    assert is_plain_softmax(temperature, top_k, top_p) == ((temperature, top_k, top_p) == (1.0, 0, 1.0))
