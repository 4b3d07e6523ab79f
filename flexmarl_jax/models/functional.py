"""Pure-function API over the NNX decoder, used by rollout and training.

A model is a pair ``(graphdef, params)``: `graphdef` is the static structure (hashable; pass it
as a static jit argument or close over it) and `params` an ``nnx.State`` pytree of jax.Arrays.
A pure apply for training is simply::

    apply = functools.partial(forward, graphdef)          # apply(params, tokens, positions, mask)
    loss, grads = jax.value_and_grad(lambda p: loss_fn(apply(p, ...)))(params)

`grads` has the same ``nnx.State`` structure as `params`, so optax updates apply leaf-wise
(``optax.apply_updates(params, updates)``). Internally each call does ``nnx.merge(graphdef,
params)``, which only costs trace time under jit.

Decoding uses a fixed-size cache dict(k=[L, B, S, Hkv, D], v=...): compile `decode_step` once per
(batch, S) bucket, e.g. ``jax.jit(decode_step, static_argnums=0, donate_argnums=4)``, and keep
every position < S (writes past the end are dropped).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from flexmarl_jax.mesh.rules import logical_to_partition_spec
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.decoder import DecoderLM

CACHE_AXES = ("layers", "batch", "cache_length", "act_kv_heads", "head_dim")


def abstract_model(config: ModelConfig, *, dtype=jnp.float32):
    """(graphdef, abstract params) without allocating anything (shapes/dtypes/logical axes)."""
    model = nnx.eval_shape(lambda: DecoderLM(config, rngs=nnx.Rngs(0), dtype=dtype))
    return nnx.split(model)


def param_shardings(params: nnx.State, mesh: Mesh) -> nnx.State:
    """NamedSharding for every parameter from its `logical_axes` and the rules table.

    Works on real or abstract params; the result has the structure of `params` (usable as jit
    in/out_shardings and with `jax.device_put`).
    """
    mesh_shape = dict(mesh.shape)

    def one(variable):
        spec = logical_to_partition_spec(variable.get_metadata()["logical_axes"], variable.shape, mesh_shape)
        return variable.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def init_params(config: ModelConfig, *, seed: int, mesh: Mesh | None = None, dtype=jnp.float32):
    """Random-initialised (graphdef, params); on `mesh` every array is created already sharded.

    The initializer is compiled once per (config, dtype, mesh) and reused for every seed. Values do
    not depend on the mesh (partitionable threefry), so a sharded init equals the unsharded one.
    """
    graphdef, _ = abstract_model(config, dtype=dtype)
    create = _compiled_initializer(config, jnp.dtype(dtype), mesh)
    return graphdef, create(np.uint32(seed % 2**32))


@functools.lru_cache(maxsize=16)
def _compiled_initializer(config: ModelConfig, dtype, mesh: Mesh | None):
    def create(seed) -> nnx.State:
        rngs = nnx.Rngs(params=jax.random.key(seed))
        return nnx.split(DecoderLM(config, rngs=rngs, dtype=dtype))[1]

    _, abstract = abstract_model(config, dtype=dtype)
    out_shardings = None if mesh is None else param_shardings(abstract, mesh)
    lowered = jax.jit(create, out_shardings=out_shardings).lower(np.uint32(0))
    # Init runs once; XLA's CPU optimisation passes would cost several times more than they save
    # (a tiny model's init compiles in ~1 s instead of ~4 s).
    options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}
    return lowered.compile(compiler_options=options)


def causal_padding_mask(attention_mask: jax.Array) -> jax.Array:
    """[B, T] key-is-real mask -> [B, T, T]: query t sees real keys s <= t."""
    t = attention_mask.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    return causal[None] & attention_mask.astype(bool)[:, None, :]


def segment_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T] segment ids (0 = padding, k >= 1 = the k-th sequence packed into the row) -> [B, T, T]: query t sees
    keys s <= t of its own sequence only, so sequences packed into one row never attend to each other."""
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same & (segment_ids > 0)[:, None, :]


def forward(graphdef, params, tokens, positions, attention_mask, *, remat: bool = False,
            adapters=None, segment_ids=None) -> jax.Array:
    """Full-sequence logits for training and scoring.

    tokens/positions [B, T] int32, attention_mask [B, T] bool (False = padding) -> logits
    [B, T, V] float32. Causal by index within the row plus key padding. Pure and jit-able.
    remat: rematerialise each decoder layer under a gradient (same values, less memory; see DecoderLM).
    adapters: an `AdapterBatch` (models/lora.py), the LoRA adapter of every row, or None for the base model.
    segment_ids: [B, T] int32 for rows holding several sequences (train/packing.py): attention stays inside each
    sequence (`segment_causal_mask`); `positions` then restart at 0 for each.
    """
    model = nnx.merge(graphdef, params)
    mask = causal_padding_mask(attention_mask) if segment_ids is None else segment_causal_mask(segment_ids)
    logits, _ = model(tokens, positions, mask, remat=remat, adapters=adapters)
    return logits


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log softmax(logits)[targets]: logits [B, T, V], targets [B, T] int -> [B, T] float32."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def cache_shardings(mesh: Mesh, batch: int, config: ModelConfig, max_len: int) -> NamedSharding:
    """Sharding of the k/v cache arrays on `mesh` (batch over fsdp, kv heads over tp)."""
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return NamedSharding(mesh, logical_to_partition_spec(CACHE_AXES, shape, dict(mesh.shape)))


def init_cache(
    config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *, mesh: Mesh | None = None
) -> dict:
    """Zeroed KV cache dict(k=[L, B, S, Hkv, D], v=[L, B, S, Hkv, D]) with S = max_len."""
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    if mesh is None:
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
    sharding = cache_shardings(mesh, batch, config, max_len)
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return {"k": zeros(), "v": zeros()}


def prefill(graphdef, params, tokens, attention_mask, cache, *, logits_at=None, adapters=None):
    """Runs a right-padded prompt batch and writes cache rows 0..T-1.

    tokens/attention_mask [B, T] (real tokens left-aligned), positions are 0..T-1; needs S >= T.
    Returns (logits [B, T, V] float32, cache). The logits of row b's last real token,
    ``logits[b, length_b - 1]``, predict its first generated token, decoded at position length_b.
    With `logits_at` [B], the logits of that position of each row only: [B, 1, V]. `adapters`: an
    `AdapterBatch` with one row per prompt, or None.
    """
    batch, length = tokens.shape
    cache_len = cache["k"].shape[2]
    if length > cache_len:
        raise ValueError(f"prefill length {length} exceeds the cache length {cache_len}")
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, causal_padding_mask(attention_mask), cache, logits_at=logits_at,
                 adapters=adapters)


def decode_step(graphdef, params, tokens, positions, cache, adapters=None):
    """One token per slot: tokens/positions [B] int32 -> (logits [B, V] float32, cache).

    Writes k/v at ``positions[b]`` of row b, then attends to cache entries j <= positions[b];
    slots at different lengths share the batch. B may be fewer than the cache's rows: the step is then for
    its leading B rows, and the others are neither read nor written. `adapters`: an `AdapterBatch` with one row
    per slot of the step (each slot its own agent's LoRA adapter), or None.
    """
    cache_len = cache["k"].shape[2]
    positions = positions.astype(jnp.int32)
    mask = jnp.arange(cache_len, dtype=jnp.int32)[None, None, :] <= positions[:, None, None]  # [B, 1, S]
    model = nnx.merge(graphdef, params)
    logits, cache = model(tokens[:, None], positions[:, None], mask, cache, decode=True, adapters=adapters)
    return logits[:, 0], cache


def insert_cache(cache: dict, prefix: dict, slots) -> dict:
    """Copies a prefilled cache into decode slots (JetStream's "insert").

    prefix k/v [L, n, T, Hkv, D] (e.g. `prefill` on a batch of n with a cache of length T) go to
    rows `slots` [n] of `cache` [L, B, S, Hkv, D] at positions 0..T-1 (T <= S). Entries past T keep
    stale values, which decode never attends to before overwriting them. Jit-able; donate `cache`.
    """
    length = prefix["k"].shape[2]
    slots = jnp.asarray(slots, jnp.int32).reshape(-1)
    return {
        name: cache[name].at[:, slots, :length].set(prefix[name].astype(cache[name].dtype)) for name in cache
    }


def param_count(params) -> int:
    """Total number of parameters (elements) in the pytree."""
    return sum(int(x.size) for x in jax.tree.leaves(params))
