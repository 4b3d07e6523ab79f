"""What a local Hugging Face checkpoint directory holds, checked before any weight is read.

`inspect_checkpoint_dir` reads ``config.json``, the tokenizer files and ``generation_config.json``,
and checks what would otherwise fail late and deep (in a jit trace, or mid-run when a token id
indexes past the embedding). Every problem is one line naming the file at fault. Weights are loaded
later, by `flexmarl_jax.models.checkpoint.from_pretrained`.
"""

from __future__ import annotations

import dataclasses
import json
import os

from flexmarl_jax.models.chat_template import TOKENIZER_CONFIG_FILE
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.tokenizer import HFTokenizer

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"
_INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A checked checkpoint directory: its model shape, tokenizer and ``generation_config.json`` ({} if absent)."""

    path: str
    model_config: ModelConfig
    tokenizer: HFTokenizer
    generation: dict


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    """Whether `path` names a directory holding a ``config.json`` (a checkpoint, not a preset name)."""
    path = os.fspath(path)
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG_FILE))


def inspect_checkpoint_dir(path: str | os.PathLike) -> CheckpointInfo:
    """Reads and checks a checkpoint directory without loading its weights.

    Raises a one-line ValueError naming the file for: a missing directory or ``config.json``, an
    unsupported architecture or field in ``config.json``, no tokenizer files, a tokenizer (or stop
    id) whose ids do not fit the model's embedding, no safetensors files (or an index naming absent ones).
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint directory {path} does not exist")
    model_config = _read_model_config(os.path.join(path, CONFIG_FILE))
    tokenizer = _read_tokenizer(path)
    _check_vocabulary_fits(path, tokenizer, model_config)
    _check_weight_files(path)
    generation_file = os.path.join(path, GENERATION_CONFIG_FILE)
    generation = _read_json(generation_file) if os.path.isfile(generation_file) else {}
    return CheckpointInfo(path=path, model_config=model_config, tokenizer=tokenizer, generation=generation)


def _read_json(file: str) -> dict:
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"{file} is not valid JSON (line {error.lineno}: {error.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(value).__name__}")
    return value


def _read_model_config(file: str) -> ModelConfig:
    if not os.path.isfile(file):
        raise ValueError(f"{file} is missing: a checkpoint directory needs the model's config.json")
    try:
        return ModelConfig.from_hf_config(_read_json(file))
    except KeyError as error:
        raise ValueError(f"{file} lacks the field {error.args[0]!r}") from None
    except ValueError as error:
        # ModelConfig's messages start with "config.json ..." when they are about a field of it.
        message = " ".join(str(error).split()).removeprefix("config.json ")
        raise ValueError(f"{file}: {message}") from None


def _read_tokenizer(path: str) -> HFTokenizer:
    tokenizer_file = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(tokenizer_file):
        has_config = os.path.isfile(os.path.join(path, TOKENIZER_CONFIG_FILE))
        detail = (
            "only tokenizer_config.json is there; save the fast tokenizer (tokenizer.json) with transformers"
            if has_config
            else "no tokenizer.json or tokenizer_config.json"
        )
        raise ValueError(f"{tokenizer_file} is missing: the checkpoint has no tokenizer files ({detail})")
    try:
        return HFTokenizer(path)
    except ValueError as error:
        raise ValueError(f"{tokenizer_file}: {' '.join(str(error).split())}") from None
    except Exception as error:  # the tokenizers library raises its own exception type for a malformed file
        raise ValueError(f"{tokenizer_file} cannot be read: {' '.join(str(error).split())}") from None


def _check_vocabulary_fits(path: str, tokenizer: HFTokenizer, config: ModelConfig) -> None:
    largest = tokenizer.max_token_id()
    if largest >= config.vocab_size:
        raise ValueError(
            f"{os.path.join(path, TOKENIZER_FILE)} has token id {largest}, but config.json vocab_size="
            f"{config.vocab_size}: the tokenizer's vocabulary does not fit the model's embedding"
        )
    # Stop ids beyond the tokenizer's own eos_token come from these files; name the one at fault.
    for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
        file = os.path.join(path, name)
        value = _read_json(file).get("eos_token_id") if os.path.isfile(file) else None
        ids = value if isinstance(value, list) else [value]
        outside = [i for i in ids if isinstance(i, int) and not 0 <= i < config.vocab_size]
        if outside:
            raise ValueError(
                f"{file} names eos_token_id {outside}, outside the model's vocabulary (config.json "
                f"vocab_size={config.vocab_size})"
            )


def _check_weight_files(path: str) -> None:
    index_file = os.path.join(path, _INDEX_FILE)
    if os.path.isfile(index_file):
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_file} has no 'weight_map'")
        absent = sorted(name for name in set(weight_map.values()) if not os.path.isfile(os.path.join(path, name)))
        if absent:
            raise ValueError(f"{index_file} lists weight files that are not in the directory: {absent[:3]}")
        return
    if not any(name.endswith(".safetensors") for name in os.listdir(path)):
        others = sorted(n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")))
        hint = f" (found {others[:3]}: convert them to safetensors)" if others else ""
        raise ValueError(f"{path} has no *.safetensors weight files{hint}")
