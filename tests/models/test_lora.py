"""LoRA adapters beside a frozen base (models/lora.py): a new adapter is the base, an adapter equals its merged
weights, a batch of mixed adapters equals each adapter run alone (full forward, prefill and greedy decode), and
gradients equal a plain reference's."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexmarl_jax.models import functional as F
from flexmarl_jax.models import lora, lora_targets
from flexmarl_jax.models.presets import get_preset
from tests.settings_views import lora_spec

_forward = jax.jit(F.forward, static_argnums=0, static_argnames="remat")
_prefill = jax.jit(F.prefill, static_argnums=0)
_decode_step = jax.jit(F.decode_step, static_argnums=0)
CONFIG = dataclasses.replace(get_preset("tiny"), vocab_size=128)  # Qwen2 layout: q/k/v biases, 2 layers
ALL = lora_spec(rank=4, alpha=8.0)


@functools.cache
def _base():
    return F.init_params(CONFIG, seed=0)


def _trained_adapter(spec: lora.LoraSpec, seed: int, size: float = 0.05) -> dict:
    """An adapter with nonzero B (standard deviation `size`), as after some training (a new one has B = 0)."""
    adapters = lora.init_adapters(CONFIG, spec, seed=seed)
    key = jax.random.key(1000 + seed)
    return {target: {"a": pair["a"], "b": size * jax.random.normal(jax.random.fold_in(key, i), pair["b"].shape)}
            for i, (target, pair) in enumerate(sorted(adapters.items()))}


def _batch(batch: int = 4, length: int = 7, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (batch, length)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    mask = jnp.asarray(np.arange(length)[None] < rng.integers(3, length + 1, (batch, 1)))
    return tokens, positions, mask


def _logits(adapters=None, *, batch=None, remat=False, params=None):
    graphdef, base = _base()
    tokens, positions, mask = batch or _batch()
    return _forward(graphdef, base if params is None else params, tokens, positions, mask, remat=remat,
                    adapters=adapters)


def _close(a, b, mask, atol):
    diff = float(np.max(np.abs(np.asarray(a) - np.asarray(b))[np.asarray(mask)]))
    assert diff <= atol, diff


def test_a_new_adapter_is_the_base_model():
    adapter = lora.init_adapters(CONFIG, ALL, seed=3)
    assert all(float(jnp.abs(pair["a"]).max()) > 0 and float(jnp.abs(pair["b"]).max()) == 0
               for pair in adapter.values())
    _, _, mask = _batch()
    _close(_logits(lora.stack_adapters([adapter], [ALL])), _logits(), mask, 1e-6)


@pytest.mark.parametrize("targets", [lora.TARGETS, ("q_proj", "v_proj"), ("o_proj", "down_proj")])
def test_an_adapter_gives_the_logits_of_its_merged_weights(targets):
    spec = lora.LoraSpec(rank=4, alpha=16.0, targets=targets)
    adapter = _trained_adapter(spec, seed=1)
    _, base = _base()
    merged = lora.merge_adapter(base, adapter, spec)
    _, _, mask = _batch()
    with_adapter = _logits(lora.stack_adapters([adapter], [spec]))
    _close(with_adapter, _logits(params=merged), mask, 1e-5)
    assert float(np.max(np.abs(np.asarray(with_adapter - _logits())))) > 1e-3  # the adapter does change them


def test_adapter_shapes_follow_the_base_weights_and_count():
    shapes = lora.adapter_shapes(CONFIG, lora_spec(rank=16, alpha=32.0))
    e, h, k, d, m = 64, 4, 2, 16, 192
    assert shapes["q_proj"] == ((e, 16), (16, h, d)) and shapes["k_proj"] == ((e, 16), (16, k, d))
    assert shapes["o_proj"] == ((h, d, 16), (16, e)) and shapes["down_proj"] == ((m, 16), (16, e))
    per_layer = 16 * ((e + h * d) * 2 + (e + k * d) * 2 + (e + m) * 2 + (m + e))
    adapter = lora.init_adapters(CONFIG, lora_spec(rank=16, alpha=32.0), seed=0)
    assert lora.adapter_count(adapter) == CONFIG.num_layers * per_layer


SPECS = (lora_spec(rank=2, alpha=4.0), lora.LoraSpec(rank=8, alpha=8.0, targets=("q_proj", "up_proj")),
         lora.LoraSpec(rank=4, alpha=2.0, targets=("v_proj", "o_proj", "gate_proj", "down_proj")))


def test_a_batch_of_mixed_adapters_equals_each_adapter_alone():
    """Three agents of different ranks and targets in one batch: every row as if its adapter ran alone."""
    adapters = [_trained_adapter(spec, seed=i) for i, spec in enumerate(SPECS)]
    rows = np.array([2, 0, 1, 2, 1, 0])
    batch = _batch(batch=len(rows))
    mixed = _logits(lora.stack_adapters(adapters, SPECS, rows=rows), batch=batch)
    for index, (adapter, spec) in enumerate(zip(adapters, SPECS, strict=True)):
        alone = _logits(lora.stack_adapters([adapter], [spec]), batch=batch)
        picked = rows == index
        _close(mixed[picked], alone[picked], batch[2][picked], 1e-5)


def _greedy(graphdef, params, prompts, mask, adapters, steps: int):
    """Greedy prefill + decode; returns (tokens [B, steps], log-probs [B, steps])."""
    batch, length = prompts.shape
    cache = F.init_cache(CONFIG, batch, length + steps)
    lengths = mask.sum(axis=1)
    logits, cache = _prefill(graphdef, params, prompts, mask, cache, logits_at=lengths - 1, adapters=adapters)
    logits = logits[:, 0]
    tokens, logprobs = [], []
    positions = lengths
    for _ in range(steps):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tokens.append(token)
        logprobs.append(jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=-1)[:, 0])
        logits, cache = _decode_step(graphdef, params, token, positions, cache, adapters)
        positions = positions + 1
    return np.stack(tokens, axis=1), np.stack(logprobs, axis=1)


def test_mixed_adapter_decode_equals_per_adapter_decode_token_for_token():
    adapters = [_trained_adapter(spec, seed=10 + i, size=1.0) for i, spec in enumerate(SPECS)]
    rows = np.array([1, 2, 0, 1])
    graphdef, base = _base()
    prompts, _, mask = _batch(batch=len(rows), seed=5)
    mixed_tokens, mixed_logprobs = _greedy(graphdef, base, prompts, mask,
                                           lora.stack_adapters(adapters, SPECS, rows=rows), steps=6)
    base_tokens, _ = _greedy(graphdef, base, prompts, mask, None, steps=6)
    assert (mixed_tokens != base_tokens).any()  # the adapters steer the decode
    for index, (adapter, spec) in enumerate(zip(adapters, SPECS, strict=True)):
        picked = rows == index
        tokens, logprobs = _greedy(graphdef, base, prompts[picked], mask[picked],
                                   lora.stack_adapters([adapter], [spec]), steps=6)
        np.testing.assert_array_equal(mixed_tokens[picked], tokens)
        np.testing.assert_allclose(mixed_logprobs[picked], logprobs, atol=1e-5)


def _reference_logits(adapter, spec, batch):
    """A plain reference: W + scale * A @ B written out per weight with jnp, then the base forward."""
    graphdef, base = _base()
    params = jax.tree.map(lambda x: x, base)
    for target, pair in adapter.items():
        group = "attn" if target in lora_targets.ATTENTION_TARGETS else "mlp"
        for layer in range(CONFIG.num_layers):
            weight = params["layers"][layer][group][target]
            a = pair["a"][layer].reshape(-1, spec.rank)  # [in, r]
            b = pair["b"][layer].reshape(spec.rank, -1)  # [r, out]
            weight.set_value(weight.get_value() + spec.scale * (a @ b).reshape(weight.get_value().shape))
    tokens, positions, mask = batch
    return _forward(graphdef, params, tokens, positions, mask)


@pytest.mark.parametrize("remat", [False, True])
def test_lora_gradients_equal_a_plain_reference(remat):
    spec = lora_spec(rank=4, alpha=8.0)
    adapter = _trained_adapter(spec, seed=7)
    batch = _batch(seed=3)
    tokens, _, mask = batch
    weights = jnp.asarray(np.asarray(mask, np.float32)[:, 1:])

    def objective(logits):
        return jnp.sum(F.token_logprobs(logits[:, :-1], tokens[:, 1:]) * weights)

    ours = jax.jit(jax.grad(lambda tree: objective(_logits(lora.stack_adapters([tree], [spec]), batch=batch,
                                                   remat=remat))))(adapter)
    reference = jax.jit(jax.grad(lambda tree: objective(_reference_logits(tree, spec, batch))))(adapter)
    for target in adapter:
        for name in ("a", "b"):
            expected = np.asarray(reference[target][name])
            assert np.abs(expected).max() > 1e-4, (target, name)  # a gradient that means something
            np.testing.assert_allclose(np.asarray(ours[target][name]), expected, atol=1e-5, rtol=0)


def test_gradients_of_a_mixed_batch_are_each_adapter_on_its_own_rows():
    """Training agents of one base together: each adapter's gradient from a mixed batch is its gradient on
    its own rows alone (the one-hot mix sends nothing to the others)."""
    adapters = [_trained_adapter(spec, seed=20 + i) for i, spec in enumerate(SPECS)]
    rows = np.array([0, 2, 1, 2, 0, 1])
    batch = _batch(batch=len(rows), seed=9)
    tokens, positions, mask = batch
    weights = jnp.asarray(np.asarray(mask, np.float32)[:, 1:])

    def objective(stacked, picked):
        logits = _forward(_base()[0], _base()[1], tokens[picked], positions[picked], mask[picked], remat=True,
                          adapters=stacked)
        return jnp.sum(F.token_logprobs(logits[:, :-1], tokens[picked, 1:]) * weights[picked])

    everyone = np.arange(len(rows))
    mixed = jax.jit(jax.grad(lambda trees: objective(lora.stack_adapters(trees, SPECS, rows=rows), everyone)))(
        adapters)
    for index, (adapter, spec) in enumerate(zip(adapters, SPECS, strict=True)):
        own = np.flatnonzero(rows == index)
        alone = jax.jit(jax.grad(lambda tree, spec=spec, own=own: objective(lora.stack_adapters([tree], [spec]),
                                                                            own)))(adapter)
        for target in adapter:
            for name in ("a", "b"):
                assert np.abs(np.asarray(alone[target][name])).max() > 1e-4
                np.testing.assert_allclose(np.asarray(mixed[index][target][name]),
                                           np.asarray(alone[target][name]), atol=1e-5, rtol=0)


def test_a_bfloat16_base_with_float32_adapters():
    """The base in bfloat16, the adapter (and so its gradients and optimizer state) in float32."""
    graphdef, base = _base()
    base16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)
    adapter = _trained_adapter(ALL, seed=4)
    tokens, positions, mask = _batch()
    stacked = lora.stack_adapters([adapter], [ALL])
    logits = _forward(graphdef, base16, tokens, positions, mask, adapters=stacked)
    merged = _forward(graphdef, lora.merge_adapter(base, adapter, ALL), tokens, positions, mask)
    _close(logits, merged, mask, 0.05 * float(np.abs(np.asarray(merged)).max()))  # bfloat16's precision
    grads = jax.grad(lambda tree: jnp.sum(_forward(graphdef, base16, tokens, positions, mask,
                                                   adapters=lora.stack_adapters([tree], [ALL]))))(adapter)
    assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


def test_rows_must_name_an_adapter_of_the_batch():
    adapters = [_trained_adapter(spec, seed=i) for i, spec in enumerate(SPECS[:2])]
    with pytest.raises(ValueError, match="no rows"):
        lora.stack_adapters(adapters, SPECS[:2])
    with pytest.raises(ValueError, match=r"in \[0, 2\)"):
        lora.stack_adapters(adapters, SPECS[:2], rows=[0, 2])
    with pytest.raises(ValueError, match=r"rank 8/8 \(A/B\), its spec says 2"):
        lora.stack_adapters([adapters[1]], [lora_spec(rank=2, alpha=4.0)])
    with pytest.raises(ValueError, match=r"adapters for \['up_proj'\]"):
        lora.stack_adapters([adapters[1]], [lora.LoraSpec(rank=8, alpha=4.0, targets=("q_proj",))])


@pytest.mark.parametrize("rank, alpha, targets, message", [
    (4.0, 8.0, lora.TARGETS, "rank=4.0"),
    (True, 8.0, lora.TARGETS, "rank=True"),
    (-1, 8.0, lora.TARGETS, "rank=-1"),
    (4, 0.0, lora.TARGETS, "alpha=0.0"),
    (4, None, lora.TARGETS, "alpha=None"),
    (4, 8.0, ("q_proj", "qkv_proj"), "qkv_proj"),
    (4, 8.0, (), "targets is empty"),
])
def test_bad_lora_settings_name_the_field(rank, alpha, targets, message):
    with pytest.raises(ValueError, match=message):
        lora.LoraSpec(rank=rank, alpha=alpha, targets=targets)


def test_rank_zero_is_full_fine_tuning_and_has_no_adapter():
    spec = lora_spec(rank=0)
    assert spec.scale == 0.0
    with pytest.raises(ValueError, match="rank 0"):
        lora.init_adapters(CONFIG, spec, seed=0)


@pytest.mark.parametrize("targets", [lora_targets.TARGETS, ("q_proj", "v_proj"), ("o_proj", "down_proj")])
def test_the_memory_estimates_adapter_size_is_the_real_adapters(targets):
    """lora_targets.adapter_parameter_count (pure Python, for the config's memory check) counts what
    init_adapters allocates, on a model whose query, KV and MLP widths all differ."""
    config = get_preset("tiny")
    spec = lora.LoraSpec(6, 12.0, targets)
    real = lora.adapter_count(jax.eval_shape(functools.partial(lora.init_adapters, config, spec, seed=0)))
    assert lora_targets.adapter_parameter_count(config, 6, targets) == real > 0
