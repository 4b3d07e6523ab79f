"""LoRA adapters in PEFT's file format: an adapter directory that `peft.PeftModel.from_pretrained(base, dir)`
loads on the Hugging Face base model, and the reading of a plain LoRA directory (ours or PEFT's own `save_pretrained`;
anything else it would misread, it refuses by name).

The directory holds `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules) and
`adapter_model.safetensors` with one pair of tensors per adapted projection, named after the HF module
(`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`), A as ``[r, in]`` and B as ``[out, r]``:
torch Linear layout, flattened over heads. Ours are head-structured (models/lora.py), so A ``[*in, r]`` becomes
``A.reshape(-1, r).T`` and B ``[r, *out]`` becomes ``B.reshape(r, -1).T``; PEFT scales by lora_alpha / r as we do.
"""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.lora import LoraSpec, adapter_shapes, checked_adapter
from flexmarl_jax.models.lora_targets import ATTENTION_TARGETS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def _module(layer: int, target: str) -> str:
    block = "self_attn" if target in ATTENTION_TARGETS else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{target}"


def save_peft_adapter(adapters: dict, spec: LoraSpec, out_dir: str | os.PathLike, *,
                      base_model: str | os.PathLike | None = None) -> str:
    """Writes `adapters` ({target: {"a": [L, *in, r], "b": [L, r, *out]}}) as a PEFT LoRA directory; returns it.
    `base_model` goes to `base_model_name_or_path`, which PEFT only uses when it loads the base itself."""
    checked_adapter(adapters, spec, "the adapter")
    settings = json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
        "target_modules": sorted(adapters), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "inference_mode": True,
        "base_model_name_or_path": None if base_model is None else os.fspath(base_model),
    }, indent=2)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for target in sorted(adapters):
        a_all, b_all = (np.asarray(adapters[target][name], np.float32) for name in ("a", "b"))
        for layer in range(a_all.shape[0]):
            module = _module(layer, target)
            tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(a_all[layer].reshape(-1, spec.rank).T)
            tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(b_all[layer].reshape(spec.rank, -1).T)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as handle:
        handle.write(settings)
    return out_dir


def load_peft_adapter(directory: str | os.PathLike, config: ModelConfig) -> tuple[dict, LoraSpec]:
    """Reads a PEFT LoRA directory written for a model of `config` -> (adapters, spec). Raises ValueError naming
    the file and field for what this model cannot take (another method, rslora, a missing or misshapen tensor)."""
    directory = os.fspath(directory)
    config_path = os.path.join(directory, CONFIG_FILE)
    with open(config_path) as handle:
        settings = json.load(handle)
    if settings.get("peft_type") != "LORA":
        raise ValueError(f"{config_path}: peft_type={settings.get('peft_type')!r}; only LORA adapters load")
    if settings.get("use_rslora") or settings.get("use_dora"):
        raise ValueError(f"{config_path}: rslora and DoRA scale differently from lora_alpha / r; not supported")
    # What a plain adapter of ours cannot hold: each would be dropped or misread without a word.
    for field, plain in (("bias", "none"), ("lora_bias", False), ("modules_to_save", None), ("alpha_pattern", {}),
                         ("rank_pattern", {}), ("layers_to_transform", None), ("fan_in_fan_out", False)):
        value = settings.get(field)
        if value is not None and value != plain and value not in ([], {}):
            raise ValueError(f"{config_path}: {field}={settings[field]!r}; only {plain!r} is supported")
    targets = settings.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise ValueError(f"{config_path}: target_modules={targets!r}; name the projections as a list")
    spec = LoraSpec(rank=int(settings["r"]), alpha=float(settings["lora_alpha"]), targets=tuple(sorted(targets)))
    weights_path = os.path.join(directory, WEIGHTS_FILE)
    adapters = {}
    with safe_open(weights_path, framework="numpy") as tensors:
        names = set(tensors.keys())
        for target, (a_shape, b_shape) in adapter_shapes(config, spec).items():
            pairs = {"a": [], "b": []}
            for layer in range(config.num_layers):
                for name, letter, shape in (("a", "A", a_shape), ("b", "B", b_shape)):
                    key = f"{_module(layer, target)}.lora_{letter}.weight"
                    if key not in names:
                        raise ValueError(f"{weights_path} lacks tensor {key!r}")
                    array = tensors.get_tensor(key).astype(np.float32)
                    expected = (spec.rank, int(np.prod(shape[:-1]))) if name == "a" else (int(np.prod(shape[1:])),
                                                                                         spec.rank)
                    if array.shape != expected:
                        raise ValueError(f"{weights_path}: {key} has shape {list(array.shape)}, expected "
                                         f"{list(expected)}")
                    pairs[name].append(array.T.reshape(shape))
            adapters[target] = {name: np.stack(arrays) for name, arrays in pairs.items()}
        unused = sorted(names - {f"{_module(layer, target)}.lora_{letter}.weight" for target in spec.targets
                                 for layer in range(config.num_layers) for letter in "AB"})
        if unused:
            raise ValueError(f"{weights_path} has tensors this model's adapter does not use: {unused[:3]}")
    return adapters, spec
