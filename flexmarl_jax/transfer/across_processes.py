"""Moving arrays that span processes (a training mesh over several hosts) where JAX cannot move them directly.

Measured with JAX 0.10.2 (CPU, gloo): `jax.device_put` from a mesh that spans processes onto another process's
device is UNIMPLEMENTED, and `np.asarray` of such an array fails (no process holds all of it). What works:

- `replicate_to_local`: a jitted identity whose output is replicated over the source mesh (an all-gather
  between the processes), after which every process holds the whole value on its own devices of that mesh
  and places it on its local target. It is a computation on the spanning mesh: every process must issue it,
  in the same order as its other spanning computations (distributed/ordered_issue.py).
- `LocalShards` / `rebuild`: a process's own shards copied to host memory and put back on the same sharding
  later (a suspended trainer's state); no process ever needs another's shards, so nothing crosses hosts.
- `put`: `jax.device_put` without its hidden collective. Placing a host value (numpy, a scalar, an uncommitted
  array) on a sharding that spans processes, `jax.device_put` first checks that the value is equal on every
  process with `multihost_utils.assert_equal`: a computation over every device of every process. That
  computation runs on each local device's own thread, and the call returns once one device's copy of the
  result is read, so its collective on another device (the training slice's) can still be waiting when the
  next computation on that slice issues its own. Both use the same gloo communicator (XLA keys them by device
  set), and the two processes paired them up in different orders: the run aborted in gloo ("Received data
  size doesn't match expected size"), about one 2-process run in seven (docs/architecture.md, "No all-device
  computations of JAX's or Orbax's own"). `put` has each process fill its own devices' shards from its own
  copy instead (`jax.make_array_from_callback`), which is what the deterministic mode's equal copies allow.

For a move between hosts that do not share a mesh, the StateStore's storage tier (Orbax on the shared
workdir) is the path; every process of the source mesh writes its shards there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from flexmarl_jax.distributed.cpu_completion import completed, needs_completion


def spans_processes(array) -> bool:
    """Whether ``array`` is a jax.Array some of whose shards live on other processes' devices."""
    return isinstance(array, jax.Array) and not array.is_fully_addressable


def replicate_to_local(array: jax.Array, target: Sharding) -> jax.Array:
    """A spanning ``array`` placed on ``target`` (a sharding over this process's devices): gathered to every
    device of its mesh first (a collective all processes of the mesh issue), then moved locally."""
    mesh = array.sharding.mesh
    replicated = _identity(NamedSharding(mesh, PartitionSpec()))(array)
    whole = replicated.addressable_shards[0].data  # one full copy on a device of this process
    return jax.device_put(whole, target)


@dataclasses.dataclass(frozen=True)
class LocalShards:
    """This process's shards of one spanning array, on host, with what puts them back."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Sharding
    shards: tuple[tuple[jax.Device, np.ndarray], ...]

    @property
    def nbytes(self) -> int:
        return sum(data.nbytes for _, data in self.shards)


def local_shards(array: jax.Array) -> LocalShards:
    """Host copies of this process's shards of ``array``.

    An array that `jax.device_put` placed from host onto a spanning mesh can hold per-process buffers that
    JAX cannot split into shards (JAX 0.10.2: "input arrays must have one shard each"). `put` makes no such
    array, but values from elsewhere (a restore, a caller's own `device_put`) may be one; such an array is
    first re-laid by a jitted identity on its own sharding (a computation on the spanning mesh, so issued
    like the others, in order on every process)."""
    try:
        shards = array.addressable_shards
    except ValueError:
        array = _identity(array.sharding)(array)
        shards = array.addressable_shards
    return LocalShards(tuple(array.shape), np.dtype(array.dtype), array.sharding,
                       tuple((shard.device, np.asarray(shard.data)) for shard in shards))


@functools.lru_cache(maxsize=64)
def _identity(sharding: Sharding):
    """A jitted identity onto ``sharding``; on a CPU mesh over several processes, waited for
    (distributed/cpu_completion.py)."""
    identity = jax.jit(lambda value: value, out_shardings=sharding)
    mesh = getattr(sharding, "mesh", None)
    return completed(identity) if mesh is not None and needs_completion(mesh) else identity


def rebuild(saved: LocalShards, target: Sharding) -> jax.Array:
    """The array back on ``target``, which must place every shard where it was (the same devices and
    layout): each process puts back its own shards, so nothing crosses hosts."""
    if not (target == saved.sharding or target.is_equivalent_to(saved.sharding, len(saved.shape))):
        raise ValueError(f"a value saved as local shards of {saved.sharding} goes back on that sharding only, "
                         f"not {target}; move it between meshes through the storage tier (Orbax)")
    arrays = [jax.device_put(data, device) for device, data in saved.shards]
    return jax.make_array_from_single_device_arrays(saved.shape, saved.sharding, arrays)


def put(tree, shardings):
    """``tree`` placed on ``shardings`` (a Sharding, or a pytree of Shardings matching ``tree`` or a prefix of
    it; no None or Device leaves) like `jax.device_put`, but with no computation of JAX's own across processes:
    - a host value (numpy, a scalar, an array on this process's devices) bound for a sharding that spans
      processes is built by each process from its own copy (`from_host`). The copies are assumed equal, as the
      deterministic mode that multi-process runs require makes them, and not checked: that check is the
      all-device computation this avoids (the module docstring says why). Weak types are not kept;
    - a spanning value bound for another spanning sharding is moved by our jitted identity, which is waited
      for on CPU (`_identity`); one bound for this process's devices is gathered first (`replicate_to_local`);
    - anything else goes through `jax.device_put`."""
    return jax.tree.map(lambda sharding, subtree: jax.tree.map(lambda leaf: _put_leaf(leaf, sharding), subtree),
                        shardings, tree)


def _put_leaf(leaf, sharding: Sharding):
    if spans_processes(leaf):
        if leaf.sharding == sharding or leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
            return leaf
        return replicate_to_local(leaf, sharding) if sharding.is_fully_addressable else _identity(sharding)(leaf)
    if sharding.is_fully_addressable:
        return jax.device_put(leaf, sharding)
    return from_host(leaf, sharding)


def from_host(value, sharding: Sharding) -> jax.Array:
    """``value`` (anything numpy can read) on ``sharding``, each of this process's devices given its shard
    from this process's copy: no collective, whichever processes the sharding spans (the dtype is given, so
    a process with no device in the sharding can build its part too)."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index], dtype=host.dtype)


def to_host(array) -> np.ndarray:
    """``array`` as numpy; a spanning one is gathered first (`replicate_to_local`'s collective)."""
    if spans_processes(array) and not array.is_fully_replicated:
        array = _identity(NamedSharding(array.sharding.mesh, PartitionSpec()))(array)
        return np.asarray(array.addressable_shards[0].data)
    return np.asarray(array)
