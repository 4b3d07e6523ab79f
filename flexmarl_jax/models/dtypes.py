"""Parameter dtypes an agent may choose, by name (pure Python: the config package checks names with it).

The name is also what `jnp.dtype(name)` takes, so the trainer and the engine need no table of their own.
"""

from __future__ import annotations

# name -> bytes per element (the memory estimate in config/memory.py reads this).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2}
PARAM_DTYPES: tuple[str, ...] = tuple(DTYPE_BYTES)


def master_weights_problem(dtype: str, fp32_master_weights: bool, *, where: str = "") -> str | None:
    """Why a float32 master copy does not apply to parameters of `dtype` (None when it does or is off); `where`
    prefixes the dtype's name (the config's path to it). The config check and a directly built `TrainerConfig`
    both ask this."""
    if fp32_master_weights and dtype == "float32":
        return (f"fp32_master_weights=True needs {where}dtype='bfloat16' (float32 parameters are their own master "
                "copy)")
    return None
