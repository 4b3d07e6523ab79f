"""Building ("fsdp", "tp") meshes for an agent's rollout or training devices."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh

from flexmarl_jax.mesh.rules import MESH_AXES


def make_mesh(devices: Sequence, *, fsdp: int, tp: int = 1) -> Mesh:
    """A mesh of shape [fsdp, tp] with axes ("fsdp", "tp") over exactly `fsdp * tp` devices.

    Neighbouring devices go to the same tp group, because tensor parallelism talks most.
    """
    devices = list(devices)
    if fsdp < 1 or tp < 1:
        raise ValueError(f"fsdp={fsdp} and tp={tp} must both be >= 1")
    if fsdp * tp != len(devices):
        raise ValueError(
            f"fsdp={fsdp} x tp={tp} = {fsdp * tp} devices, but {len(devices)} devices were given"
        )
    return Mesh(np.asarray(devices, dtype=object).reshape(fsdp, tp), MESH_AXES)
