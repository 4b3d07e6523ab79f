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


def decode_slots_problem(emulate: str, decode_slots: int, context: int, chips: int) -> str | None:
    """An emulated engine instance (`chips` chips of `emulate`'s CHIP:MODEL) holds `decode_slots` sequences of
    `context` positions: their KV cache must fit in its HBM beside the weights, as a real engine's memory check
    requires (config/memory.py)."""
    gb = 1e9  # as the chips' spec sheets print it (emulation/chips.py)
    from flexmarl_jax.emulation.cost_model import CostModel
    from flexmarl_jax.emulation.spec import parse_emulate

    device = parse_emulate(emulate)
    model = CostModel(device.model, device.chip, chips=chips, mfu=1.0)
    fit = model.decode_slots_that_fit(context)
    if decode_slots <= fit:
        return None
    need = decode_slots * context * model.kv_bytes_per_token()
    room = chips * device.chip.hbm_bytes - model.weights_bytes()
    return (f"needs {need / gb:.0f} GB of KV cache at the maximum context ({context} positions) on an engine "
            f"instance of {chips} {device.chip.name} chip(s) ({chips * device.chip.hbm_bytes / gb:.0f} GB of HBM, "
            f"{model.weights_bytes() / gb:.1f} GB of it {device.model_name}'s weights), which has room for "
            f"{max(room, 0) / gb:.0f} GB: at most {fit} slots fit; lower it or raise "
            "mesh.rollout_devices_per_instance")
