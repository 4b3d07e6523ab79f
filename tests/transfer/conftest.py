"""Meshes over the 8 fake CPU devices (tests/conftest.py) shared by the transfer tests."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh


def mesh_of(device_ids, fsdp, tp=1) -> Mesh:
    devices = [jax.devices()[i] for i in device_ids]
    return Mesh(np.asarray(devices, dtype=object).reshape(fsdp, tp), ("fsdp", "tp"))


@pytest.fixture(scope="session")
def meshes():
    """Two same-shape slices on disjoint devices, a differently shaped one, and a single device."""
    assert len(jax.devices()) >= 8, "tests/conftest.py should fake 8 CPU devices"
    return {
        "a": mesh_of([0, 1, 2, 3], fsdp=4),
        "b": mesh_of([4, 5, 6, 7], fsdp=4),
        "c": mesh_of([4, 5, 6, 7], fsdp=2, tp=2),
        "one": mesh_of([7], fsdp=1),
    }
