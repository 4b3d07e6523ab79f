"""Host memory: every large block goes straight to mmap, so a freed one goes back to the operating system.

glibc's malloc serves blocks above its mmap threshold with mmap and returns them on free. But the threshold moves:
each time such a block is freed, glibc raises it to that block's size (up to 32 MiB on 64-bit). From then on
the CPU backend's buffers below that size (parameters, gradients and optimizer moments of a model's layers) come
from the heap arenas, where a freed block stays in the process unless it sits at the top of the heap. A training
run that replaces its parameters and optimizer state at every update then grows by a share of them each
iteration: measured on `configs/smollm2_team.py:cpu_smoke` with three 135M-parameter agents, RSS went from 12
to 18 GiB over four iterations while the live JAX arrays stayed at the same bytes, and a full `cpu` run was
killed for memory in its sixth iteration. With the threshold fixed at 1 MiB the same run stays between 12.5 and
14.2 GiB. `mallopt` fixes it in a running process (and turns the dynamic raising off), like glibc's
MALLOC_MMAP_THRESHOLD_ environment variable before start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
LARGE_BLOCK_BYTES = 1 << 20


def return_freed_blocks_to_the_os(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Fixes glibc's mmap and trim thresholds at `threshold` bytes for this process; False (nothing changed) where
    the C library is not glibc (macOS, musl), whose allocators do not have this behaviour to fix."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    gnu_version = getattr(libc, "gnu_get_libc_version", None)
    if mallopt is None or gnu_version is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, threshold))
