"""On CPU hosts, a computation on a mesh that spans processes returns only once this process's devices have all
finished their parts (`completed`).

Why: XLA:CPU runs a computation's part on each local device on a thread of its own, and the call can return
before every part has run; reading one shard waits for that shard's device only. Measured with JAX 0.10.2 and
`TF_CPP_VMODULE=collective_thunk=3`: a computation's collective on one local device was logged after the next
computation's first collective on that device. Two computations on one device then post their collectives in
an order that can differ between processes, and gloo pairs a collective's messages by their order on a
connection: the run aborts ("Received data size doesn't match expected size"; all-device computations of JAX
and Orbax did this: docs/architecture.md, "No all-device computations of JAX's or Orbax's own"). Waiting for
the outputs, which every local device of the mesh holds a shard of, closes it for our own computations.

TPU and GPU devices run a device's computations in order on its stream, so nothing waits there (a wait after
every step would cost their asynchronous dispatch). One process: nothing waits either.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax

F = TypeVar("F", bound=Callable[..., Any])


def needs_completion(mesh) -> bool:
    """Whether computations on ``mesh`` (a jax.sharding.Mesh) must be waited for: CPU devices of more than
    one process."""
    devices = list(mesh.devices.flat)
    return len({device.process_index for device in devices}) > 1 and devices[0].platform == "cpu"


def completed(computation: F) -> F:
    """``computation`` that returns once its outputs are ready on every device of this process."""

    @functools.wraps(computation)
    def call(*args, **kwargs):
        return jax.block_until_ready(computation(*args, **kwargs))

    return call  # type: ignore[return-value]
