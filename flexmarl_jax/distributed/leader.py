"""Process 0 leads: it writes the run's shared files, and the others take its word where they must agree.

One writer per file (docs/architecture.md, "One writer per file"): the run's own files (config.json, the
journal, metrics.jsonl, timeline.json, plots, the durable experience store) are written by process 0 alone;
checkpoints are written through Orbax's multi-process API, which gives each process files of its own.
"""

from __future__ import annotations

import jax
from jax._src.distributed import global_state  # the runtime's client; JAX has no public accessor

from flexmarl_jax.distributed.barrier import KEY_VALUE_TIMEOUT_S, next_key


def is_leader() -> bool:
    """Whether this process writes the run's shared files (process 0; a single process always)."""
    return jax.process_index() == 0


def leader_value(value: int) -> int:
    """Process 0's ``value`` on every process (``value`` itself with one process), through the distributed
    runtime's key-value service: process 0 sets it, the others wait for it. No device computation: one over
    every device would share gloo communicators with the training slice's (transfer/across_processes.py).
    Every process must call it the same number of times, in the same order (the keys count the calls)."""
    if jax.process_count() == 1:
        return int(value)
    key = next_key("flexmarl-leader")
    if is_leader():
        global_state.client.key_value_set(key, str(int(value)))
        return int(value)
    return int(global_state.client.blocking_key_value_get(key, KEY_VALUE_TIMEOUT_S * 1000))
