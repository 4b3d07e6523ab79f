"""Parameters and KV cache on a (fsdp=4, tp=2) mesh of 8 fake CPU devices (tests/conftest.py)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from flexmarl_benchmarks.parity import masked_max_abs_diff, our_logits, padded_batch
from flexmarl_jax.mesh.meshes import make_mesh
from flexmarl_jax.models import functional as F
from flexmarl_jax.models.checkpoint import from_pretrained
from flexmarl_jax.models.presets import get_preset

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")

EXPECTED_SPECS = {
    ("embed", "embedding"): P("tp", "fsdp"),
    ("layers", 0, "attn", "q_proj"): P("fsdp", "tp", None),
    ("layers", 0, "attn", "k_proj"): P("fsdp", "tp", None),
    ("layers", 0, "attn", "o_proj"): P("tp", None, "fsdp"),
    ("layers", 0, "attn", "q_bias"): P("tp", None),
    ("layers", 0, "mlp", "gate_proj"): P("fsdp", "tp"),
    ("layers", 0, "mlp", "down_proj"): P("tp", "fsdp"),
    ("layers", 0, "input_norm", "scale"): P(None),
}


CONFIG = dataclasses.replace(get_preset("tiny"), num_layers=1)  # one layer: half the compile time


@functools.cache
def _mesh():
    return make_mesh(jax.devices()[:8], fsdp=4, tp=2)


@functools.cache
def _tiny(sharded: bool):
    """(graphdef, params) of CONFIG with seed 7, on the mesh or on one device; built once."""
    return F.init_params(CONFIG, seed=7, mesh=_mesh() if sharded else None)


def _flat(params):
    return {path: v.get_value() for path, v in nnx.to_flat_state(params)}


def test_init_params_creates_split_parameters_equal_to_unsharded():
    config = CONFIG
    graphdef, sharded = _tiny(sharded=True)
    _, plain = _tiny(sharded=False)
    flat, flat_plain = _flat(sharded), _flat(plain)
    for path, spec in EXPECTED_SPECS.items():
        assert flat[path].sharding.spec == spec, path
    axes = {path: v.get_metadata()["logical_axes"] for path, v in nnx.to_flat_state(sharded)}
    for path, array in flat.items():
        np.testing.assert_array_equal(np.asarray(array), np.asarray(flat_plain[path]))
        shard = array.addressable_shards[0].data
        if "embed" in axes[path] and array.ndim >= 2:  # every weight matrix split over all 8 devices
            assert shard.size * 8 == array.size, (path, shard.shape, array.shape)
        elif array.ndim == 2:  # biases [heads, head_dim]: split over tp only
            assert shard.size * 2 == array.size, (path, shard.shape, array.shape)

    tokens, mask, positions = padded_batch(config.vocab_size, (8, 3, 12, 1), seed=4)
    with jax.set_mesh(_mesh()):
        sharded_logits = our_logits(graphdef, sharded, tokens, mask, positions)
    plain_logits = our_logits(graphdef, plain, tokens, mask, positions)
    assert masked_max_abs_diff(sharded_logits, plain_logits, mask) < 1e-5


def test_from_pretrained_on_mesh_matches_unsharded_logits(hf_dirs, loaded):
    sharded = from_pretrained(hf_dirs["llama"], mesh=_mesh())
    q = _flat(sharded.params)[("layers", 0, "attn", "q_proj")]
    assert q.sharding.spec == P("fsdp", "tp", None) and q.addressable_shards[0].data.shape == (16, 2, 16)
    tokens, mask, positions = padded_batch(sharded.config.vocab_size, (8, 3, 12, 1), seed=5)
    with jax.set_mesh(_mesh()):
        got = our_logits(sharded.graphdef, sharded.params, tokens, mask, positions)
    want = our_logits(loaded["llama"].graphdef, loaded["llama"].params, tokens, mask, positions)
    assert masked_max_abs_diff(got, want, mask) < 1e-5


def test_sharded_cache_decode_and_gradients_match_unsharded():
    config = CONFIG
    graphdef, sharded = _tiny(sharded=True)
    _, plain = _tiny(sharded=False)
    sharded_cache = F.init_cache(config, 4, 16, mesh=_mesh())
    assert sharded_cache["k"].sharding.spec == P(None, "fsdp", None, "tp", None)
    prompt = jnp.asarray(np.random.default_rng(0).integers(4, 104, size=(4, 5)), jnp.int32)
    mask = jnp.asarray(np.arange(5)[None] < np.array([5, 2, 4, 3])[:, None])
    prefill = jax.jit(F.prefill, static_argnums=0)
    decode = jax.jit(F.decode_step, static_argnums=0)
    results = []
    for params, cache in ((sharded, sharded_cache), (plain, F.init_cache(config, 4, 16))):
        _, cache = prefill(graphdef, params, prompt, mask, cache)
        logits, cache = decode(graphdef, params, prompt[:, 0], jnp.array([5, 2, 4, 3], jnp.int32), cache)
        results.append(np.asarray(logits))
    np.testing.assert_allclose(results[0], results[1], atol=1e-5, rtol=0)

    def loss(params):
        logits = F.forward(graphdef, params, prompt, jnp.broadcast_to(jnp.arange(5), (4, 5)), mask)
        return -F.token_logprobs(logits[:, :-1], prompt[:, 1:]).mean()

    with jax.set_mesh(_mesh()):
        sharded_grads = jax.jit(jax.grad(loss))(sharded)
    plain_grads = jax.jit(jax.grad(loss))(plain)
    for path, g in _flat(sharded_grads).items():
        np.testing.assert_allclose(np.asarray(g), np.asarray(_flat(plain_grads)[path]), atol=1e-6, rtol=0)
