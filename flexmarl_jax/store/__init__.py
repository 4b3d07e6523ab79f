"""Experience store: per-agent versioned tables on TensorStore with exactly-once micro-batch claims."""

from flexmarl_jax.store.batch import ClaimedRows
from flexmarl_jax.store.commit import StoreBrokenError
from flexmarl_jax.store.layout import store_url
from flexmarl_jax.store.schema import ALLOWED_TYPES, RowState
from flexmarl_jax.store.store import ExperienceStore

__all__ = ["ALLOWED_TYPES", "ExperienceStore", "ClaimedRows", "RowState", "StoreBrokenError", "store_url"]
