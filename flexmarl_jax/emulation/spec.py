"""`--emulate CHIP:MODEL` (and `pipeline.emulate`): which chip and which model shape an emulated run
pretends to have. Pure Python; errors are one line naming the value and the choices."""

from __future__ import annotations

import dataclasses

from flexmarl_jax.emulation.chips import Chip, get_chip
from flexmarl_jax.emulation.model_shapes import resolve_model_shape
from flexmarl_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class EmulatedDevice:
    """What `CHIP:MODEL` names: the chip, the model as written, and its shape."""

    chip: Chip
    model_name: str
    model: ModelConfig


def parse_emulate(text: str) -> EmulatedDevice:
    """Parses `CHIP:MODEL`, e.g. `v5p:qwen2.5-14b` or `h200:/ckpt/Qwen2.5-32B/config.json` (split at the first
    colon, so a model path may hold colons)."""
    chip_name, colon, model = str(text).partition(":")
    if not colon or not chip_name.strip() or not model.strip():
        raise ValueError(f"emulate={text!r} is not CHIP:MODEL (e.g. v5p:qwen2.5-14b)")
    model = model.strip()
    return EmulatedDevice(get_chip(chip_name), model, resolve_model_shape(model))
