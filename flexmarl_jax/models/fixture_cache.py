"""Synthetic checkpoints made on first use, for recipes' CPU smoke variants (configs/gsm8k_chain.py:cpu_smoke).

A config file is loaded before JAX starts (the device count must be set first), so the checkpoint is written
by a child process (`models/synthetic.py` needs JAX to initialise weights). Checkpoints are cached under
``$FLEXMARL_FIXTURE_DIR`` (default ``~/.cache/flexmarl/fixtures``), one directory per (architecture, size,
seed); `make_checkpoint` renames a finished directory into place, so a reader never sees half of one.
"""

from __future__ import annotations

import os
import subprocess
import sys

FIXTURE_DIR_ENV = "FLEXMARL_FIXTURE_DIR"


def fixture_root() -> str:
    """Where synthetic checkpoints are cached."""
    return os.environ.get(FIXTURE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "flexmarl", "fixtures")


def synthetic_checkpoint(architecture: str, *, size: str = "smoke", seed: int = 0) -> str:
    """The directory of a synthetic `architecture` checkpoint (models/synthetic.py), made now if missing."""
    path = os.path.join(fixture_root(), f"{architecture}-{size}-seed{seed}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    code = ("import sys; from flexmarl_jax.models.synthetic import make_checkpoint; "
            "make_checkpoint(sys.argv[1], sys.argv[2], size=sys.argv[3], seed=int(sys.argv[4]))")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code, path, architecture, size, str(seed)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0 and not os.path.isfile(os.path.join(path, "config.json")):  # (another maker may win)
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"could not make the synthetic {architecture} checkpoint at {path}: {last}")
    return path
