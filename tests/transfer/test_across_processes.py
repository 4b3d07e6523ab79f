"""`across_processes.put` / `from_host`: host values placed shard by shard, with no collective.

One process cannot hold a sharding that spans processes, so these check the shard-by-shard construction on this
process's devices; tests/distributed/test_two_process_run.py checks it across two processes (equal parameters,
and no all-device computation)."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flexmarl_jax.transfer import across_processes


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))


def test_from_host_gives_each_device_its_own_slice():
    host = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    sharding = NamedSharding(_mesh(), PartitionSpec("data", "model"))
    placed = across_processes.from_host(host, sharding)
    assert placed.sharding == sharding
    np.testing.assert_array_equal(np.asarray(placed), host)
    assert len(placed.addressable_shards) == 4
    for shard in placed.addressable_shards:
        assert shard.data.shape == (4, 3)
        np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index])


def test_put_places_each_leaf_on_the_sharding_of_its_prefix():
    tree = {"batch": {"tokens": np.arange(16, dtype=np.int32).reshape(4, 4), "mask": np.ones((4, 4), np.float32)},
            "scale": np.float32(3.0), "row": np.arange(4, dtype=np.float32)}
    rows = NamedSharding(_mesh(), PartitionSpec("data"))
    whole = NamedSharding(_mesh(), PartitionSpec())
    placed = across_processes.put(tree, {"batch": rows, "scale": whole, "row": rows})  # "batch": a prefix
    assert jax.tree.structure(placed) == jax.tree.structure(tree)
    for path, leaf in jax.tree.leaves_with_path(placed):
        expected = whole if path[0].key == "scale" else rows
        assert leaf.sharding == expected, path
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.dtype == want.dtype
    assert placed["batch"]["tokens"].addressable_shards[0].data.shape == (2, 4)  # split over "data" (2)
    everything = across_processes.put(tree, whole)  # one sharding for the whole tree, as device_put allows
    assert all(leaf.sharding == whole for leaf in jax.tree.leaves(everything))
