"""Logical axis rules -> PartitionSpecs, and make_mesh."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from flexmarl_jax.mesh.meshes import make_mesh
from flexmarl_jax.mesh.rules import LOGICAL_AXIS_RULES, logical_to_partition_spec, with_logical_constraint


def test_rules_map_only_to_mesh_axes():
    assert {axis for _, axis in LOGICAL_AXIS_RULES} <= {"fsdp", "tp", None}
    assert len({name for name, _ in LOGICAL_AXIS_RULES}) == len(LOGICAL_AXIS_RULES)


def test_specs_follow_the_table():
    assert logical_to_partition_spec(("embed", "q_heads", "head_dim")) == P("fsdp", "tp", None)
    assert logical_to_partition_spec(("vocab", "embed")) == P("tp", "fsdp")
    assert logical_to_partition_spec(("batch", "length", "act_vocab")) == P("fsdp", None, "tp")


def test_indivisible_or_absent_axes_fall_back_to_replication():
    mesh = {"fsdp": 4, "tp": 4}
    # 2 KV heads cannot split 4 ways; 64 embed can.
    assert logical_to_partition_spec(("embed", "kv_heads", "head_dim"), (64, 2, 16), mesh) == P(
        "fsdp", None, None
    )
    assert logical_to_partition_spec(("embed", "mlp"), (64, 192), {"fsdp": 8}) == P("fsdp", None)
    # a mesh axis is used once per array
    assert logical_to_partition_spec(("mlp", "vocab"), (8, 8), mesh) == P("tp", None)


def test_unknown_logical_name_is_named():
    with pytest.raises(ValueError, match=r"\['heads'\] have no rule"):
        logical_to_partition_spec(("embed", "heads"))


def test_make_mesh_shape_and_errors():
    devices = jax.devices()[:8]
    if len(devices) < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = make_mesh(devices, fsdp=4, tp=2)
    assert dict(mesh.shape) == {"fsdp": 4, "tp": 2} and mesh.axis_names == ("fsdp", "tp")
    assert list(mesh.devices[0]) == devices[:2]  # neighbours share a tp group
    with pytest.raises(ValueError, match="fsdp=3 x tp=2 = 6 devices, but 8 devices were given"):
        make_mesh(devices, fsdp=3, tp=2)


def test_constraint_is_a_no_op_without_a_mesh_and_applies_with_one():
    x = jnp.ones((8, 4, 6))
    assert with_logical_constraint(x, ("batch", "length", "act_embed")) is x
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = make_mesh(jax.devices()[:8], fsdp=4, tp=2)
    with jax.set_mesh(mesh):
        y = jax.jit(lambda a: with_logical_constraint(a * 2, ("batch", "length", "act_vocab")))(x)
    assert y.sharding.spec == P("fsdp", None, "tp")
