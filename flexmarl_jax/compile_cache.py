"""JAX's persistent compilation cache for `flexmarl train`: a second run of the same shapes loads its programs
instead of compiling them.

A run compiles every engine's prefill and decode programs (per prompt-length and slot bucket, per device: on
a CPU host the device is part of the program's cache key) and every trainer's step (per length bucket). On the
2-core host that is part of every SmolLM2 run, paid again by each run of the same recipe; with the cache, only
the first run on a machine pays it. The cache is JAX's own (`jax_compilation_cache_dir`): a folder of
serialized executables keyed by the program, the XLA flags and the JAX version, so a changed program or
upgrade misses rather than loading something stale, and an unreadable entry is compiled afresh (JAX warns).

`run.compile_cache` names the folder (default `~/.cache/flexmarl/jax`; "" = off).
`$JAX_COMPILATION_CACHE_DIR`, when set, wins: it is JAX's own setting, and the test suite uses it to give every
test process one shared cache.
"""

from __future__ import annotations

import os

JAX_VARIABLE = "JAX_COMPILATION_CACHE_DIR"


def compile_cache_folder(configured: str) -> str | None:
    """The folder the run's compiled programs are kept in: `$JAX_COMPILATION_CACHE_DIR` if set, else
    `configured` with `~` expanded; None when the cache is off ("")."""
    from_environment = os.environ.get(JAX_VARIABLE)
    if from_environment:
        return from_environment
    return os.path.expanduser(configured) if configured else None


def enable_compile_cache(configured: str) -> str | None:
    """Points JAX's persistent compilation cache at `compile_cache_folder(configured)`, before the run's first
    compile (JAX reads the setting when it first compiles), and returns the folder (None: off)."""
    folder = compile_cache_folder(configured)
    if folder is None:
        return None
    import jax  # lazy: `flexmarl train --help` must not load JAX

    os.makedirs(folder, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    return folder
