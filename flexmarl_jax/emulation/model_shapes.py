"""The model shape an emulated device runs: a preset name, a Hugging Face `config.json`, or a directory
holding one. Only the shape matters (no weights, no tokenizer), so a directory needs nothing but its
config.json. Pure Python."""

from __future__ import annotations

import json
import os

from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.presets import PRESETS


def resolve_model_shape(model: str) -> ModelConfig:
    """The `ModelConfig` that `model` names; ValueError naming the value and the choices otherwise."""
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if path.endswith(".json") and os.path.isfile(path):
        with open(path) as handle:
            try:
                hf = json.load(handle)
            except json.JSONDecodeError as error:
                raise ValueError(f"model {model!r}: {path} is not JSON ({error.msg}, line {error.lineno})") from None
        try:
            return ModelConfig.from_hf_config(hf)
        except KeyError as missing:
            raise ValueError(f"model {model!r}: {path} lacks the field {missing}") from None
    if model in PRESETS:
        return PRESETS[model]
    raise ValueError(f"unknown model {model!r}; choices: a preset ({', '.join(sorted(PRESETS))}), "
                     "a Hugging Face config.json or a directory holding one")
