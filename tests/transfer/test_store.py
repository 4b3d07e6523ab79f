"""StateStore: one tier at a time, exact values from every tier onto any mesh, freed device memory."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flexmarl_jax.transfer import StateStore


def make_state(mesh, seed=0):
    """A trainer-like pytree: sharded f32 params, a bf16 leaf, an int step count, a python version."""
    rng = np.random.default_rng(seed)
    on = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    return {
        "params": {"w": jax.device_put(rng.standard_normal((8, 4)).astype(np.float32), on(P("fsdp"))),
                   "b": jax.device_put(rng.standard_normal((4,)).astype(np.float32), on(P())),
                   "e": jax.device_put(rng.standard_normal((16, 2)).astype(jnp.bfloat16), on(P("fsdp")))},
        "opt": {"count": jax.device_put(np.int32(7), on(P()))},
        "policy_version": 3,
    }


def host_copy(state):
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, state)


def assert_equal_trees(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if isinstance(x, int):
            assert x == y
        else:
            assert np.asarray(x).dtype == np.asarray(y).dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def live_bytes_on(mesh) -> int:
    """Bytes of live (not deleted) jax.Arrays that have a shard on any device of ``mesh``."""
    gc.collect()  # arrays dropped by earlier tests must not be counted (or vanish mid-test)
    devices = set(mesh.devices.flat)
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted() and a.devices() & devices)


@pytest.mark.parametrize("packed", [True, False])
def test_evict_to_host_frees_device_memory_and_get_restores_exactly(meshes, packed):
    store = StateStore(packed=packed)
    before = live_bytes_on(meshes["a"])
    state = make_state(meshes["a"])
    expected = host_copy(state)
    store.set("solver", state)
    assert store.where("solver") == "device"
    assert live_bytes_on(meshes["a"]) > before
    del state
    store.evict("solver", "host")
    assert store.where("solver") == "host"
    assert live_bytes_on(meshes["a"]) == before  # nothing of the value is left on those devices
    back = store.get("solver", meshes["b"])  # the same slice shape on other devices
    assert_equal_trees(back, expected)
    # specs carried over (XLA may spell an equivalent sharding differently, e.g. with size-1 axes)
    assert back["params"]["w"].sharding.is_equivalent_to(NamedSharding(meshes["b"], P("fsdp")), 2)
    assert back["params"]["b"].sharding.is_fully_replicated
    assert store.where("solver") == "host"  # get copies; the value still lives on host


def test_storage_round_trip_onto_another_mesh_shape_is_identical(meshes, tmp_path):
    store = StateStore(storage_root=str(tmp_path))
    before = live_bytes_on(meshes["a"])
    state = make_state(meshes["a"], seed=1)
    expected = host_copy(state)
    store.set("verifier", state)
    del state
    store.evict("verifier", "storage")
    assert store.where("verifier") == "storage"
    assert live_bytes_on(meshes["a"]) == before
    path = store.storage_path("verifier")
    assert path is not None and (tmp_path / "verifier").exists()
    target = {"params": NamedSharding(meshes["c"], P("tp")),
              "opt": NamedSharding(meshes["c"], P()), "policy_version": None}
    back = store.get("verifier", target)  # a prefix tree of shardings; 2 x 2 mesh instead of 4 x 1
    assert_equal_trees(back, expected)
    assert back["params"]["w"].sharding.is_equivalent_to(NamedSharding(meshes["c"], P("tp")), 2)
    assert back["policy_version"] == 3
    assert_equal_trees(store.get("verifier"), expected)  # no target: numpy from storage
    store.get("verifier", meshes["one"], move=True)  # swap in: the checkpoint is no longer the home
    assert store.where("verifier") == "device" and store.storage_path("verifier") is None
    assert not (tmp_path / "verifier").exists() or not any((tmp_path / "verifier").iterdir())


def test_storage_to_host_and_host_to_storage(meshes, tmp_path):
    store = StateStore(storage_root=str(tmp_path))
    state = make_state(meshes["a"], seed=2)
    expected = host_copy(state)
    store.set("k", state)
    store.evict("k", "host")
    store.evict("k", "storage")
    assert store.where("k") == "storage"
    store.evict("k", "host")
    assert store.where("k") == "host" and store.storage_path("k") is None
    assert_equal_trees(store.get("k", meshes["c"]), expected)


def test_get_on_the_same_sharding_moves_nothing(meshes):
    store = StateStore()
    state = make_state(meshes["a"])
    store.set("k", state)
    again = store.get("k", meshes["a"])
    assert again["params"]["w"] is state["params"]["w"]


def test_get_with_move_frees_the_old_device_copy(meshes):
    store = StateStore()
    before_a = live_bytes_on(meshes["a"])
    state = make_state(meshes["a"])
    expected = host_copy(state)
    store.set("k", state)
    del state
    moved = store.get("k", meshes["b"], move=True)
    assert store.where("k") == "device"
    assert live_bytes_on(meshes["a"]) == before_a
    assert_equal_trees(moved, expected)
    assert store.get("k")["params"]["w"] is moved["params"]["w"]


def test_evict_to_device_needs_a_target(meshes):
    store = StateStore()
    store.set("k", host_copy(make_state(meshes["a"])))
    assert store.where("k") == "host"
    with pytest.raises(ValueError, match="needs target="):
        store.evict("k", "device")
    store.evict("k", "device", target=meshes["c"])
    assert store.where("k") == "device"
    assert store.get("k")["params"]["w"].sharding.mesh == meshes["c"]


def test_missing_key_names_the_key_and_the_known_ones(meshes):
    store = StateStore()
    store.set("solver", {"x": np.zeros(3)})
    store.set("verifier", {"x": np.zeros(3)})
    with pytest.raises(KeyError) as error:
        store.get("corrector", meshes["a"])
    assert "'corrector'" in str(error.value) and "'solver', 'verifier'" in str(error.value)
    with pytest.raises(KeyError, match="corrector"):
        store.evict("corrector", "host")


def test_target_that_does_not_fit_names_leaf_shape_and_sharding(meshes):
    store = StateStore()
    store.set("k", {"params": {"w": np.zeros((6, 4), np.float32)}})
    with pytest.raises(ValueError) as error:
        store.get("k", NamedSharding(meshes["a"], P("fsdp")))
    message = str(error.value)
    assert "['params']['w']" in message and "(6, 4)" in message and "P('fsdp',)" in message
    with pytest.raises(ValueError, match="does not match the value's structure"):
        store.get("k", {"other": NamedSharding(meshes["a"], P())})
    with pytest.raises(ValueError, match="allowed tiers: device, host, storage"):
        store.evict("k", "disk")
    with pytest.raises(ValueError, match="needs path= or a StateStore"):
        store.evict("k", "storage")


def test_mixed_host_and_device_leaves_are_rejected(meshes):
    with pytest.raises(ValueError, match="mixes jax.Arrays and host arrays"):
        StateStore().set("k", {"a": jnp.zeros(2), "b": np.zeros(2)})


def test_delete_and_replace(meshes, tmp_path):
    store = StateStore(storage_root=str(tmp_path))
    before = live_bytes_on(meshes["a"])
    store.set("k", make_state(meshes["a"]))
    store.delete("k")
    assert store.keys() == [] and live_bytes_on(meshes["a"]) == before
    store.set("k", make_state(meshes["a"]))
    store.evict("k", "storage")
    first_path = store.storage_path("k")
    store.set("k", {"x": np.arange(3)})  # replacing removes the old checkpoint
    assert store.where("k") == "host"
    from etils import epath
    assert not epath.Path(first_path).exists()


def test_replicated_heavy_values_are_kept_unpacked_on_host(meshes):
    store = StateStore()
    replicated = NamedSharding(meshes["a"], P())
    store.set("k", {"w": jax.device_put(np.arange(32.0).reshape(8, 4), replicated)})
    store.evict("k", "host")
    np.testing.assert_array_equal(store.get("k")["w"], np.arange(32.0).reshape(8, 4))
    np.testing.assert_array_equal(np.asarray(store.get("k", meshes["b"])["w"]), np.arange(32.0).reshape(8, 4))


def test_mesh_target_keeps_size_one_axes_of_the_spec(meshes):
    """P("tp", "fsdp") on a tp=1 mesh must still shard over "tp" when moved to a tp=2 mesh."""
    store = StateStore()
    value = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    store.set("k", {"w": jax.device_put(value, NamedSharding(meshes["a"], P("tp", "fsdp")))})
    store.evict("k", "host")
    store.get("k", meshes["b"], move=True)  # through the packed path (XLA spells its output P(None, "fsdp"))
    store.evict("k", "host")
    moved = store.get("k", meshes["c"])
    assert moved["w"].sharding.is_equivalent_to(NamedSharding(meshes["c"], P("tp", "fsdp")), 2)
    assert moved["w"].addressable_shards[0].data.shape == (4, 4)
    np.testing.assert_array_equal(np.asarray(moved["w"]), value)


def test_arrays_shared_with_another_key_survive_its_eviction(meshes):
    store = StateStore()
    state = make_state(meshes["a"])
    expected = host_copy(state["params"])
    store.set("trainer/solver", state)
    store.set("weights/solver", state["params"])  # the same arrays under a second key (weight sync)
    store.evict("trainer/solver", "host")
    assert not state["params"]["w"].is_deleted() and state["opt"]["count"].is_deleted()
    assert_equal_trees(store.get("weights/solver", meshes["b"]), expected)
    assert_equal_trees(store.get("trainer/solver")["params"], expected)
