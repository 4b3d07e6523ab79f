"""Experience store: per-agent versioned tables on TensorStore with exactly-once micro-batch claims.

Public names are imported lazily, so that `flexmarl_jax.store.backends` (the backend names config validation
lists) loads without TensorStore.
"""

import importlib

_EXPORTS = {
    "ALLOWED_TYPES": "schema",
    "ExperienceStore": "store",
    "ClaimedRows": "batch",
    "RowState": "schema",
    "StoreBrokenError": "commit",
    "StoreCorrupted": "corruption",
    "store_url": "layout",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flexmarl_jax.store' has no attribute {name!r}")
    return getattr(importlib.import_module(f"flexmarl_jax.store.{_EXPORTS[name]}"), name)
