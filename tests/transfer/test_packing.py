"""Packed transfer moves every leaf bit-exactly, onto exactly the requested shardings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flexmarl_jax.transfer import packing

# (shape, spec) pairs that fit a 4 x 1 and a 2 x 2 ("fsdp", "tp") mesh alike.
LEAF_KINDS = [
    ((8, 4), P("fsdp")), ((8, 4), P(None, "tp")), ((4, 8), P("fsdp", "tp")), ((12,), P()),
    ((), P()), ((2, 4, 2), P(None, "fsdp")), ((0, 4), P()),
]
DTYPES = [np.float32, jnp.bfloat16, np.int32]


def make_leaves(kinds, seed):
    rng = np.random.default_rng(seed)
    hosts, specs = [], []
    for kind, dtype in kinds:
        shape, spec = LEAF_KINDS[kind]
        hosts.append((rng.standard_normal(shape) * 100).astype(dtype))
        specs.append(spec)
    return hosts, specs


def assert_same(device_leaves, hosts, shardings):
    for leaf, host, sharding in zip(device_leaves, hosts, shardings, strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)  # XLA may drop size-1 mesh axes
        assert leaf.dtype == host.dtype and leaf.shape == host.shape
        np.testing.assert_array_equal(np.asarray(leaf), host)


leaf_lists = st.lists(st.tuples(st.integers(0, len(LEAF_KINDS) - 1), st.integers(0, len(DTYPES) - 1)),
                      min_size=1, max_size=6).map(lambda xs: [(k, DTYPES[d]) for k, d in xs])


@settings(max_examples=6, deadline=None)
@given(kinds=leaf_lists, seed=st.integers(0, 2**16))
def test_round_trip_through_every_path_is_exact(meshes, kinds, seed):
    hosts, specs = make_leaves(kinds, seed)
    on_a = [NamedSharding(meshes["a"], s) for s in specs]
    on_b = [NamedSharding(meshes["b"], s) for s in specs]
    on_c = [NamedSharding(meshes["c"], s) for s in specs]
    device_a = packing.host_to_device(hosts, on_a)
    assert_same(device_a, hosts, on_a)
    for host, back in zip(hosts, packing.device_to_host(device_a), strict=True):
        np.testing.assert_array_equal(back, host)
    assert_same(packing.device_to_device(device_a, on_b), hosts, on_b)  # same arrangement: device to device
    assert_same(packing.device_to_device(device_a, on_c), hosts, on_c)  # other mesh shape: through host


def test_packed_and_per_leaf_agree(meshes):
    hosts, specs = make_leaves([(0, np.float32), (3, jnp.bfloat16), (4, np.int32), (5, np.float32)], seed=3)
    on_a = [NamedSharding(meshes["a"], s) for s in specs]
    on_c = [NamedSharding(meshes["c"], s) for s in specs]
    packed = packing.device_to_device(packing.host_to_device(hosts, on_a), on_c)
    per_leaf = packing.device_to_device(packing.host_to_device(hosts, on_a, packed=False), on_c, packed=False)
    for x, y in zip(packed, per_leaf, strict=True):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_layout_has_one_buffer_per_dtype_and_one_row_per_device(meshes):
    hosts, specs = make_leaves([(0, np.float32), (1, np.float32), (3, np.int32), (4, jnp.bfloat16)], seed=0)
    layout = packing.layout_for([h.shape for h in hosts], [h.dtype for h in hosts],
                                [NamedSharding(meshes["a"], s) for s in specs])
    assert [dtype for dtype, _ in layout.groups] == ["float32", "int32", "bfloat16"]
    # float32 row: an [8,4] leaf split 4 ways (8) + an [8,4] leaf replicated over fsdp (32).
    assert layout.row_sizes == (8 + 32, 12, 1)
    buffers = packing.host_to_buffers(hosts, layout)
    assert [b.shape for b in buffers] == [(4, 40), (4, 12), (4, 1)]
    restored = packing.buffers_to_host(buffers, layout)
    for host, back in zip(hosts, restored, strict=True):
        np.testing.assert_array_equal(back, host)


def test_already_placed_leaves_are_returned_without_a_copy(meshes):
    hosts, specs = make_leaves([(0, np.float32), (2, np.float32)], seed=1)
    on_a = [NamedSharding(meshes["a"], s) for s in specs]
    device_a = packing.host_to_device(hosts, on_a)
    moved = packing.device_to_device(device_a, on_a)
    assert all(x is y for x, y in zip(moved, device_a, strict=True))


def test_mixed_meshes_fall_back_to_per_leaf(meshes):
    hosts, specs = make_leaves([(0, np.float32), (3, np.float32)], seed=2)
    shardings = [NamedSharding(meshes["a"], specs[0]), NamedSharding(meshes["one"], specs[1])]
    assert packing.layout_for([h.shape for h in hosts], [h.dtype for h in hosts], shardings) is None
    assert_same(packing.host_to_device(hosts, shardings), hosts, shardings)


@pytest.mark.parametrize(("shape", "spec", "message"), [
    ((6, 4), P("fsdp"), "dimension 0 (size 6) is not divisible by the 4 devices"),
    ((8,), P("fsdp", "tp"), "has 2 entries but the value has shape (8,)"),
    ((), P("fsdp"), "has 1 entries but the value has shape ()"),
])
def test_check_fits_names_the_leaf_and_why(meshes, shape, spec, message):
    with pytest.raises(ValueError) as error:
        packing.check_fits(shape, NamedSharding(meshes["a"], spec), "leaf ['w']")
    assert message in str(error.value) and "leaf ['w']" in str(error.value)


def test_device_to_host_frees_nothing_and_copies(meshes):
    hosts, specs = make_leaves([(0, np.float32)], seed=4)
    device_a = packing.host_to_device(hosts, [NamedSharding(meshes["a"], specs[0])])
    back = packing.device_to_host(device_a)
    back[0][0, 0] += 1.0  # the host copy is independent of the device array
    assert not device_a[0].is_deleted()
    np.testing.assert_array_equal(np.asarray(device_a[0]), hosts[0])
    assert jax.device_get(device_a[0])[0, 0] != back[0][0, 0]


def test_small_waves_bound_each_packed_buffer_and_still_move_exactly(meshes):
    hosts, specs = make_leaves([(0, np.float32), (1, np.float32), (2, np.float32), (3, np.int32),
                                (4, jnp.bfloat16)], seed=5)
    shapes, dtypes = tuple(h.shape for h in hosts), tuple(np.dtype(h.dtype).name for h in hosts)
    # 64 bytes per device per wave: the f32 leaves (32, 128 and 32 local bytes) cannot share a buffer.
    layout = packing.make_layout(meshes["a"], tuple(specs), shapes, dtypes, max_wave_bytes=64)
    assert len(layout.groups) >= 4 and len(layout.waves) >= 3
    for size, (dtype, _) in zip(layout.row_sizes, layout.groups, strict=True):
        nbytes = size * np.dtype(dtype).itemsize
        assert nbytes <= 64 or len(_) == 1  # only a single oversized leaf may exceed the bound
    on_a = [NamedSharding(meshes["a"], s) for s in specs]
    device_a = packing.host_to_device(hosts, on_a)
    host_packed = packing.device_to_host_packed(device_a, layout)
    for host, back in zip(hosts, host_packed.to_arrays(), strict=True):
        np.testing.assert_array_equal(back, host)
    on_b_layout = packing.make_layout(meshes["b"], tuple(specs), shapes, dtypes, max_wave_bytes=64)
    assert_same(packing.host_packed_to_device(host_packed, on_b_layout), hosts,
                [NamedSharding(meshes["b"], s) for s in specs])


def test_large_leaves_move_directly_and_small_ones_packed(meshes):
    hosts, specs = make_leaves([(0, np.float32), (3, np.float32), (4, np.int32), (2, jnp.bfloat16)], seed=6)
    shapes, dtypes = tuple(h.shape for h in hosts), tuple(np.dtype(h.dtype).name for h in hosts)
    # Local bytes on the 4 x 1 mesh: 32, 48, 4, 16; a 20-byte limit sends leaves 0 and 1 direct.
    layout_a = packing.make_layout(meshes["a"], tuple(specs), shapes, dtypes, max_packed_leaf_bytes=20)
    layout_b = packing.make_layout(meshes["b"], tuple(specs), shapes, dtypes, max_packed_leaf_bytes=20)
    assert layout_a.direct == (0, 1)
    assert sorted(leaf for _, leaves in layout_a.groups for leaf in leaves) == [2, 3]
    on_a = [NamedSharding(meshes["a"], s) for s in specs]
    on_b = [NamedSharding(meshes["b"], s) for s in specs]
    device_a = packing.host_to_device(hosts, on_a)
    host_packed = packing.device_to_host_packed(device_a, layout_a)
    assert sorted(host_packed.direct) == [0, 1]
    for host, back in zip(hosts, host_packed.to_arrays(), strict=True):
        np.testing.assert_array_equal(back, host)
    assert_same(packing.host_packed_to_device(host_packed, layout_b), hosts, on_b)
    moved = packing.device_to_device(device_a, on_b, source_layout=layout_a, target_layout=layout_b)
    assert_same(moved, hosts, on_b)
