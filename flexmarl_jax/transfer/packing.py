"""Packed transfer: move many arrays as one contiguous buffer per dtype.

Syncing a model parameter by parameter spends almost all its time in per-call control
overhead (the FlexMARL paper measured > 99%); packing turns hundreds of small transfers and
dispatches into a handful.

A packed buffer for leaves that share one mesh is a global array ``[num_devices, local_size]``
whose row ``r`` lives on device ``mesh.devices.flat[r]`` and holds, back to back, the raveled
local shards that device has of every leaf of that dtype. Packing and unpacking are single
jitted ``shard_map`` calls over the whole mesh, so a move costs O(dtypes) dispatches and copies
instead of O(leaves x devices).

- ``device_to_host(arrays)``: pack on device, one host copy per dtype, unpack with numpy into
  full (unsharded) host arrays.
- ``host_to_device(host_arrays, shardings)``: pack on host, one ``device_put`` per dtype, unpack
  on the devices.
- ``device_to_device(arrays, shardings)``: same mesh shape and specs on other devices (e.g. two
  training slices): pack, one device-to-device copy per dtype, unpack; otherwise through host.

Every function takes ``packed=False`` to move leaf by leaf instead (the benchmark's baseline).
Leaves whose shardings are not all ``NamedSharding`` on one mesh also move leaf by leaf.
Limits: single-process (every shard must be addressable here).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One device's local shard of one leaf inside that device's row of a packed buffer."""
    leaf: int
    offset: int
    size: int
    local_shape: tuple[int, ...]
    index: tuple[slice, ...]
    first_copy: bool  # False for replicas of a shard already placed by another row


# Packing needs a second copy of what it packs on the devices; splitting a move into waves of at most
# this many bytes per device bounds that extra memory (each wave is packed, moved and freed in turn).
MAX_WAVE_BYTES = 256 * 2**20
# Leaves whose local shard is larger than this move on their own ("direct"): their transfer is
# bandwidth-bound already, and packing them would only add a device-side copy. Small leaves (norms,
# biases, small layers: where per-transfer control overhead dominates) are packed. XLA:CPU concatenates
# at only ~0.1-0.4 GB/s (measured on the dev machine, bf16 slowest), so on CPU the bar is lower.
MAX_PACKED_LEAF_BYTES = 2**20
MAX_PACKED_LEAF_BYTES_CPU = 64 * 2**10


def max_packed_leaf_bytes(mesh: Mesh) -> int:
    """The direct-move threshold for ``mesh``'s platform."""
    return MAX_PACKED_LEAF_BYTES_CPU if mesh.devices.flat[0].platform == "cpu" else MAX_PACKED_LEAF_BYTES


@dataclasses.dataclass(frozen=True, eq=False)  # identity hash: make_layout caches one object per layout
class PackedLayout:
    """Where every leaf's local shards sit in the packed buffers of one mesh.

    A buffer ("group") holds leaves of one dtype; a dtype with more than ``MAX_WAVE_BYTES`` per device
    spans several groups. Groups are moved in waves (a few groups per dispatch) of bounded size.
    Leaves larger than ``MAX_PACKED_LEAF_BYTES`` per device are not packed but moved on their own.
    """
    mesh: Mesh
    specs: tuple[PartitionSpec, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    groups: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, leaf numbers in buffer order)
    row_sizes: tuple[int, ...]  # local elements per device, per group
    rows: tuple[tuple[tuple[_Piece, ...], ...], ...]  # [group][row] -> pieces
    waves: tuple[tuple[int, ...], ...]  # group numbers moved together
    direct: tuple[int, ...]  # leaf numbers moved on their own (large leaves)

    @functools.cached_property
    def shardings(self) -> tuple[NamedSharding, ...]:
        return tuple(NamedSharding(self.mesh, spec) for spec in self.specs)

    @property
    def buffer_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(tuple(self.mesh.axis_names)))


def _local_shape(shape: tuple[int, ...], sharding: NamedSharding) -> tuple[int, ...]:
    return tuple(sharding.shard_shape(shape))


def _split_by_bytes(items: list[int], nbytes: dict[int, int], limit: int) -> list[list[int]]:
    """Consecutive runs of ``items`` of at most ``limit`` bytes each (an oversized item goes alone)."""
    runs: list[list[int]] = [[]]
    total = 0
    for item in items:
        if runs[-1] and total + nbytes[item] > limit:
            runs.append([])
            total = 0
        runs[-1].append(item)
        total += nbytes[item]
    return [run for run in runs if run]


@functools.lru_cache(maxsize=128)
def make_layout(mesh: Mesh, specs: tuple[PartitionSpec, ...], shapes: tuple[tuple[int, ...], ...],
                dtypes: tuple[str, ...], max_wave_bytes: int | None = None,
                max_packed_leaf_bytes: int | None = None) -> PackedLayout:
    """Builds (and caches) the packed layout for leaves of these shapes/dtypes/specs on ``mesh``."""
    limit = MAX_WAVE_BYTES if max_wave_bytes is None else max_wave_bytes
    leaf_limit = MAX_PACKED_LEAF_BYTES if max_packed_leaf_bytes is None else max_packed_leaf_bytes
    devices = list(mesh.devices.flat)
    shardings = [NamedSharding(mesh, spec) for spec in specs]
    index_maps = [s.devices_indices_map(shape) for s, shape in zip(shardings, shapes, strict=True)]
    local_shapes = [_local_shape(shape, s) for s, shape in zip(shardings, shapes, strict=True)]
    local_sizes = [int(np.prod(shape, dtype=np.int64)) for shape in local_shapes]
    local_bytes = {leaf: size * np.dtype(dtypes[leaf]).itemsize for leaf, size in enumerate(local_sizes)}
    direct = tuple(leaf for leaf in range(len(shapes)) if local_bytes[leaf] > leaf_limit)
    by_dtype: dict[str, list[int]] = {}
    for leaf, dtype in enumerate(dtypes):
        if local_bytes[leaf] <= leaf_limit:
            by_dtype.setdefault(dtype, []).append(leaf)
    groups, row_sizes, rows = [], [], []
    for dtype, leaves_of_dtype in by_dtype.items():
        for leaves in _split_by_bytes(leaves_of_dtype, local_bytes, limit):
            seen: set[tuple[int, tuple]] = set()
            group_rows = []
            for device in devices:
                pieces, offset = [], 0
                for leaf in leaves:
                    index = index_maps[leaf][device]
                    key = (leaf, tuple((s.start, s.stop) for s in index))
                    pieces.append(_Piece(leaf, offset, local_sizes[leaf], local_shapes[leaf], index,
                                         key not in seen))
                    seen.add(key)
                    offset += local_sizes[leaf]
                group_rows.append(tuple(pieces))
            groups.append((dtype, tuple(leaves)))
            row_sizes.append(offset)
            rows.append(tuple(group_rows))
    group_bytes = {g: size * np.dtype(groups[g][0]).itemsize for g, size in enumerate(row_sizes)}
    waves = _split_by_bytes(list(range(len(groups))), group_bytes, limit)
    return PackedLayout(mesh, specs, shapes, dtypes, tuple(groups), tuple(row_sizes), tuple(rows),
                        tuple(tuple(w) for w in waves), direct)


@functools.lru_cache(maxsize=256)
def _pack_fn(layout: PackedLayout, wave: int):
    """jit(shard_map): the wave's leaves -> one [num_devices, local_size] buffer per group of the wave."""
    in_leaves = sorted(leaf for g in layout.waves[wave] for leaf in layout.groups[g][1])
    position = {leaf: i for i, leaf in enumerate(in_leaves)}

    def pack_local(*local_leaves):
        return tuple(
            jnp.concatenate([local_leaves[position[leaf]].ravel() for leaf in layout.groups[g][1]])[None]
            for g in layout.waves[wave])

    row_spec = layout.buffer_sharding.spec
    packed = jax.shard_map(pack_local, mesh=layout.mesh, in_specs=tuple(layout.specs[i] for i in in_leaves),
                           out_specs=tuple(row_spec for _ in layout.waves[wave]), check_vma=False)
    return in_leaves, jax.jit(packed)


@functools.lru_cache(maxsize=256)
def _unpack_fn(layout: PackedLayout, wave: int):
    """jit(shard_map): the wave's buffers -> its leaves (ascending leaf number) with their specs."""
    first_rows = [layout.rows[g][0] for g in layout.waves[wave]]
    out_leaves = sorted(piece.leaf for pieces in first_rows for piece in pieces)
    position = {leaf: i for i, leaf in enumerate(out_leaves)}

    def unpack_local(*local_buffers):
        leaves = [None] * len(out_leaves)
        for buffer, pieces in zip(local_buffers, first_rows, strict=True):
            for piece in pieces:  # every row has the same offsets; only the values differ
                flat = buffer[0, piece.offset:piece.offset + piece.size]
                leaves[position[piece.leaf]] = flat.reshape(piece.local_shape)
        return tuple(leaves)

    row_spec = layout.buffer_sharding.spec
    unpacked = jax.shard_map(unpack_local, mesh=layout.mesh, in_specs=tuple(row_spec for _ in first_rows),
                             out_specs=tuple(layout.specs[i] for i in out_leaves), check_vma=False)
    return out_leaves, jax.jit(unpacked)


def _common_mesh(shardings: Sequence[Sharding]) -> Mesh | None:
    if not shardings or not all(isinstance(s, NamedSharding) for s in shardings):
        return None
    mesh = shardings[0].mesh
    return mesh if all(s.mesh == mesh for s in shardings) else None


def layout_for(shapes, dtypes, shardings: Sequence[Sharding]) -> PackedLayout | None:
    """The packed layout for these leaves, or None when they are not all NamedSharding on one mesh."""
    mesh = _common_mesh(shardings)
    if mesh is None:
        return None
    sizes = tuple(mesh.shape.items())
    specs = tuple(_normalized_spec(s.spec, len(shape), sizes)
                  for s, shape in zip(shardings, shapes, strict=True))
    return make_layout(mesh, specs, tuple(tuple(s) for s in shapes), tuple(np.dtype(d).name for d in dtypes),
                       max_packed_leaf_bytes=max_packed_leaf_bytes(mesh))


@functools.lru_cache(maxsize=4096)
def _normalized_spec(spec: PartitionSpec, rank: int, mesh_sizes: dict | tuple) -> PartitionSpec:
    """One spelling per arrangement: P("fsdp") == P("fsdp", None), and size-1 mesh axes dropped.

    XLA respells the shardings it outputs around size-1 axes (P(None, "fsdp") for P("tp", "fsdp"), or
    P(("fsdp", "tp")) for P("fsdp") when tp == 1); dropping them lets a moved value be recognized as
    already in place.
    """
    sizes = dict(mesh_sizes)
    entries = []
    for entry in list(spec) + [None] * (rank - len(spec)):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(axis for axis in axes if sizes.get(axis, 1) != 1)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def pack_wave(arrays: Sequence[jax.Array], layout: PackedLayout, wave: int) -> list[jax.Array]:
    """Device leaves -> the packed device buffers of one wave, in one dispatch."""
    in_leaves, fn = _pack_fn(layout, wave)
    return list(fn(*[arrays[i] for i in in_leaves]))


def unpack_wave(buffers: Sequence[jax.Array], layout: PackedLayout, wave: int, out: list) -> None:
    """Packed device buffers of one wave (on ``layout.mesh``) -> its leaves, written into ``out``."""
    out_leaves, fn = _unpack_fn(layout, wave)
    for leaf, array in zip(out_leaves, fn(*buffers), strict=True):
        out[leaf] = array


def _put_wave(buffers: Sequence, layout: PackedLayout) -> list[jax.Array]:
    return jax.device_put(list(buffers), [layout.buffer_sharding] * len(buffers))


def buffers_to_host(host_buffers: Sequence[np.ndarray], layout: PackedLayout) -> list[np.ndarray]:
    """Packed host buffers [num_devices, local_size] -> full host arrays, one numpy copy per shard."""
    hosts: list = [None] * len(layout.shapes)
    for _, leaves in layout.groups:
        for leaf in leaves:
            hosts[leaf] = np.empty(layout.shapes[leaf], dtype=layout.dtypes[leaf])
    for buffer, group_rows in zip(host_buffers, layout.rows, strict=True):
        for row, pieces in zip(buffer, group_rows, strict=True):
            for piece in pieces:
                if piece.first_copy:
                    hosts[piece.leaf][piece.index] = row[piece.offset:piece.offset + piece.size].reshape(
                        piece.local_shape)
    return hosts


def host_to_buffers(host_arrays: Sequence[np.ndarray], layout: PackedLayout) -> list[np.ndarray]:
    """Full host arrays -> packed host buffers [num_devices, local_size], one per dtype."""
    buffers = []
    for (dtype, _), row_size, group_rows in zip(layout.groups, layout.row_sizes, layout.rows, strict=True):
        buffer = np.empty((len(group_rows), row_size), dtype=dtype)
        for row, pieces in zip(buffer, group_rows, strict=True):
            for piece in pieces:
                row[piece.offset:piece.offset + piece.size] = host_arrays[piece.leaf][piece.index].reshape(-1)
        buffers.append(buffer)
    return buffers


@dataclasses.dataclass(eq=False)
class HostPacked:
    """A value held on host as packed buffers ``[num_devices, local_size]`` (one per dtype).

    Kept as it came off the devices, so moving it back onto a mesh of the same shape and specs
    (any devices) is one ``device_put`` per dtype and one unpack, with no per-leaf host work.
    """
    layout: PackedLayout
    buffers: list[np.ndarray]
    direct: dict[int, np.ndarray]  # the layout's direct leaves, as full host arrays

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers) + sum(a.nbytes for a in self.direct.values())

    def to_arrays(self) -> list[np.ndarray]:
        """Full (unsharded) host arrays, one per leaf."""
        arrays = buffers_to_host(self.buffers, self.layout)
        for leaf, array in self.direct.items():
            arrays[leaf] = array
        return arrays


def same_arrangement(a: PackedLayout, b: PackedLayout) -> bool:
    """True when buffers packed for ``a`` unpack correctly with ``b`` (same mesh shape and specs)."""
    return a is b or (a.specs == b.specs and a.shapes == b.shapes and a.dtypes == b.dtypes
                      and dict(a.mesh.shape) == dict(b.mesh.shape) and a.groups == b.groups)


def replication_overhead(layout: PackedLayout) -> float:
    """Packed bytes / unique bytes - 1: how much replicated leaves inflate the packed buffers."""
    packed = sum(len(rows) * size for rows, size in zip(layout.rows, layout.row_sizes, strict=True))
    packed_leaves = [leaf for _, leaves in layout.groups for leaf in leaves]
    unique = sum(int(np.prod(layout.shapes[leaf], dtype=np.int64)) for leaf in packed_leaves)
    return packed / max(unique, 1) - 1.0


def device_to_host_packed(arrays: Sequence[jax.Array], layout: PackedLayout) -> HostPacked:
    """Device leaves (sharded as ``layout`` says) -> packed host buffers: a dispatch and a copy per wave."""
    for leaf in layout.direct:
        arrays[leaf].copy_to_host_async()  # large leaves stream to host while the small ones are packed
    host_buffers: list[np.ndarray | None] = [None] * len(layout.groups)
    for wave, groups in enumerate(layout.waves):
        buffers = pack_wave(arrays, layout, wave)
        for buffer in buffers:
            buffer.copy_to_host_async()  # start every copy of the wave before waiting on any
        for group, buffer in zip(groups, buffers, strict=True):
            host_buffers[group] = _gather_to_host(buffer)
        del buffers  # free the wave's device copy before packing the next one
    direct = {leaf: _gather_to_host(arrays[leaf]) for leaf in layout.direct}
    return HostPacked(layout, host_buffers, direct)


def _gather_to_host(array: jax.Array) -> np.ndarray:
    """One full host copy of a sharded array, assembled shard by shard with numpy.

    ``jax.device_get`` does the same, but its assembly of bfloat16 shards runs ~5x slower than a copy.
    """
    host = np.empty(array.shape, dtype=array.dtype)
    for shard in array.addressable_shards:
        if shard.replica_id == 0:
            host[shard.index] = np.asarray(shard.data)
    return host


def host_packed_to_device(value: HostPacked, layout: PackedLayout) -> list[jax.Array]:
    """Packed host buffers -> device leaves sharded as ``layout`` says (repacks when arrangements differ)."""
    if same_arrangement(value.layout, layout):
        return _put_and_unpack(value.buffers, value.direct, layout)
    arrays = value.to_arrays()
    return _put_and_unpack(host_to_buffers(arrays, layout), arrays, layout)


def _put_and_unpack(host_buffers: Sequence[np.ndarray], direct: Sequence[np.ndarray] | dict,
                    layout: PackedLayout) -> list[jax.Array]:
    out: list = [None] * len(layout.shapes)
    for leaf in layout.direct:
        out[leaf] = jax.device_put(direct[leaf], layout.shardings[leaf])
    for wave, groups in enumerate(layout.waves):
        unpack_wave(_put_wave([host_buffers[g] for g in groups], layout), layout, wave, out)
    return out


def device_to_host(arrays: Sequence[jax.Array], *, packed: bool = True) -> list[np.ndarray]:
    """Copies device arrays to full (unsharded) host numpy arrays."""
    layout = layout_for([a.shape for a in arrays], [a.dtype for a in arrays], [a.sharding for a in arrays]) \
        if packed else None
    if layout is None:
        return [np.asarray(jax.device_get(array)) for array in arrays]
    return device_to_host_packed(arrays, layout).to_arrays()


def host_to_device(host_arrays: Sequence[np.ndarray], shardings: Sequence[Sharding], *,
                   packed: bool = True) -> list[jax.Array]:
    """Puts full host arrays onto devices with the given per-leaf shardings."""
    if len(host_arrays) != len(shardings):
        raise ValueError(f"got {len(host_arrays)} arrays but {len(shardings)} shardings")
    layout = layout_for([a.shape for a in host_arrays], [a.dtype for a in host_arrays], shardings) \
        if packed else None
    if layout is None:
        return [jax.device_put(a, s) for a, s in zip(host_arrays, shardings, strict=True)]
    buffers = host_to_buffers(host_arrays, layout)
    return with_shardings(_put_and_unpack(buffers, host_arrays, layout), shardings)


def device_to_device(arrays: Sequence[jax.Array], shardings: Sequence[Sharding], *,
                     packed: bool = True, source_layout: PackedLayout | None = None,
                     target_layout: PackedLayout | None = None) -> list[jax.Array]:
    """Moves device arrays onto new shardings (other devices, other mesh shape, or both).

    Leaves already on their target sharding are returned as they are (nothing moves). Packed,
    with the same mesh shape and specs on other devices: one device-to-device copy per dtype;
    with a different arrangement: through host. Callers that move the same tree often pass
    the layouts they cached.
    """
    if len(arrays) != len(shardings):
        raise ValueError(f"got {len(arrays)} arrays but {len(shardings)} shardings")
    if all(array.sharding == sharding or array.sharding.is_equivalent_to(sharding, array.ndim)
           for array, sharding in zip(arrays, shardings, strict=True)):
        return list(arrays)
    if not packed:
        return [jax.device_put(array, sharding) for array, sharding in zip(arrays, shardings, strict=True)]
    shapes, dtypes = [a.shape for a in arrays], [a.dtype for a in arrays]
    source = source_layout or layout_for(shapes, dtypes, [a.sharding for a in arrays])
    target = target_layout or layout_for(shapes, dtypes, shardings)
    if source is None or target is None:
        return [jax.device_put(array, sharding) for array, sharding in zip(arrays, shardings, strict=True)]
    if not same_arrangement(source, target):
        return with_shardings(host_packed_to_device(device_to_host_packed(arrays, source), target), shardings)
    out: list = [None] * len(arrays)
    for leaf in source.direct:
        out[leaf] = jax.device_put(arrays[leaf], target.shardings[leaf])
    for wave in range(len(source.waves)):
        unpack_wave(_put_wave(pack_wave(arrays, source, wave), target), target, wave, out)
    return with_shardings(out, shardings)


def with_shardings(arrays: list[jax.Array], shardings: Sequence[Sharding]) -> list[jax.Array]:
    """``arrays`` on ``shardings``: kept as they are when already equivalent, else moved.

    XLA spells some output shardings differently (it drops mesh axes of size 1: P(None, "fsdp") for
    P("tp", "fsdp") when tp == 1); equivalent shardings place every shard on the same device, so they are
    kept as they are (a relabelling device_put costs ~0.2 ms per leaf, more than the packed move itself).
    """
    return [array if array.sharding == sharding or array.sharding.is_equivalent_to(sharding, array.ndim)
            else jax.device_put(array, sharding)
            for array, sharding in zip(arrays, shardings, strict=True)]


def check_fits(shape: tuple[int, ...], sharding: Sharding, what: str) -> None:
    """Raises ValueError naming ``what`` when ``sharding`` cannot hold an array of ``shape`` evenly."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        if len(spec) > len(shape):
            raise ValueError(
                f"target sharding {sharding.spec} for {what} has {len(spec)} entries but the value has shape "
                f"{shape} (rank {len(shape)}); use a PartitionSpec with at most {len(shape)} entries")
        for dim, (size, axes) in enumerate(zip(shape, spec, strict=False)):
            if axes is None:
                continue
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            missing = [axis for axis in axes if axis not in sharding.mesh.shape]
            if missing:
                raise ValueError(
                    f"target sharding {sharding.spec} for {what} names mesh axes {missing} that the mesh "
                    f"does not have; mesh axes are {dict(sharding.mesh.shape)}")
            parts = int(np.prod([sharding.mesh.shape[axis] for axis in axes]))
            if size % parts:
                raise ValueError(
                    f"target sharding {sharding.spec} does not fit {what} with shape {shape}: "
                    f"dimension {dim} (size {size}) is not divisible by the {parts} devices of mesh "
                    f"axes {axes} (mesh {dict(sharding.mesh.shape)})")
    else:
        try:
            sharding.shard_shape(shape)
        except Exception as error:  # noqa: BLE001 - re-raised with the leaf named
            raise ValueError(
                f"target sharding {sharding} does not fit {what} with shape {shape}: {error}") from error

