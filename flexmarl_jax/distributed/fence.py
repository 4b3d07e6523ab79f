"""A fence after each computation on a mesh that spans processes: every process waits until all of them have
finished it before issuing the next.

Why (measured with JAX 0.10.2 on CPU over gloo, 2 processes, a training slice of one device of each): a long
enough run of spanning computations issued in the same order on both processes aborts in gloo with "Received
data size doesn't match expected size" (sizes that change from run to run), after 80-90 good warm-up steps,
with identical inputs on both processes. XLA's gloo communicator gives every collective the same tag, so only
arrival order pairs messages with collectives: a process whose part of a computation is done issues the next one
while the other is still receiving, and the next computation's first collective can meet the previous one's.
With this fence the 40-step warm-up run finished 5 times of 6 (without it 0 of 3); what the sixth hit is open
(docs/architecture.md, "Several hosts"). The barrier is the runtime's key-value service (no device collective
of its own); its names count the fenced computations, which every process issues alike
(distributed/ordered_issue.py).

One process, or a mesh on one process's devices: no fence, no cost.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import jax

FENCE_TIMEOUT_S = 3600  # a peer that dies is reported by the runtime's heartbeat long before this
_counter = itertools.count()
_lock = threading.Lock()
F = TypeVar("F", bound=Callable[..., Any])


def mesh_spans_processes(mesh) -> bool:
    """Whether ``mesh`` (a jax.sharding.Mesh) holds devices of more than one process."""
    return len({device.process_index for device in mesh.devices.flat}) > 1


def fence(outputs: Any = None) -> None:
    """Waits for ``outputs`` on this process, then for every process to get here (nothing with one process)."""
    if jax.process_count() == 1:
        return
    jax.block_until_ready(outputs)
    from orbax.checkpoint import multihost

    with _lock:
        name = f"flexmarl-fence-{next(_counter)}"
    multihost.get_barrier_sync_fn()(key=name, timeout_ms=FENCE_TIMEOUT_S * 1000)


def fenced(computation: F) -> F:
    """``computation`` followed by a `fence` on its outputs."""

    @functools.wraps(computation)
    def call(*args, **kwargs):
        outputs = computation(*args, **kwargs)
        fence(outputs)
        return outputs

    return call  # type: ignore[return-value]
