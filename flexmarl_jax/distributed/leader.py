"""Process 0 leads: it writes the run's shared files, and the others take its word where they must agree.

One writer per file (docs/architecture.md, "One writer per file"): the run's own files (config.json, the
journal, metrics.jsonl, timeline.json, plots, the durable experience store) are written by process 0 alone;
checkpoints are written through Orbax's multi-process API, which gives each process files of its own.
"""

from __future__ import annotations

import jax
import numpy as np


def is_leader() -> bool:
    """Whether this process writes the run's shared files (process 0; a single process always)."""
    return jax.process_index() == 0


def leader_value(value: int) -> int:
    """Process 0's ``value`` on every process (``value`` itself with one process). A collective over every
    device (`multihost_utils.broadcast_one_to_all`): call it from the main thread, where every process
    reaches it in the same order."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    from flexmarl_jax.distributed.fence import fence

    agreed = int(multihost_utils.broadcast_one_to_all(np.int64(value)))  # a collective over every device
    fence()
    return agreed
