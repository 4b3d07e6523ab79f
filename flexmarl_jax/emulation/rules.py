"""The emulation rules that the run config checks (`pipeline.emulate_*`) and a directly built `CostModel`,
`TimeScale` or `EmulatedEngine` checks too, one function each. A rule returns why a value is wrong, or None.

Pure Python, like the rest of this package's top level; the config imports it only when it checks a value
(config/rules.py), so that `flexmarl --help` does not load the emulation package.
"""

from __future__ import annotations


def mfu_problem(mfu: float) -> str | None:
    """Model-FLOPs utilisation of an emulated training step: a share of the chips' peak."""
    if 0 < mfu <= 1:
        return None
    return "is outside (0, 1]; the share of peak FLOP/s a training step reaches, e.g. 0.4"


def compression_problem(compression: float) -> str | None:
    """Device seconds per wall second: an emulated clock never runs slower than real time."""
    if compression >= 1:  # also rejects NaN
        return None
    return "must be >= 1 (device seconds per wall second; 1 = real time)"


def tokens_per_call_problem(tokens_per_call: int) -> str | None:
    """Decode steps an emulated engine advances per call at most."""
    if isinstance(tokens_per_call, bool) or not isinstance(tokens_per_call, int) or tokens_per_call < 1:
        return "must be an int >= 1 (1 = one decode step per call, like a real engine)"
    return None

