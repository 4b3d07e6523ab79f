"""Sampling masks and log-probs against a NumPy reference; frequencies against the distribution."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from flexmarl_jax.rollout.sampling import sample_tokens, sampling_log_probs

# one compile per shape; eager calls would compile lax.cond/top_k pieces on every call
_log_probs = jax.jit(sampling_log_probs)
_sample = jax.jit(sample_tokens)


def reference_log_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Straightforward NumPy version of the documented rules for one row [vocab]."""
    logits = logits.astype(np.float64)
    if temperature <= 0:
        shifted = logits - logits.max()
        return shifted - np.log(np.exp(shifted).sum())
    scaled = logits / temperature
    order = sorted(range(len(scaled)), key=lambda i: (-scaled[i], i))
    keep = np.zeros(len(scaled), bool)
    kept = order if top_k <= 0 else order[:top_k]
    kept_logits = scaled[kept]
    probs = np.exp(kept_logits - kept_logits.max())
    probs /= probs.sum()
    mass_above = 0.0
    for token, prob in zip(kept, probs, strict=True):
        if mass_above < top_p or top_p >= 1.0:
            keep[token] = True
        mass_above += prob
    masked = np.where(keep, scaled, -np.inf)
    shifted = masked - masked[keep].max()
    return shifted - np.log(np.exp(shifted[keep]).sum())


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5]),
    top_k=st.sampled_from([0, 1, 3, 10, 50]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
)
def test_masked_log_probs_match_numpy_reference(seed, temperature, top_k, top_p):
    vocab = 37
    logits = np.random.default_rng(seed).normal(scale=3.0, size=(2, vocab)).astype(np.float32)
    got = np.asarray(
        _log_probs(logits, np.full((2,), temperature, np.float32), np.full((2,), top_k, np.int32),
                   np.full((2,), top_p, np.float32))
    )
    for row in range(2):
        want = reference_log_probs(logits[row], temperature, top_k, top_p)
        assert np.array_equal(np.isinf(got[row]), np.isinf(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[row][finite], want[finite], atol=1e-5)


def test_rows_use_their_own_settings():
    logits = np.random.default_rng(0).normal(size=(3, 20)).astype(np.float32)
    temperature, top_k, top_p = [0.0, 0.7, 1.0], [0, 5, 0], [1.0, 1.0, 0.6]
    got = np.asarray(_log_probs(logits, np.asarray(temperature, np.float32), np.asarray(top_k, np.int32),
                                np.asarray(top_p, np.float32)))
    for row in range(3):
        want = reference_log_probs(logits[row], temperature[row], top_k[row], top_p[row])
        finite = np.isfinite(want)
        assert np.array_equal(np.isfinite(got[row]), finite)
        np.testing.assert_allclose(got[row][finite], want[finite], atol=1e-5)


def test_greedy_rows_take_argmax_and_report_model_log_prob():
    logits = np.random.default_rng(1).normal(size=(4, 11)).astype(np.float32)
    keys = jax.random.split(jax.random.key(0), 4)
    tokens, logprobs = _sample(keys, logits, np.zeros(4, np.float32), np.full((4,), 3, np.int32),
                               np.full((4,), 0.5, np.float32))
    assert np.array_equal(np.asarray(tokens), logits.argmax(-1))
    want = jax.nn.log_softmax(logits, axis=-1)[np.arange(4), logits.argmax(-1)]
    np.testing.assert_allclose(np.asarray(logprobs), want, atol=1e-6)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8), (0.7, 5, 0.9)])
def test_frequencies_match_distribution_chi_square(temperature, top_k, top_p):
    """20k draws over a 6-token vocabulary: chi-square against the masked distribution."""
    draws, vocab = 20_000, 6
    logits = np.array([1.2, 0.3, -0.4, 0.9, -1.5, 0.0], np.float32)
    keys = jax.random.split(jax.random.key(42), draws)
    batch_logits = np.broadcast_to(logits, (draws, vocab))
    tokens, logprobs = _sample(
        keys, batch_logits, np.full((draws,), temperature, np.float32), np.full((draws,), top_k, np.int32),
        np.full((draws,), top_p, np.float32),
    )
    want = np.exp(reference_log_probs(logits, temperature, top_k, top_p))
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    support = want > 0
    assert counts[~support].sum() == 0, "a masked token was sampled"
    p_value = stats.chisquare(counts[support], want[support] * draws).pvalue
    assert p_value > 1e-3, (counts, want * draws)
    # the log-prob returned is that of the distribution sampled from
    np.testing.assert_allclose(np.asarray(logprobs), np.log(want[np.asarray(tokens)]), atol=1e-5)
