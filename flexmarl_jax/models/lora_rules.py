"""The rules of an agent's LoRA adapter that the run config checks (`agents.<name>.lora.rank` and `.alpha`) and
a directly built `lora.LoraSpec` checks too, one function each. A rule returns why a value is wrong, or None.
(The config spells the targets as one string, which `lora_targets.targets_problem` checks.)

Pure Python (no JAX import): config validation imports it when a config loads.
"""

from __future__ import annotations

import numbers


def lora_rank_problem(rank: int) -> str | None:
    """The adapter's rank: 0 means no adapter (the agent trains the full model)."""
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
        return "must be an integer >= 0 (0: full fine-tuning)"
    if rank < 0:
        return "must be >= 0 (0: full fine-tuning)"
    return None


def lora_alpha_problem(alpha: float) -> str | None:
    """The adapter's update is scaled by alpha / rank, so alpha must be positive."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        return "must be a number > 0 (the update is scaled by alpha / rank)"
    if not alpha > 0:  # also rejects NaN
        return "must be > 0 (the update is scaled by alpha / rank)"
    return None
