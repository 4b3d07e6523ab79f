"""The one table that maps logical axis names (on parameters, activations, KV cache) to mesh axes.

Model code names axes by meaning ("embed", "q_heads", "batch"); this table decides which mesh
axis ("fsdp" or "tp") splits each. FSDP shards the embedding dimension of every weight and the
batch of activations; tensor parallelism shards heads, the MLP width and the vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
from jax.sharding import PartitionSpec

MESH_AXES = ("fsdp", "tp")

LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    # parameters
    ("vocab", "tp"),
    ("embed", "fsdp"),
    ("q_heads", "tp"),
    ("kv_heads", "tp"),
    ("head_dim", None),
    ("mlp", "tp"),
    ("norm", None),
    # activations
    ("batch", "fsdp"),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tp"),
    ("act_kv_heads", "tp"),
    ("act_mlp", "tp"),
    ("act_vocab", "tp"),
    # KV cache [layers, batch, cache_length, kv_heads, head_dim]
    ("layers", None),
    ("cache_length", None),
)
_RULES = dict(LOGICAL_AXIS_RULES)


def logical_to_partition_spec(
    names: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh_shape: Mapping[str, int] | None = None,
) -> PartitionSpec:
    """PartitionSpec for an array whose axes carry logical `names`.

    With `shape` and `mesh_shape` ({axis: size}) given, a mesh axis is dropped (the dim is
    replicated) where the mesh lacks it or its size does not divide the dim, so e.g. 2 KV heads
    on tp=4 replicate instead of failing. A mesh axis is used at most once per array.
    """
    unknown = [n for n in names if n is not None and n not in _RULES]
    if unknown:
        raise ValueError(f"logical axis names {unknown} have no rule; known: {sorted(_RULES)}")
    used: set[str] = set()
    spec = []
    for i, name in enumerate(names):
        axis = _RULES.get(name) if name is not None else None
        if axis is not None and mesh_shape is not None:
            size = mesh_shape.get(axis)
            if size is None or (shape is not None and shape[i] % size):
                axis = None
        if axis in used:
            axis = None
        if axis is not None:
            used.add(axis)
        spec.append(axis)
    return PartitionSpec(*spec)


def with_logical_constraint(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation when a mesh is set (`jax.set_mesh`); no-op otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_partition_spec(names, x.shape, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(x, spec)
