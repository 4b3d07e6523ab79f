"""StateStore: a location-agnostic key -> pytree store over device meshes, host memory and Orbax storage.

Weight sync (train mesh -> rollout mesh), instance migration and trainer swap-in/out all move state
through this one interface, so none of them needs to know where a value currently lives:

    store.set("solver/trainer", state)              # lives where its arrays are (device) or host (numpy)
    store.evict("solver/trainer", "host")          # device memory freed; packed buffers on host
    state = store.get("solver/trainer", slice_mesh) # back on any mesh, resharded as needed
    store.evict("solver/trainer", "storage")       # an Orbax checkpoint directory (local path or gs://)

A value lives in exactly one tier at a time ("device", "host" or "storage"). ``get`` copies it onto
the requested devices and leaves it where it is; ``get(..., move=True)`` makes the returned device
copy the stored value (swap-in). ``set`` hands the arrays to the store: evicting or deleting the key
frees them (``jax.Array.delete``), so arrays obtained earlier from the store for that key must not be
used afterwards (that is what guarantees device memory really is released). Arrays that another key
of the same store also holds are not freed.

Values on a mesh that spans processes (a training mesh over several hosts) live in every tier too: on host each
process keeps its own shards (`across_processes.LocalShards`, put back on the same mesh only), and a get onto
this process's devices gathers the value first, a computation every process of the mesh must issue in the same
order (`across_processes.replicate_to_local`). The storage tier is Orbax, whose multi-process API has every
process write its own shards.

Targets for ``get``: a single ``Sharding`` for every leaf, a ``Mesh`` (every leaf keeps the
PartitionSpec it last had on a device, or is replicated if it never was on one), or a pytree of
shardings with the value's structure (or a prefix of it). Non-array leaves (e.g. ``policy_version``
ints) are kept as they are in every tier.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from flexmarl_jax.transfer import across_processes, packing
from flexmarl_jax.transfer.across_processes import (
    LocalShards,
    local_shards,
    rebuild,
    spans_processes,
)

logger = logging.getLogger(__name__)

TIERS = ("device", "host", "storage")
# Packed host buffers keep one copy of a replicated leaf per device; beyond this overhead the host
# copy is stored unpacked (one full array per leaf) instead.
MAX_PACKED_REPLICATION_OVERHEAD = 0.25
_METADATA_FILE = "flexmarl_state.json"


@dataclasses.dataclass
class _Entry:
    """One stored value: its structure, leaf metadata, and its payload in exactly one tier."""
    treedef: Any
    paths: list[str]  # jax.tree_util.keystr of every leaf, for error messages
    array_positions: list[int]  # leaf positions that are arrays (the rest are static python values)
    statics: dict[int, Any]
    shapes: list[tuple[int, ...]]  # per array leaf
    dtypes: list[np.dtype]
    specs: list[PartitionSpec | None]  # last PartitionSpec each array leaf had on a device
    tier: str
    device_leaves: list[jax.Array] | None = None
    host_value: packing.HostPacked | list[np.ndarray | LocalShards] | None = None
    storage_path: epath.Path | None = None

    @property
    def array_paths(self) -> list[str]:
        return [self.paths[p] for p in self.array_positions]

    @property
    def nbytes(self) -> int:
        sizes = [int(np.prod(shape, dtype=np.int64)) for shape in self.shapes]
        return sum(size * np.dtype(d).itemsize for size, d in zip(sizes, self.dtypes, strict=True))


def _is_array(leaf) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


class StateStore:
    """Key -> pytree store; each value lives on a device mesh, in host memory, or in Orbax storage.

    storage_root: directory (local path or ``gs://bucket/...``) for the "storage" tier; each key is
        written to ``<storage_root>/<key>/<write number>``. Without it, evicting to storage needs ``path``.
    packed: move values as packed per-dtype buffers (default) or leaf by leaf (for comparison).
    """

    def __init__(self, storage_root: str | None = None, *, packed: bool = True):
        self._storage_root = epath.Path(storage_root) if storage_root is not None else None
        self.packed = packed
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.RLock()  # guards the dict and every move (moves of one store serialize)
        self._writes = 0

    # ------------------------------------------------------------------------------------ queries

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def where(self, key: str) -> str:
        """The tier the value of ``key`` lives in: "device", "host" or "storage"."""
        with self._lock:
            return self._entry(key).tier

    def nbytes(self, key: str) -> int:
        """Bytes of the array leaves of ``key`` (one copy, regardless of sharding/replication)."""
        with self._lock:
            return self._entry(key).nbytes

    def storage_path(self, key: str) -> str | None:
        """The Orbax checkpoint directory holding ``key`` (None unless it lives in storage)."""
        with self._lock:
            path = self._entry(key).storage_path
            return None if path is None else str(path)

    # ------------------------------------------------------------------------------------ writes

    def set(self, key: str, value: Any) -> None:
        """Stores ``value`` (a pytree of jax.Arrays -> "device" tier, of numpy arrays -> "host" tier).

        Replaces any previous value of ``key`` (its storage checkpoint is removed; its device arrays
        are dropped, not deleted, since the caller may be replacing them with arrays derived from them).
        """
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty string, got {key!r}")
        leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(value)
        paths = [jax.tree_util.keystr(path) for path, _ in leaves_with_paths]
        leaves = [leaf for _, leaf in leaves_with_paths]
        array_positions = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
        arrays = [leaves[i] for i in array_positions]
        on_device = [isinstance(a, jax.Array) for a in arrays]
        if any(on_device) and not all(on_device):
            mixed = [paths[p] for p, dev in zip(array_positions, on_device, strict=True) if not dev][:3]
            raise ValueError(f"value for key {key!r} mixes jax.Arrays and host arrays (host leaves e.g. "
                             f"{mixed}); put it all on devices or all on host first")
        entry = _Entry(
            treedef=treedef, paths=paths, array_positions=array_positions,
            statics={i: leaf for i, leaf in enumerate(leaves) if not _is_array(leaf)},
            shapes=[tuple(a.shape) for a in arrays], dtypes=[np.dtype(a.dtype) for a in arrays],
            specs=[_spec_of(a) for a in arrays], tier="host")
        if arrays and all(on_device):
            entry.tier, entry.device_leaves = "device", list(arrays)
        else:
            entry.host_value = [np.asarray(a) for a in arrays]
        with self._lock:
            old = self._entries.get(key)
            self._entries[key] = entry
            if old is not None:
                self._remove_storage(old)

    def delete(self, key: str) -> None:
        """Forgets ``key``: frees its device arrays and removes its storage checkpoint."""
        with self._lock:
            entry = self._entry(key)
            del self._entries[key]
            self._free_device(entry)
            self._remove_storage(entry)

    def evict(self, key: str, tier: str, *, path: str | None = None,
              target: Sharding | Mesh | Any | None = None) -> None:
        """Moves the value of ``key`` to ``tier``; leaving the device tier frees the device memory.

        tier "host": packed host buffers (or full arrays). tier "storage": an Orbax checkpoint under
        ``storage_root`` or at ``path``. tier "device": needs ``target`` (same forms as ``get``).
        """
        if tier not in TIERS:
            raise ValueError(f"tier={tier!r}; allowed tiers: {', '.join(TIERS)}")
        with self._lock:
            entry = self._entry(key)
            if tier == "device":
                if target is None:
                    raise ValueError(f"evict({key!r}, 'device') needs target= (a Sharding, a Mesh or a "
                                     f"sharding pytree); the value now lives in {entry.tier!r}")
                self._get_locked(key, entry, target, move=True)
            elif tier == "host":
                self._to_host(entry)
            elif entry.tier != "storage" or path is not None:
                self._to_storage(key, entry, path)

    def get(self, key: str, target: Sharding | Mesh | Any | None = None, *, move: bool = False) -> Any:
        """The value of ``key`` placed on ``target``, from whichever tier it lives in.

        target: a Sharding (every leaf), a Mesh (every leaf keeps its last PartitionSpec), a pytree of
            shardings (the value's structure or a prefix of it), or None: device values as they are,
            host and storage values as numpy arrays.
        move: also make the returned device copy the stored value (the old copy is freed). Without
            ``move`` the value stays where it lives; a device value already on ``target`` is returned
            without a copy (the same arrays).
        Raises KeyError for an unknown key and ValueError when the target does not fit a leaf.
        """
        with self._lock:
            return self._get_locked(key, self._entry(key), target, move=move)

    # ----------------------------------------------------------------------------------- internals

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            known = ", ".join(repr(k) for k in sorted(self._entries)) or "none"
            raise KeyError(f"no value stored under key {key!r}; known keys: {known}") from None

    def _get_locked(self, key: str, entry: _Entry, target, *, move: bool) -> Any:
        if target is None:
            if move:
                raise ValueError(f"get({key!r}, move=True) needs a target to move to")
            if entry.tier == "device":
                return self._rebuild(entry, entry.device_leaves)
            return self._rebuild(entry, self._host_arrays(entry))
        shardings = self._resolve_target(key, entry, target)
        if entry.tier == "device":
            leaves = self._device_to_device(entry.device_leaves, shardings)
        elif entry.tier == "host":
            leaves = self._host_to_device(entry, shardings)
        else:
            leaves = _restore(entry, shardings)
        if move:
            if entry.tier == "device":
                self._free_device(entry, keep=leaves)
            self._remove_storage(entry)
            entry.tier, entry.device_leaves, entry.host_value = "device", list(leaves), None
            # The requested specs, not the arrays': XLA drops size-1 mesh axes from output shardings, and
            # a later Mesh target of another shape must still shard those dimensions.
            entry.specs = [s.spec if isinstance(s, NamedSharding) else _spec_of(a)
                           for s, a in zip(shardings, leaves, strict=True)]
        return self._rebuild(entry, leaves)

    def _resolve_target(self, key: str, entry: _Entry, target) -> list[Sharding]:
        """Per array leaf, the sharding ``target`` asks for; checks that each fits its leaf."""
        if isinstance(target, Mesh):
            shardings = [NamedSharding(target, spec if spec is not None else PartitionSpec())
                         for spec in entry.specs]
        elif isinstance(target, Sharding):
            shardings = [target] * len(entry.shapes)
        else:
            shardings = self._shardings_from_tree(key, entry, target)
        for sharding, shape, path in zip(shardings, entry.shapes, entry.array_paths, strict=True):
            packing.check_fits(shape, sharding, f"leaf {path} of key {key!r}")
        return shardings

    def _shardings_from_tree(self, key: str, entry: _Entry, target) -> list[Sharding]:
        positions = entry.treedef.unflatten(range(entry.treedef.num_leaves))
        per_position: dict[int, Any] = {}

        def spread(sharding, subtree):
            for position in jax.tree_util.tree_leaves(subtree):
                per_position[position] = sharding

        try:
            jax.tree_util.tree_map(spread, target, positions,
                                   is_leaf=lambda node: isinstance(node, (Sharding, Mesh)) or node is None)
        except (ValueError, TypeError) as error:
            raise ValueError(f"target sharding tree for key {key!r} does not match the value's structure "
                             f"{entry.treedef} (it must be that structure or a prefix of it): "
                             f"{error}") from None
        shardings = []
        for position, path, spec in zip(entry.array_positions, entry.array_paths, entry.specs, strict=True):
            sharding = per_position.get(position)
            if isinstance(sharding, Mesh):
                sharding = NamedSharding(sharding, spec if spec is not None else PartitionSpec())
            if not isinstance(sharding, Sharding):
                raise ValueError(f"target for leaf {path} of key {key!r} is {sharding!r}; expected a "
                                 "jax.sharding.Sharding or a Mesh")
            shardings.append(sharding)
        return shardings

    def _rebuild(self, entry: _Entry, arrays: Sequence) -> Any:
        leaves: list[Any] = [None] * entry.treedef.num_leaves
        for position, value in entry.statics.items():
            leaves[position] = value
        for position, array in zip(entry.array_positions, arrays, strict=True):
            leaves[position] = array
        return entry.treedef.unflatten(leaves)

    def _host_arrays(self, entry: _Entry) -> list:
        """numpy arrays; a leaf kept as this process's shards of a spanning array comes back on its own mesh
        (no process can hold all of it on host)."""
        if entry.tier == "storage":
            return _restore(entry, None)
        value = entry.host_value
        if isinstance(value, packing.HostPacked):
            return value.to_arrays()
        return [rebuild(v, v.sharding) if isinstance(v, LocalShards) else v for v in value]

    def _device_to_device(self, arrays: list[jax.Array], shardings: list[Sharding]) -> list[jax.Array]:
        if not any(spans_processes(a) for a in arrays):
            return packing.device_to_device(arrays, shardings, packed=self.packed)
        return [across_processes.put(array, sharding) for array, sharding in zip(arrays, shardings, strict=True)]

    def _host_to_device(self, entry: _Entry, shardings: list[Sharding]) -> list[jax.Array]:
        value = entry.host_value
        if isinstance(value, list) and any(isinstance(v, LocalShards) for v in value):
            return [rebuild(v, s) if isinstance(v, LocalShards) else across_processes.put(v, s)
                    for v, s in zip(value, shardings, strict=True)]
        if not all(s.is_fully_addressable for s in shardings):  # onto a mesh over several processes: each
            arrays = value.to_arrays() if isinstance(value, packing.HostPacked) else value  # puts its shards
            return [across_processes.put(a, s) for a, s in zip(arrays, shardings, strict=True)]
        if isinstance(value, packing.HostPacked) and self.packed:
            layout = packing.layout_for(entry.shapes, entry.dtypes, shardings)
            if layout is not None:
                return packing.with_shardings(packing.host_packed_to_device(value, layout), shardings)
        arrays = value.to_arrays() if isinstance(value, packing.HostPacked) else value
        return packing.host_to_device(arrays, shardings, packed=self.packed)

    def _to_host(self, entry: _Entry) -> None:
        if entry.tier == "host":
            return
        if entry.tier == "storage":
            entry.host_value = _restore(entry, None)
            self._remove_storage(entry)
        elif any(spans_processes(a) for a in entry.device_leaves):
            # Each process keeps its own shards: the packed path would gather the whole value on one host.
            entry.host_value = [local_shards(a) if spans_processes(a) else np.asarray(a) for a in entry.device_leaves]
            self._free_device(entry)
        else:
            arrays = entry.device_leaves
            layout = packing.layout_for(entry.shapes, entry.dtypes, [a.sharding for a in arrays]) \
                if self.packed else None
            if layout is None:
                entry.host_value = packing.device_to_host(arrays, packed=self.packed)
            else:
                host_packed = packing.device_to_host_packed(arrays, layout)
                replicated_heavy = packing.replication_overhead(layout) > MAX_PACKED_REPLICATION_OVERHEAD
                entry.host_value = host_packed.to_arrays() if replicated_heavy else host_packed
            self._free_device(entry)
        entry.tier = "host"

    def _to_storage(self, key: str, entry: _Entry, path: str | None) -> None:
        if path is not None:
            directory = epath.Path(path)
        elif self._storage_root is not None:
            self._writes += 1
            directory = self._storage_root / _safe_name(key) / f"w{self._writes:06d}"
        else:
            raise ValueError(f"evict({key!r}, 'storage') needs path= or a StateStore(storage_root=...)")
        arrays = entry.device_leaves if entry.tier == "device" else self._host_arrays(entry)
        _save(directory, entry, arrays)
        if entry.tier == "device":
            self._free_device(entry)
        old = entry.storage_path
        entry.tier, entry.host_value, entry.storage_path = "storage", None, directory
        if old is not None and old != directory:
            _rmtree(old)
        logger.debug("stored %r at %s", key, directory)

    def _free_device(self, entry: _Entry, keep: Sequence[jax.Array] = ()) -> None:
        # Arrays another key also holds (e.g. "weights/solver" set from the trainer's params) stay alive.
        kept = {id(a) for a in keep}
        kept.update(id(a) for other in self._entries.values() if other is not entry
                    for a in other.device_leaves or ())
        for array in entry.device_leaves or ():
            if id(array) not in kept and not array.is_deleted():
                array.delete()
        entry.device_leaves = None

    def _remove_storage(self, entry: _Entry) -> None:
        if entry.storage_path is not None:
            _rmtree(entry.storage_path)
            entry.storage_path = None


# ------------------------------------------------------------------------------------ helpers


def _spec_of(array) -> PartitionSpec | None:
    sharding = getattr(array, "sharding", None)
    return sharding.spec if isinstance(sharding, NamedSharding) else None


def _safe_name(key: str) -> str:
    # Keys like "solver/trainer" become one directory level; anything unusual is replaced.
    return re.sub(r"[^A-Za-z0-9._-]", "_", key)


def _leaf_name(number: int) -> str:
    return f"leaf_{number:06d}"


def _save(directory: epath.Path, entry: _Entry, arrays: Sequence) -> None:
    """Writes the array leaves as an Orbax checkpoint plus a JSON file naming every leaf."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory, {_leaf_name(i): a for i, a in enumerate(arrays)}, force=True)
    checkpointer.wait_until_finished()
    statics = {entry.paths[p]: v for p, v in entry.statics.items() if isinstance(v, (int, float, str, bool))}
    described = zip(entry.array_paths, entry.shapes, entry.dtypes, strict=True)
    metadata = {"leaves": [{"path": path, "shape": list(shape), "dtype": dtype.name}
                           for path, shape, dtype in described],
                "statics": statics}
    (directory / _METADATA_FILE).write_text(json.dumps(metadata, indent=1))


def _restore(entry: _Entry, shardings: Sequence[Sharding] | None) -> list:
    """Reads the array leaves back: onto ``shardings`` (Orbax reads each device's slice) or as numpy."""
    names = [_leaf_name(i) for i in range(len(entry.shapes))]
    if not names:
        return []
    if shardings is None:
        args = {name: ocp.RestoreArgs(restore_type=np.ndarray) for name in names}
        restored = ocp.PyTreeCheckpointer().restore(entry.storage_path, restore_args=args)
        return [np.asarray(restored[name]) for name in names]
    placed = zip(names, entry.shapes, entry.dtypes, shardings, strict=True)
    abstract = {name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                for name, shape, dtype, sharding in placed}
    restored = ocp.StandardCheckpointer().restore(entry.storage_path, abstract)
    return [restored[name] for name in names]


def _rmtree(path: epath.Path) -> None:
    try:
        if path.exists():
            path.rmtree()
    except OSError as error:  # a leftover directory is untidy, not wrong: the entry no longer points at it
        logger.warning("could not remove %s: %s", path, error)
