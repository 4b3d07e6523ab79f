"""The training rules that the run config checks and a directly built `TrainerConfig` / `LossConfig` checks too,
one function each (pure Python, like `algorithm_names`: config validation imports it without JAX). A rule returns
why a value is wrong, or None.
"""

from __future__ import annotations


def temperature_problem(temperature: float) -> str | None:
    """A training-side sampling temperature (the distribution rollout samples from) must be > 0."""
    return None if temperature > 0 else "must be > 0"


def top_k_problem(top_k: int) -> str | None:
    return None if top_k >= 0 else "must be >= 0 (0 disables top-k)"


def top_p_problem(top_p: float) -> str | None:
    return None if 0 < top_p <= 1 else "must be in (0, 1]"


def tis_cap_problem(cap: float) -> str | None:
    """The cap of the truncated importance weight pi_old / pi_behaviour."""
    return None if cap >= 1 else "must be >= 1 (a weight cap below 1 would down-weight on-policy tokens)"


def rows_per_pass_problem(rows_per_pass: int, micro_batch_size: int, *, where: str = "") -> str | None:
    """Why micro-batches of `micro_batch_size` rows cannot be trained in passes of `rows_per_pass` rows (0 = the
    whole micro-batch), or None; `where` prefixes micro_batch_size's name (the config's path to it)."""
    if rows_per_pass < 0 or (rows_per_pass and micro_batch_size % rows_per_pass):
        return (f"rows_per_pass={rows_per_pass} must divide {where}micro_batch_size={micro_batch_size} "
                "(0 = the whole micro-batch)")
    return None
