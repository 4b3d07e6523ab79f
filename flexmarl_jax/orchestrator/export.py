"""`flexmarl export WORKDIR --agent NAME --out DIR [--format merged|peft]`: one trained agent as a Hugging Face
model directory, or a LoRA agent's adapter as a PEFT adapter directory.

The directory holds ``config.json`` and safetensors weights (`models.checkpoint.save_pretrained`), the
tokenizer files and a ``generation_config.json``, so ``transformers.AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load it (and so does `models.checkpoint.from_pretrained`, for another run).
Only the policy parameters are read from the checkpoint, onto one CPU device: no trainer, no optimizer state.
Everything is written into a temporary directory beside DIR and renamed at the end, so a failed export leaves
nothing behind. docs/export.md describes the output.

A LoRA agent (`agents.<name>.lora.rank` > 0) exports either way: ``merged`` (the default) folds its adapter into
the base it was trained on, as a full model; ``peft`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` for ``peft.PeftModel.from_pretrained(base, DIR)``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import TypeVar

from flexmarl_jax.config import RunConfig
from flexmarl_jax.config.errors import ConfigError
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.hf_directory import inspect_checkpoint_dir, is_checkpoint_dir
from flexmarl_jax.models.presets import get_preset
from flexmarl_jax.models.tokenizer import CharTokenizer, Tokenizer
from flexmarl_jax.models.tokenizer_files import copy_tokenizer_files, write_char_tokenizer
from flexmarl_jax.train.checkpoint_integrity import CheckpointCorrupted

T = TypeVar("T")


class ExportError(Exception):
    """A bad workdir, agent, version or output directory; the message is one line naming it."""


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What `export_agent` wrote."""

    agent: str
    policy_version: int
    out: str
    files: tuple[str, ...]
    architecture: str
    num_params: int
    dtype: str

    def summary(self) -> str:
        return (f"exported agent {self.agent!r} policy_version {self.policy_version} ({self.architecture}, "
                f"{self.num_params / 1e6:.2f}M params, {self.dtype}) to {self.out}: {', '.join(self.files)}")


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where an agent's model came from (a preset name or a HF checkpoint directory) and what it says."""

    model: str
    model_config: ModelConfig
    tokenizer: Tokenizer
    checkpoint_dir: str | None  # None for a preset (character tokenizer)


FORMATS = ("merged", "peft")


def export_agent(workdir: str, agent: str, out: str, *, policy_version: int | None = None,
                 force: bool = False, format: str = "merged") -> ExportResult:
    """Exports ``agent``'s policy at ``policy_version`` (default: the latest) from a `flexmarl train` workdir:
    ``format="merged"`` a full model directory, ``"peft"`` a LoRA agent's adapter directory.

    Raises ExportError (one line, nothing written) for a workdir without a readable config.json, an unknown
    agent, a version that was not saved, a model source that no longer matches the checkpoint, a LoRA base that
    changed since training, ``peft`` for an agent without an adapter, or a non-empty ``out`` without ``force``.
    """
    if format not in FORMATS:
        raise ExportError(f"--format {format!r}: choose one of {', '.join(FORMATS)}")
    config = read_run_config(workdir)
    source = agent_source(config, agent, workdir)
    if format == "peft" and not config.agents[agent].lora.rank:
        raise ExportError(f"--format peft writes a LoRA adapter, and agent {agent!r} trained its whole model "
                          f"(config.agents.{agent}.lora.rank=0); use --format merged")
    checkpoints = saved_checkpoints(workdir, agent, policy_version)
    out = os.path.abspath(out)
    _check_output(out, force, protected=[workdir] + ([source.checkpoint_dir] if source.checkpoint_dir else []))

    snapshot = restore_matching_policy(checkpoints, policy_version, source, agent)
    # lazy: cli/import_gguf.py imports this module; `flexmarl import-gguf` needs no JAX (~1 s)
    import jax

    from flexmarl_jax.models.functional import param_count
    from flexmarl_jax.models.lora import adapter_count

    if format == "peft":
        files = write_directory(out, "export", lambda staging: _write_adapter_dir(staging, snapshot))
        return ExportResult(agent, snapshot.policy_version, out, tuple(files),
                            f"LoRA r={snapshot.lora.rank} on {snapshot.model_config.architecture}",
                            adapter_count(snapshot.adapters), "float32")
    files = write_directory(out, "export", lambda staging: _write_model_dir(staging, snapshot, source))
    dtype = "/".join(sorted({str(leaf.dtype) for leaf in jax.tree.leaves(snapshot.params)}))
    return ExportResult(agent, snapshot.policy_version, out, tuple(files), snapshot.model_config.architecture,
                        param_count(snapshot.params), dtype)


def read_run_config(workdir: str):
    """The `RunConfig` a `flexmarl train` workdir was written with (its config.json), fields added since it was
    written at their defaults (`missing_as_default`); ExportError (one line) when the file is missing or
    invalid."""
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise ExportError(f"{path} not found: WORKDIR must be a directory written by `flexmarl train`")
    try:
        with open(path) as handle:
            values = json.load(handle)
        return RunConfig.from_config(values, missing_as_default=True)
    except (json.JSONDecodeError, ConfigError) as error:
        raise ExportError(f"{path}: {error}") from None


def agent_source(config, agent: str, workdir: str) -> _Source:
    """Where ``agent`` of the run ``config`` (read from ``workdir``) got its model and tokenizer."""
    if agent not in config.agents:
        raise ExportError(f"unknown agent {agent!r}; agents in {os.path.join(workdir, 'config.json')}: "
                          f"{', '.join(config.agents)}")
    model = config.agents[agent].model

    if not is_checkpoint_dir(model):
        return _Source(model, get_preset(model), CharTokenizer(), None)
    try:
        info = inspect_checkpoint_dir(model)
    except ValueError as error:
        raise ExportError(f"config.agents.{agent}.model={model!r}: {error}") from None
    return _Source(model, info.model_config, info.tokenizer, info.path)


def saved_checkpoints(workdir: str, agent: str, policy_version: int | None) -> str:
    """``agent``'s checkpoint directory in ``workdir``, after checking it holds ``policy_version`` (None: any
    version); ExportError (one line, naming the saved versions) when it does not."""
    # lazy: train.checkpoint loads JAX and Orbax, which `flexmarl import-gguf` (cli/import_gguf.py) needs not
    from flexmarl_jax.train.checkpoint import CHECKPOINT_DIR, checkpoint_versions

    checkpoints = os.path.join(workdir, CHECKPOINT_DIR, agent)
    versions = checkpoint_versions(checkpoints)
    if not versions:
        raise ExportError(f"no checkpoints of agent {agent!r} under {checkpoints}")
    if policy_version is not None and policy_version not in versions:
        raise ExportError(f"--version {policy_version} was not saved: agent {agent!r} has no checkpoint at "
                          f"--version {policy_version} under {checkpoints}; "
                          f"available: {', '.join(map(str, versions))}")
    return checkpoints


def _check_output(out: str, force: bool, protected: list[str]) -> None:
    for path in map(os.path.abspath, protected):  # --force must never delete the run or the model it came from
        if os.path.commonpath([out, path]) == out:
            raise ExportError(f"--out {out} holds {path}, which export reads; choose another directory")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"--out {out} exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise ExportError(f"--out {out} is not empty; pass --force to replace it")


def restore_matching_policy(checkpoints: str, policy_version: int | None, source: _Source, agent: str, *,
                            merged: bool = True):
    """The saved policy, after checking that the agent's model source still describes it (the tokenizer
    files come from that source, so a source that changed since training would export the wrong ones).
    `merged=False`: a LoRA agent's adapter without its base (`restore_policy`)."""
    # lazy: train.checkpoint loads JAX and Orbax, which `flexmarl import-gguf` (cli/import_gguf.py) needs not
    from flexmarl_jax.train.checkpoint import restore_policy

    try:
        snapshot = restore_policy(checkpoints, policy_version, merged=merged)
    except (ValueError, FileNotFoundError) as error:  # arrays that miss the model's shapes; a LoRA base changed
        raise ExportError(str(error)) from None
    except CheckpointCorrupted as error:  # its files changed since the save, or the save never finished
        raise ExportError(f"{error}; pass an older --version") from None
    expected = source.model_config
    if snapshot.model_config != expected:
        differ = [field.name for field in dataclasses.fields(expected)
                  if getattr(expected, field.name) != getattr(snapshot.model_config, field.name)]
        raise ExportError(f"checkpoint {checkpoints}/{snapshot.policy_version} does not match "
                          f"config.agents.{agent}.model={source.model!r} (differs in {', '.join(differ)})")
    return snapshot


def _write_model_dir(directory: str, snapshot, source: _Source) -> list[str]:
    # lazy: models.checkpoint loads JAX, which `flexmarl import-gguf` (cli/import_gguf.py) needs not
    from flexmarl_jax.models.checkpoint import save_pretrained

    files = save_pretrained((snapshot.graphdef, snapshot.params), directory)
    if source.checkpoint_dir is not None:
        files += copy_tokenizer_files(source.checkpoint_dir, directory)
    else:
        files += write_char_tokenizer(directory, source.tokenizer,
                                      model_max_length=snapshot.model_config.max_position_embeddings)
    if "generation_config.json" not in files:
        with open(os.path.join(directory, "generation_config.json"), "w") as handle:
            json.dump(_generation_config(source.tokenizer), handle, indent=2)
        files.append("generation_config.json")
    return files


def _write_adapter_dir(directory: str, snapshot) -> list[str]:
    # lazy: models.peft_adapter loads JAX, which `flexmarl import-gguf` (cli/import_gguf.py) needs not
    from flexmarl_jax.models.peft_adapter import CONFIG_FILE, WEIGHTS_FILE, save_peft_adapter

    base = snapshot.base["model"] if "sha256" in snapshot.base else None  # a preset is no model PEFT can load
    save_peft_adapter(snapshot.adapters, snapshot.lora, directory, base_model=base)
    return [CONFIG_FILE, WEIGHTS_FILE]


def _generation_config(tokenizer: Tokenizer) -> dict:
    """The special ids transformers' `generate` needs: it stops at any eos_token_id and pads with pad_token_id."""
    stop_ids = list(tokenizer.stop_ids)
    config = {"eos_token_id": stop_ids if len(stop_ids) > 1 else stop_ids[0], "pad_token_id": tokenizer.pad_id}
    if tokenizer.bos_id is not None:
        config["bos_token_id"] = tokenizer.bos_id
    return config


def write_directory(out: str, tag: str, write: Callable[[str], T]) -> T:
    """Runs ``write(staging)`` in a fresh folder beside ``out`` and then puts that folder at ``out``; returns what
    ``write`` returned. On any failure the staging folder, and the parents of ``out`` made for it, are removed:
    nothing is left behind (``out`` itself was checked, emptied or absent, by the caller)."""
    created = _make_parents(out)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.{tag}-", dir=os.path.dirname(out))
    try:
        result = write(staging)
        _replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            shutil.rmtree(created, ignore_errors=True)
        raise
    return result


def _make_parents(out: str) -> str | None:
    """Creates the missing parents of ``out``; returns the topmost one created (removed again on failure)."""
    parent, topmost = os.path.dirname(out), None
    while not os.path.isdir(parent):
        topmost, parent = parent, os.path.dirname(parent)
    if topmost is not None:
        os.makedirs(os.path.dirname(out))
    return topmost


def _replace(staging: str, out: str) -> None:
    """Moves the finished directory to ``out`` (emptied or refused by `_check_output` before)."""
    umask = os.umask(0)
    os.umask(umask)
    # mkdtemp (and safetensors) make private files; the export is an ordinary directory
    os.chmod(staging, 0o777 & ~umask)
    for name in os.listdir(staging):
        os.chmod(os.path.join(staging, name), 0o666 & ~umask)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.replace(staging, out)
