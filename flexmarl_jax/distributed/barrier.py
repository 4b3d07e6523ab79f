"""`barrier()`: every process waits until all of them get here, through the distributed runtime's key-value
service (no device computation). A checkpoint's manifest is written behind one, so no process reads a step
before its manifest exists (train/checkpoint.py).

No barrier follows each spanning computation (on CPU hosts each is waited for on this process only:
distributed/cpu_completion.py). One did until the cause of the gloo aborts it was meant to prevent was found:
a computation over every device of every process sharing gloo communicators with the training slice's
(transfer/across_processes.py). Without those computations, 4 of 4 runs of a 40-step warm-up with no barrier
after each step finished (without the barrier and with them, 0 of 3 had); gloo pairs each collective's
messages by their order on a connection, and every process issues the spanning computations in one order from
one thread (docs/architecture.md, "Several hosts").

One process: no barrier, no cost.
"""

from __future__ import annotations

import itertools
import threading

import jax

BARRIER_TIMEOUT_S = 3600  # a peer that dies is reported by the runtime's heartbeat long before this
_counter = itertools.count()
_lock = threading.Lock()


def barrier() -> None:
    """Waits until every process gets here (nothing with one process). Every process must call it the same
    number of times, in the same order: the barrier's names count the calls."""
    if jax.process_count() == 1:
        return
    from orbax.checkpoint import multihost

    with _lock:
        name = f"flexmarl-barrier-{next(_counter)}"
    multihost.get_barrier_sync_fn()(key=name, timeout_ms=BARRIER_TIMEOUT_S * 1000)
