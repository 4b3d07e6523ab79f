"""Full forward vs cached prefill + decode, log-probs, gradients (tests/models/test_functional.py)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flexmarl_jax.models import functional as F
from flexmarl_jax.models.presets import get_preset

LLAMA_LIKE = dataclasses.replace(
    get_preset("tiny"),
    num_layers=1,  # one layer keeps compile time down; the Qwen2 case covers layer stacking
    architecture="LlamaForCausalLM",
    qkv_bias=False,
    tie_word_embeddings=False,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
)
QWEN3_LIKE = dataclasses.replace(
    get_preset("tiny"), num_layers=1, architecture="Qwen3ForCausalLM", qkv_bias=False, qk_norm=True
)

forward = jax.jit(F.forward, static_argnums=0)
prefill = jax.jit(F.prefill, static_argnums=0)
decode_step = jax.jit(F.decode_step, static_argnums=0, donate_argnums=4)


@functools.cache
def _model(config):
    return F.init_params(config, seed=1)


@pytest.mark.parametrize(
    "config", [get_preset("tiny"), LLAMA_LIKE, QWEN3_LIKE], ids=["qwen2", "llama", "qwen3"]
)
def test_prefill_then_32_decode_steps_reproduce_full_forward(config):
    graphdef, params = _model(config)
    rng = np.random.default_rng(0)
    prompt_lengths = np.array([3, 7, 12])
    steps = 32
    batch, prompt_width = len(prompt_lengths), int(prompt_lengths.max())
    full_width = prompt_width + steps
    tokens = rng.integers(4, config.vocab_size, size=(batch, full_width)).astype(np.int32)

    # Reference: each sequence is prompt + 32 tokens, right-padded to one width.
    total = prompt_lengths + steps
    full_mask = np.arange(full_width)[None] < total[:, None]
    positions = np.broadcast_to(np.arange(full_width), (batch, full_width)).astype(np.int32)
    reference = np.asarray(forward(graphdef, params, jnp.asarray(tokens), positions, jnp.asarray(full_mask)))

    prompt_mask = np.arange(prompt_width)[None] < prompt_lengths[:, None]
    prompt_tokens = np.where(prompt_mask, tokens[:, :prompt_width], 0)
    cache = F.init_cache(config, batch, full_width + 4)
    prefill_logits, cache = prefill(
        graphdef, params, jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask), cache
    )
    prefill_logits = np.asarray(prefill_logits)
    for b, n in enumerate(prompt_lengths):
        np.testing.assert_allclose(prefill_logits[b, :n], reference[b, :n], atol=1e-4, rtol=0)

    worst = 0.0
    for step in range(steps):
        pos = prompt_lengths + step
        step_tokens = tokens[np.arange(batch), pos]
        logits, cache = decode_step(
            graphdef, params, jnp.asarray(step_tokens), jnp.asarray(pos, jnp.int32), cache
        )
        expected = reference[np.arange(batch), pos]
        worst = max(worst, float(np.abs(np.asarray(logits) - expected).max()))
    assert worst < 1e-4, worst


def test_right_or_left_padding_does_not_change_real_logits():
    graphdef, params = _model(get_preset("tiny"))
    rng = np.random.default_rng(1)
    tokens = rng.integers(4, 104, size=(1, 9)).astype(np.int32)
    positions = np.arange(9, dtype=np.int32)[None]
    alone = forward(graphdef, params, tokens, positions, np.ones((1, 9), bool))
    padded_tokens = np.concatenate([tokens, rng.integers(4, 104, size=(1, 5)).astype(np.int32)], axis=1)
    padded_mask = np.arange(14)[None] < 9
    padded = forward(graphdef, params, padded_tokens, np.arange(14, dtype=np.int32)[None], padded_mask)
    np.testing.assert_allclose(np.asarray(padded)[:, :9], np.asarray(alone), atol=1e-5, rtol=0)
    # Left padding works too when positions count real tokens only.
    left_tokens = np.concatenate([np.zeros((1, 5), np.int32), tokens], axis=1)
    left_positions = np.concatenate([np.zeros((1, 5), np.int32), positions], axis=1)
    left = forward(graphdef, params, left_tokens, left_positions, np.arange(14)[None] >= 5)
    assert np.isfinite(np.asarray(left)).all()
    np.testing.assert_allclose(np.asarray(left)[:, 5:], np.asarray(alone), atol=1e-5, rtol=0)


def test_token_logprobs_equals_log_softmax_gather_and_normalises():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(2, 5, 11)) * 3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 11, size=(2, 5)), jnp.int32)
    got = np.asarray(F.token_logprobs(logits, targets))
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(
        got, np.take_along_axis(ref, np.asarray(targets)[..., None], -1)[..., 0], atol=1e-6
    )
    all_targets = np.stack([F.token_logprobs(logits, jnp.full((2, 5), v, jnp.int32)) for v in range(11)])
    np.testing.assert_allclose(np.exp(all_targets).sum(0), 1.0, atol=1e-5)


def test_gradients_flow_to_every_parameter():
    config = get_preset("tiny")
    graphdef, params = _model(config)
    tokens = jnp.asarray(np.random.default_rng(3).integers(4, 104, size=(2, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    mask = jnp.ones((2, 6), bool)

    def loss(p):
        logits = F.forward(graphdef, p, tokens[:, :-1], positions[:, :-1], mask[:, :-1])
        return -F.token_logprobs(logits, tokens[:, 1:]).mean()

    value, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert np.isfinite(float(value))
    assert abs(float(value) - np.log(config.vocab_size)) < 0.5  # random init is near uniform
    norms = [float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)]
    assert len(norms) == len(jax.tree.leaves(params)) and min(norms) > 0
    assert F.param_count(params) == config.num_params()


def test_prefill_longer_than_cache_is_rejected():
    config = get_preset("tiny")
    graphdef, params = _model(config)
    with pytest.raises(ValueError, match="exceeds the cache length 4"):
        F.prefill(
            graphdef, params, jnp.zeros((1, 6), jnp.int32), jnp.ones((1, 6), bool), F.init_cache(config, 1, 4)
        )


def test_prefill_per_request_then_insert_into_slots_matches_batched_decode():
    """The rollout pattern: prefill each request alone (own small cache), insert, decode together."""
    config = get_preset("tiny")
    graphdef, params = _model(config)
    rng = np.random.default_rng(4)
    lengths = [4, 2]
    prompts = [rng.integers(4, 104, size=(1, 6)).astype(np.int32) for _ in lengths]
    big = F.init_cache(config, 3, 16)
    for slot, (prompt, n) in zip([2, 0], zip(prompts, lengths, strict=True), strict=True):
        mask = np.arange(6)[None] < n
        _, small = prefill(graphdef, params, prompt, mask, F.init_cache(config, 1, 6))
        big = jax.jit(F.insert_cache)(big, small, jnp.array([slot]))
    next_tokens = jnp.array([prompts[1][0, 1], 7, prompts[0][0, 2]], jnp.int32)
    positions = jnp.array([lengths[1], 0, lengths[0]], jnp.int32)
    logits, _ = decode_step(graphdef, params, next_tokens, positions, big)

    # Reference: both sequences (prompt + next token) right-padded in one full forward.
    width = max(lengths) + 1
    sequences = np.zeros((2, width), np.int32)
    for row, (slot, prompt, n) in enumerate(((2, prompts[0], lengths[0]), (0, prompts[1], lengths[1]))):
        sequences[row, :n] = prompt[0, :n]
        sequences[row, n] = np.asarray(next_tokens)[slot]
    masks = np.arange(width)[None] <= np.array(lengths)[:, None]
    full = np.asarray(
        forward(graphdef, params, sequences, np.tile(np.arange(width, dtype=np.int32), (2, 1)), masks)
    )
    np.testing.assert_allclose(np.asarray(logits)[2], full[0, lengths[0]], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(logits)[0], full[1, lengths[1]], atol=1e-4, rtol=0)


def _grad_step(graphdef, remat: bool):
    """jit(grad) of the summed token log-probs of a full forward, with or without per-layer remat."""

    def loss(params, tokens, positions, mask):
        logits = F.forward(graphdef, params, tokens, positions, mask, remat=remat)
        return jnp.sum(F.token_logprobs(logits, tokens))

    return jax.jit(jax.value_and_grad(loss))


def test_remat_keeps_loss_and_gradients_and_lowers_peak_memory():
    config = dataclasses.replace(get_preset("tiny"), num_layers=4)
    graphdef, params = F.init_params(config, seed=3)
    rows, length = 8, 256  # attention dominates: each layer keeps [8, 4, 256, 256] float32 scores
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (rows, length)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
    mask = jnp.asarray(np.arange(length)[None] < rng.integers(length // 2, length + 1, (rows, 1)))
    results, temp_bytes = {}, {}
    for remat in (False, True):
        compiled = _grad_step(graphdef, remat).lower(params, tokens, positions, mask).compile()
        temp_bytes[remat] = compiled.memory_analysis().temp_size_in_bytes
        results[remat] = compiled(params, tokens, positions, mask)
    (loss, grads), (remat_loss, remat_grads) = results[False], results[True]
    np.testing.assert_allclose(float(remat_loss), float(loss), rtol=1e-6)
    for plain, rematted in zip(jax.tree.leaves(grads), jax.tree.leaves(remat_grads), strict=True):
        # Summation order differs between the two programs; in float32 its error scales with the leaf's largest
        # entries (~200 here), not with the entry compared: an entry of 0.55 came out 1.1e-5 apart.
        scale = float(np.max(np.abs(plain)))
        np.testing.assert_allclose(np.asarray(rematted), np.asarray(plain), rtol=1e-5, atol=1e-6 * scale)
    # 4 layers' activations vs one layer's plus the layer inputs: measured 149 MiB -> 44 MiB.
    assert temp_bytes[True] < 0.5 * temp_bytes[False], temp_bytes


def test_remat_is_for_the_cache_free_forward():
    graphdef, params = _model(QWEN3_LIKE)
    model = nnx.merge(graphdef, params)
    cache = F.init_cache(QWEN3_LIKE, 1, 4)
    with pytest.raises(ValueError, match="remat is for the training forward pass"):
        model(jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4, 4), bool), cache,
              remat=True)


def test_bfloat16_params_compute_in_bfloat16_with_float32_logits():
    graphdef, params = F.init_params(QWEN3_LIKE, seed=1, dtype=jnp.bfloat16)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    _, params32 = F.init_params(QWEN3_LIKE, seed=1)
    tokens = jnp.arange(12, dtype=jnp.int32)[None] % QWEN3_LIKE.vocab_size
    positions = jnp.arange(12, dtype=jnp.int32)[None]
    mask = jnp.ones((1, 12), bool)
    logits = forward(graphdef, params, tokens, positions, mask)
    logits32 = forward(graphdef, params32, tokens, positions, mask)
    assert logits.dtype == jnp.float32
    # same weights rounded to bfloat16: log-probs agree to bfloat16 precision, not float32's
    lp, lp32 = F.token_logprobs(logits, tokens), F.token_logprobs(logits32, tokens)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lp32), atol=0.05)
    assert float(jnp.max(jnp.abs(lp - lp32))) > 1e-6
