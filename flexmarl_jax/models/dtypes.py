"""Parameter dtypes an agent may choose, by name (pure Python: the config package checks names with it).

The name is also what `jnp.dtype(name)` takes, so the trainer and the engine need no table of their own.
"""

from __future__ import annotations

# name -> bytes per element (the memory estimate in config/memory.py reads this).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2}
PARAM_DTYPES: tuple[str, ...] = tuple(DTYPE_BYTES)
