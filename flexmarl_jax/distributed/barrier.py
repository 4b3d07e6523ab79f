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

import collections
import itertools
import threading

import jax
from orbax.checkpoint import multihost

KEY_VALUE_TIMEOUT_S = 3600  # a peer that dies is reported by the runtime's heartbeat long before this
_counters: dict[str, itertools.count] = collections.defaultdict(itertools.count)  # one count per prefix
_lock = threading.Lock()


def next_key(prefix: str) -> str:
    """A fresh name under ``prefix`` on the runtime's key-value service (barriers, `leader.leader_value`):
    the calls with that prefix, counted, so every process that makes them in one order gets the same names."""
    with _lock:
        return f"{prefix}-{next(_counters[prefix])}"


def barrier() -> None:
    """Waits until every process gets here (nothing with one process). Every process must call it the same
    number of times, in the same order: the barrier's names count the calls."""
    if jax.process_count() == 1:
        return

    multihost.get_barrier_sync_fn()(key=next_key("flexmarl-barrier"), timeout_ms=KEY_VALUE_TIMEOUT_S * 1000)
