"""Where an agent's model comes from: `agents.<name>.model` names a preset or a local HF checkpoint directory.

    source = resolve_model("runs/ckpt/qwen2.5-0.5b-instruct")   # or "tiny"
    source.model_config, source.tokenizer                        # read without loading any weight
    graphdef, params = source.initial_weights(mesh=mesh, dtype=jnp.bfloat16)   # None for a preset

A preset is randomly initialised and speaks the character-level `CharTokenizer`; a checkpoint directory brings
its own config, weights, tokenizer, stop tokens and chat template (models/hf_directory.py reads and checks it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

import jax.numpy as jnp

from flexmarl_jax.models import presets
from flexmarl_jax.models.checkpoint import from_pretrained
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.hf_directory import inspect_checkpoint_dir
from flexmarl_jax.models.tokenizer import CharTokenizer, Tokenizer


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """One agent's model as configured.

    name: the config value (preset name or directory).
    model_config: the architecture (the preset's, or the checkpoint's config.json).
    tokenizer: how its prompts are tokenised and its responses decoded.
    checkpoint_dir: the HF directory its weights load from; None for a randomly initialised preset.
    """

    name: str
    model_config: ModelConfig
    tokenizer: Tokenizer
    checkpoint_dir: str | None = None

    @property
    def is_chat(self) -> bool:
        """Whether its tokenizer has a chat template (then workflows send it chat prompts)."""
        return getattr(self.tokenizer, "chat_template", None) is not None

    def initial_weights(self, *, mesh: Any = None, dtype: Any = None) -> tuple[Any, Any] | None:
        """(graphdef, params) of the checkpoint placed on `mesh` in `dtype`; None for a preset (the trainer
        initialises it from the run's seed)."""
        if self.checkpoint_dir is None:
            return None

        loaded = from_pretrained(self.checkpoint_dir, mesh=mesh, dtype=dtype if dtype is not None else jnp.float32)
        return loaded.graphdef, loaded.params

    def base_record(self, init_seed: int) -> dict[str, Any]:
        """What identifies these weights as a LoRA base, for a checkpoint to record and its reader to find and
        check: the directory and the SHA-256 of its weight and config files, or the preset and the seed it was
        initialised with."""
        if self.checkpoint_dir is None:
            return {"model": self.name, "init_seed": int(init_seed)}
        return {"model": self.checkpoint_dir, "sha256": weights_digest(self.checkpoint_dir)}


def weights_digest(directory: str) -> str:
    """SHA-256 over a checkpoint directory's config.json and *.safetensors files (names and bytes, in name
    order): two directories with equal digests hold the same model."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        if name == "config.json" or name.endswith(".safetensors"):
            digest.update(name.encode() + b"\0")
            with open(os.path.join(directory, name), "rb") as file:
                for block in iter(lambda: file.read(1 << 24), b""):
                    digest.update(block)
    return digest.hexdigest()


def resolve_model(model: str) -> ModelSource:
    """The `ModelSource` a config value names. A directory is read and checked (config, tokenizer, weights
    present, vocabulary fits) without loading weights; raises ValueError naming the file or the preset list."""
    if os.path.isdir(model):
        info = inspect_checkpoint_dir(model)
        return ModelSource(model, info.model_config, info.tokenizer, os.path.abspath(model))
    return ModelSource(model, presets.get_preset(model), CharTokenizer())
