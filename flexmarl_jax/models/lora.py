"""LoRA adapters kept beside a frozen base model, and batches in which every row carries its own adapter.

An adapter changes a projection ``y = x W`` to ``y = x W + (alpha / r) (x A) B``, with A ``[in, r]`` and B
``[r, out]``; B starts at zero, so a new adapter is the base model exactly. Adapters live in a tree of their own,
never inside the model's params, because the params' paths are HF names (`checkpoint.hf_name`), their logical
axes shard them and parameter counts check them.

An agent's adapter tree is ``{target: {"a": [L, *in, r], "b": [L, r, *out]}}`` with one entry per layer on the
leading axis; the in/out axes are the base weight's, head-structured like it (q/k/v's B is ``[r, heads,
head_dim]``, o's A is ``[heads, head_dim, r]``). `AdapterBatch` stacks the adapters of several agents (of one
base) on a further leading axis and picks one per row, so one forward pass runs a batch of mixed agents, as an
engine's decode slots are. Adapters of different ranks stack zero-padded to the largest: the extra columns of A
meet zero rows of B, so the padding adds exactly nothing.

With several adapters, every row's input meets every adapter's A and a one-hot mix keeps each row's own: N x r
columns of compute a projection (48 for 3 agents of rank 16; 240 for 15, against SmolLM2-135M's hidden size of
576), where a per-row gather would instead copy A and B for every decode slot; each adapter is read once a
step. (`jax.lax.ragged_dot` over rows sorted by adapter is the TPU way; on CPU it falls back to one dense dot
per group.)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.lora_rules import lora_alpha_problem, lora_rank_problem
from flexmarl_jax.models.lora_targets import TARGETS
from flexmarl_jax.models.projection import project

# The einsum of each target's base projection (models/layers.py); the adapter's two einsums derive from it.
PROJECTION_SPECS = {
    "q_proj": "bte,ehd->bthd", "k_proj": "bte,ehd->bthd", "v_proj": "bte,ehd->bthd", "o_proj": "bthd,hde->bte",
    "gate_proj": "bte,em->btm", "up_proj": "bte,em->btm", "down_proj": "btm,me->bte",
}
# The axis letter of the adapter's rank in those einsums (no base spec uses it).
_RANK = "r"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """rank (0: no adapter, the agent trains the full model), alpha (the update is scaled by alpha / rank) and
    the projections that carry an adapter. A run's come from `agents.<name>.lora` (`train/from_config.py`); the
    rank and alpha rules are the config's (`lora_rules.py`)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    def __post_init__(self):
        for name, problem in (("rank", lora_rank_problem(self.rank)), ("alpha", lora_alpha_problem(self.alpha))):
            if problem:
                raise ValueError(f"lora {name}={getattr(self, name)!r} {problem}")
        object.__setattr__(self, "rank", int(self.rank))
        object.__setattr__(self, "alpha", float(self.alpha))
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown:
            raise ValueError(f"lora targets {unknown} are not projections of the model; choose from {list(TARGETS)}")
        if self.rank and not self.targets:
            raise ValueError("lora targets is empty: name at least one projection")
        # one spelling per set of targets, so that specs compare equal whatever order they were given in
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in set(self.targets)))

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank if self.rank else 0.0


def _split_spec(target: str) -> tuple[str, str, str, str]:
    """(x axes, output axes, axes A contracts from x, axes B produces) of `target`'s base projection."""
    inputs, out = PROJECTION_SPECS[target].split("->")
    x_axes, w_axes = inputs.split(",")
    contracted = "".join(axis for axis in w_axes if axis in x_axes)
    produced = "".join(axis for axis in w_axes if axis not in x_axes)
    return x_axes, out, contracted, produced


def _weight_axes(config: ModelConfig) -> dict[str, int]:
    return {"e": config.hidden_size, "h": config.num_heads, "d": config.head_dim, "m": config.intermediate_size}


def adapter_shapes(config: ModelConfig, spec: LoraSpec) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """target -> (A's shape, B's shape) of one layer. k/v project to the KV heads, q and o to the query heads."""
    shapes = {}
    for target in spec.targets:
        sizes = _weight_axes(config)
        if target in ("k_proj", "v_proj"):
            sizes["h"] = config.num_kv_heads
        _, _, contracted, produced = _split_spec(target)
        shapes[target] = (tuple(sizes[a] for a in contracted) + (spec.rank,),
                          (spec.rank,) + tuple(sizes[a] for a in produced))
    return shapes


def init_adapters(config: ModelConfig, spec: LoraSpec, *, seed: int, dtype=jnp.float32) -> dict:
    """A new adapter: A uniform in +-1/sqrt(fan_in) (PEFT's default init), B zero, so it is the base model."""
    if not spec.rank:
        raise ValueError("rank 0 has no adapter (the agent trains the full model)")
    key = jax.random.key(seed)
    adapters = {}
    for index, (target, (a_shape, b_shape)) in enumerate(sorted(adapter_shapes(config, spec).items())):
        fan_in = int(np.prod(a_shape[:-1]))
        bound = 1.0 / np.sqrt(fan_in)
        layers = config.num_layers
        a = jax.random.uniform(jax.random.fold_in(key, index), (layers, *a_shape), jnp.float32, -bound, bound)
        adapters[target] = {"a": a.astype(dtype), "b": jnp.zeros((layers, *b_shape), dtype)}
    return adapters


def adapter_count(adapters: Mapping) -> int:
    """Number of adapter parameters (elements)."""
    return sum(int(x.size) for x in jax.tree.leaves(adapters))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdapterBatch:
    """The adapters of one forward pass.

    weights: {target: {"a": [N, L, *in, r], "b": [N, L, r, *out]}}, N adapters stacked (`stack_adapters`).
    scales: [N] float32, each adapter's alpha / rank.
    rows: [B] int32, the adapter of each row; None when every row uses the one adapter (training one agent).
    """

    weights: dict
    scales: jax.Array
    rows: jax.Array | None = None

    def layer(self, index: int) -> dict[str, tuple[jax.Array, jax.Array, jax.Array]]:
        """target -> (A, B, mix) of layer `index`. With `rows`: every adapter's A [N, *in, r] and B [N, r, *out],
        and mix [B, N] = each row's scale on its own adapter and 0 on the others; without: the one adapter's A
        [*in, r], B [r, *out] and its scale."""
        if self.rows is None and self.scales.shape[0] != 1:
            raise ValueError(f"{self.scales.shape[0]} adapters and no rows: say which adapter each row uses")
        if self.rows is None:
            return {target: (pair["a"][0, index], pair["b"][0, index], self.scales[0])
                    for target, pair in self.weights.items()}
        count = self.scales.shape[0]
        mix = jax.nn.one_hot(self.rows, count, dtype=jnp.float32) * self.scales[None, :]
        return {target: (pair["a"][:, index], pair["b"][:, index], mix) for target, pair in self.weights.items()}


def checked_adapter(tree: Mapping, spec: LoraSpec, where: str) -> Mapping:
    """`tree` if its targets are among `spec`'s and its rank is `spec.rank`; else a ValueError naming `where`."""
    extra = sorted(set(tree) - set(spec.targets))
    if extra:
        raise ValueError(f"{where} has adapters for {extra}, which its spec's targets {list(spec.targets)} lack")
    for target, pair in tree.items():
        if pair["a"].shape[-1] != spec.rank or pair["b"].shape[1] != spec.rank:
            raise ValueError(f"{where}: {target} has rank {pair['a'].shape[-1]}/{pair['b'].shape[1]} (A/B), its "
                             f"spec says {spec.rank}")
    return tree


def stack_adapters(adapters: Sequence[Mapping], specs: Sequence[LoraSpec], rows=None) -> AdapterBatch:
    """An `AdapterBatch` of several agents' adapters (one base). Ranks may differ: each is zero-padded to the
    largest, which changes no output. Targets may differ too: a target an adapter lacks is zero for it.
    `rows` [B]: the adapter of each row, each in [0, len(adapters)); it may be None for a single adapter."""
    if not adapters or len(adapters) != len(specs):
        raise ValueError(f"{len(adapters)} adapters for {len(specs)} specs: give one spec per adapter, at least one")
    if rows is None and len(adapters) > 1:
        raise ValueError(f"{len(adapters)} adapters and no rows: say which adapter each row uses")
    if isinstance(rows, (list, tuple, np.ndarray)):  # traced rows cannot be checked here
        concrete = np.asarray(rows)
        if concrete.size and (concrete.min() < 0 or concrete.max() >= len(adapters)):
            raise ValueError(f"rows must each be in [0, {len(adapters)}), got {concrete.tolist()}")
    table = adapter_table(adapters, specs)
    return AdapterBatch(table.weights, table.scales, None if rows is None else jnp.asarray(rows, jnp.int32))


def adapter_table(adapters: Sequence[Mapping], specs: Sequence[LoraSpec], *, rank: int | None = None
                  ) -> AdapterBatch:
    """The adapters stacked without rows: the table an engine serving several agents of one base holds
    (`AdaptedParams`), each prompt and decode slot naming its row. `rank` (default the largest) leaves room
    for later adapters of up to that rank (`replace_adapter`)."""
    if not adapters or len(adapters) != len(specs):
        raise ValueError(f"{len(adapters)} adapters for {len(specs)} specs: give one spec per adapter, at least one")
    adapters = [checked_adapter(tree, spec, f"adapter {index}")
                for index, (tree, spec) in enumerate(zip(adapters, specs, strict=True))]
    largest = max(spec.rank for spec in specs)
    if rank is not None and rank < largest:
        raise ValueError(f"table rank {rank} is below its largest adapter's rank {largest}")
    rank = largest if rank is None else int(rank)
    weights = {}
    for target in sorted({target for tree in adapters for target in tree}):
        template = next(tree[target] for tree in adapters if target in tree)
        a_zero = jnp.zeros(template["a"].shape[:-1] + (rank,), template["a"].dtype)
        b_zero = jnp.zeros(template["b"].shape[:1] + (rank,) + template["b"].shape[2:], template["b"].dtype)
        weights[target] = {
            "a": jnp.stack([_pad_rank(tree[target]["a"], -1, rank) if target in tree else a_zero
                            for tree in adapters]),
            "b": jnp.stack([_pad_rank(tree[target]["b"], 1, rank) if target in tree else b_zero
                            for tree in adapters]),
        }
    scales = jnp.asarray([spec.scale for spec in specs], jnp.float32)
    return AdapterBatch(weights, scales)


def replace_adapter(batch: AdapterBatch, index: int, adapter: Mapping, spec: LoraSpec) -> AdapterBatch:
    """`batch` with adapter `index` replaced by `adapter` and its scale by `spec.scale`, the others untouched
    (`adapter_row` checks and pads it, `write_adapter_row` writes it)."""
    return write_adapter_row(batch, index, adapter_row(batch, index, adapter, spec), spec.scale)


def adapter_row(batch: AdapterBatch, index: int, adapter: Mapping, spec: LoraSpec) -> dict:
    """`adapter` shaped as row `index` of the table `batch`: zero-padded to the table's rank, zero for a target
    of the table it lacks. A rank above the table's, or a target the table lacks, is a ValueError: the table's
    shapes, and with them an engine's compiled steps, stay as they are."""
    checked_adapter(adapter, spec, f"adapter {index}")
    count, rank = int(batch.scales.shape[0]), _table_rank(batch)
    if not 0 <= int(index) < count:
        raise ValueError(f"adapter index {index} is outside the table's {count} adapters")
    if spec.rank > rank:
        raise ValueError(f"an adapter of rank {spec.rank} does not fit a table of rank {rank}")
    missing = sorted(set(adapter) - set(batch.weights))
    if missing:
        raise ValueError(f"adapter {index} has targets {missing}, which the table lacks")
    # Padded where the adapter already is (a weight sync places it on the engine's devices): no trip to the host.
    row = {}
    for target, pair in batch.weights.items():
        if target in adapter:
            row[target] = {"a": _pad_rank(adapter[target]["a"], -1, rank),
                           "b": _pad_rank(adapter[target]["b"], 1, rank)}  # write_adapter_row casts
        else:
            row[target] = {name: jnp.zeros(pair[name].shape[1:], pair[name].dtype) for name in ("a", "b")}
    return row


def _pad_rank(array, rank_axis: int, rank: int) -> jax.Array:
    """`array` zero-padded along `rank_axis` to `rank` (zero rank columns change no output)."""
    array = jnp.asarray(array)
    if array.shape[rank_axis] == rank:  # the usual case; an eager jnp.pad costs ~0.3 ms even when it pads nothing
        return array
    pad = [(0, 0)] * array.ndim
    pad[rank_axis] = (0, rank - array.shape[rank_axis])
    return jnp.pad(array, pad)


def write_adapter_row(batch: AdapterBatch, index, row: Mapping, scale) -> AdapterBatch:
    """The table with row `index` set to `row` (from `adapter_row`) and its scale to `scale`. Jittable with a
    traced index (one compile for every row); donate `batch` to write the table in place."""
    weights = {target: {name: pair[name].at[index].set(row[target][name].astype(pair[name].dtype))
                        for name in ("a", "b")} for target, pair in batch.weights.items()}
    return AdapterBatch(weights, batch.scales.at[index].set(jnp.asarray(scale, jnp.float32)), batch.rows)


def _table_rank(batch: AdapterBatch) -> int:
    return int(next(iter(batch.weights.values()))["a"].shape[-1])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdaptedParams:
    """What an engine that serves several LoRA agents of one base decodes with: the frozen base params, once,
    and a table of adapters (an `AdapterBatch` without rows) from which each prompt and each decode slot
    takes its own row (rollout/engine.py)."""

    base: Any
    table: AdapterBatch

    @property
    def adapters(self) -> int:
        return int(self.table.scales.shape[0])


@functools.partial(jax.tree_util.register_dataclass, data_fields=["adapter"], meta_fields=["spec"])
@dataclasses.dataclass(frozen=True)
class AgentAdapter:
    """What a LoRA agent's weight sync sends: its adapter tree and spec, not the model. The engines of its base
    group hold the base once and write this into the agent's row of their table (rollout/instance.py). A pytree
    (the spec static), so the weight sync's StateStore stages it like any params."""

    adapter: Any
    spec: LoraSpec


def project_with_adapter(target: str, x: jax.Array, w: jax.Array, adapter=None) -> jax.Array:
    """The base projection of `target` plus, with `adapter` = (A, B, mix or scale) from `AdapterBatch.layer`,
    the adapters' update: for one adapter ``scale (x A) B``; for N, every row's input meets every adapter's A
    (N x rank columns), the one-hot `mix` keeps each row's own adapter with its scale, and B maps back. That
    reads each adapter once per step, where gathering a copy of A and B for every row would move slots x adapter
    bytes per layer. The scale is applied in float32 to the rank-sized activations."""
    spec = PROJECTION_SPECS[target]
    y = project(spec, x, w)
    if adapter is None:
        return y
    a, b, mix = adapter
    x_axes, out, contracted, produced = _split_spec(target)
    kept = "".join(axis for axis in x_axes if axis in out)
    if mix.ndim == 0:  # one adapter for every row
        low = project(f"{x_axes},{contracted}{_RANK}->{kept}{_RANK}", x, a).astype(jnp.float32) * mix
        delta = project(f"{kept}{_RANK},{_RANK}{produced}->{out}", low.astype(b.dtype), b)
    else:  # "n" indexes the adapters; mix [B, N] is each row's scale on its own adapter, 0 on the others
        low = project(f"{x_axes},n{contracted}{_RANK}->{kept}n{_RANK}", x, a).astype(jnp.float32)
        low = low * mix.reshape(mix.shape[:1] + (1,) * (len(kept) - 1) + mix.shape[1:] + (1,))
        delta = project(f"{kept}n{_RANK},n{_RANK}{produced}->{out}", low.astype(b.dtype), b)
    return y + delta.astype(y.dtype)


def merge_adapter(params: nnx.State, adapters: Mapping, spec: LoraSpec) -> nnx.State:
    """The base params with the adapter folded in (W + scale A B, computed in float32, stored in W's dtype):
    the model a merged export writes."""
    checked_adapter(adapters, spec, "the adapter")
    merged = []
    for path, variable in nnx.to_flat_state(params):
        target = path[-1]
        if len(path) == 4 and path[0] == "layers" and target in adapters:
            _, _, contracted, produced = _split_spec(target)
            a, b = (adapters[target][name][path[1]].astype(jnp.float32) for name in ("a", "b"))
            update = jnp.einsum(f"{contracted}{_RANK},{_RANK}{produced}->{contracted}{produced}", a, b)
            weight = variable.get_value()
            variable = variable.replace((weight.astype(jnp.float32) + spec.scale * update).astype(weight.dtype))
        merged.append((path, variable))
    return nnx.from_flat_state(merged)
