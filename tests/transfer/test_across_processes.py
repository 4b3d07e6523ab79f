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


def test_put_places_a_tree_like_device_put_with_a_sharding_prefix():
    tree = {"tokens": np.arange(16, dtype=np.int32).reshape(4, 4), "mask": np.ones((4, 4), np.float32),
            "scalar": np.float32(3.0)}
    shardings = {"tokens": NamedSharding(_mesh(), PartitionSpec("data")),
                 "mask": NamedSharding(_mesh(), PartitionSpec(None, "model")),
                 "scalar": NamedSharding(_mesh(), PartitionSpec())}
    placed = across_processes.put(tree, shardings)
    expected = jax.device_put(tree, shardings)
    for key in tree:
        assert placed[key].sharding == expected[key].sharding, key
        np.testing.assert_array_equal(np.asarray(placed[key]), np.asarray(expected[key]))
    one = NamedSharding(_mesh(), PartitionSpec())  # one sharding for the whole tree, as device_put allows
    assert all(leaf.sharding == one for leaf in jax.tree.leaves(across_processes.put(tree, one)))
