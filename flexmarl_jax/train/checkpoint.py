"""Orbax checkpoints of agent trainers: parameters, optimizer state and policy version.

Layout: ``ROOT/<agent>/<policy_version>/{state,meta}`` (an Orbax CheckpointManager per agent); a run keeps
ROOT at ``WORKDIR/checkpoints``. ``state`` is a flat ``{name: array}`` dict whose names are the pytree paths
(``trainable.policy.layers.0...``): stable, readable with any Orbax tool, and independent of mesh shape.
Restoring reads every array straight into the *target trainer's* shardings, so a checkpoint written on an
8-way FSDP mesh restores onto a 2x2 FSDP x TP mesh (or one device) without a gather on the host.
`restore_policy` reads only the policy parameters, without a trainer or its optimizer state (export).

Integrity: every save ends with a manifest of the CRC-32 of each file of its step (`checkpoint_integrity`), and
every restore verifies it first, so a step whose bytes changed on disk, or whose save never finished, raises
`CheckpointCorrupted` instead of restoring wrong numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from flexmarl_jax import faults
from flexmarl_jax.distributed.barrier import barrier
from flexmarl_jax.models.checkpoint import from_pretrained
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.functional import abstract_model, init_params
from flexmarl_jax.models.lora import LoraSpec, init_adapters, merge_adapter
from flexmarl_jax.models.sources import weights_digest
from flexmarl_jax.train import checkpoint_integrity
from flexmarl_jax.train.trainer import AgentTrainer
from flexmarl_jax.workdir_paths import orbax_directory

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"  # a run's checkpoints live in WORKDIR/checkpoints/<agent>/<policy_version>
# `AgentTrainer.checkpoint_state` keeps the policy network at trainable.policy; everything else in a checkpoint
# (optimizer moments, critic, reference) is training state that a finished model does not need.
_POLICY_PREFIX = "trainable.policy."


def _key_name(entry) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(entry, attribute):
            return str(getattr(entry, attribute))
    raise TypeError(f"unsupported pytree key {entry!r}")


def flatten_to_names(tree) -> tuple[dict[str, jax.Array], jax.tree_util.PyTreeDef]:
    """``{"a.b.0.value": leaf}`` for every leaf of ``tree``, plus the treedef to rebuild it."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat = {}
    for path, leaf in with_paths:
        name = ".".join(_key_name(entry) for entry in path)
        if name in flat:
            raise ValueError(f"two leaves map to the checkpoint name {name!r}")
        flat[name] = leaf
    return flat, treedef


def _meta(trainer: AgentTrainer) -> dict:
    meta = {
        "agent": trainer.agent,
        "policy_version": trainer.policy_version,
        "model_config": dataclasses.asdict(trainer.model_config),
        "loss": dataclasses.asdict(trainer.config.loss),
        "optimizer": dataclasses.asdict(trainer.config.optimizer),
        "mesh_shape": dict(trainer.mesh.shape),
        "lora": dataclasses.asdict(trainer.config.lora),
    }
    if trainer.config.lora.rank:  # the state holds the adapter only: say which base it goes on
        meta["base"] = dict(trainer.base_record, dtype=trainer.config.dtype)
    return meta


def _lora_of(meta: Mapping) -> dict:
    """A checkpoint's LoRA spec, to compare: every full fine-tune is {"rank": 0} whatever its alpha and targets
    (and a checkpoint from before adapters existed is one)."""
    lora = meta.get("lora", {"rank": 0})
    return dict(lora) if lora["rank"] else {"rank": 0}


def _manager(directory: str | os.PathLike, max_to_keep: int | None = None) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(orbax_directory(directory), options=options,
                                 item_names=("state", "meta"))


def step_directory(directory: str | os.PathLike, policy_version: int) -> str:
    """Where Orbax keeps one agent's checkpoint of ``policy_version`` (CheckpointManager's default step names)."""
    return os.fspath(orbax_directory(directory, str(int(policy_version))))


def verify_checkpoint(directory: str | os.PathLike, policy_version: int) -> None:
    """Raises CheckpointCorrupted unless the agent's checkpoint of ``policy_version`` matches its manifest."""
    checkpoint_integrity.verify(step_directory(directory, policy_version))


def save_trainer(trainer: AgentTrainer, directory: str | os.PathLike, *, max_to_keep: int | None = None) -> int:
    """Writes the trainer's state under ``directory/<policy_version>``; returns that version.

    Must be called at an iteration boundary (no pending micro-batches): a checkpoint never holds a
    half-accumulated gradient, because the store replays unapplied samples after a restart.
    """
    faults.raise_if_fired("checkpoint_save", trainer.agent)
    flat, _ = flatten_to_names(trainer.checkpoint_state())
    step = trainer.policy_version
    with _manager(directory, max_to_keep) as manager:
        manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(flat),
                                                   meta=ocp.args.JsonSave(_meta(trainer))), force=True)
        manager.wait_until_finished()
    # Written once Orbax has finalized the step: a step with a manifest is complete (checkpoint_integrity).
    # With several processes Orbax has finalized the step on every one when `wait_until_finished` returns on
    # process 0, which alone writes the manifest (one writer per file); the barrier keeps any process from
    # reading the step before its manifest exists.
    if jax.process_index() == 0:
        checkpoint_integrity.write_manifest(step_directory(directory, step))
    barrier()  # nothing with one process
    logger.info("saved agent %r policy_version %d to %s", trainer.agent, step, directory)
    return step


def restore_trainer(trainer: AgentTrainer, directory: str | os.PathLike,
                    policy_version: int | None = None, *, verify: bool = True) -> int:
    """Loads a checkpoint into ``trainer`` (on the trainer's own mesh); returns the restored version.

    ``policy_version=None`` takes the latest. The checkpoint must come from the same agent, model and
    loss (the optimizer state must match the trainer's optimizer); the mesh may differ. Its files are verified
    against its manifest first (CheckpointCorrupted); ``verify=False`` only for a caller that has just verified
    this step itself (a resume, which verifies every agent's step before choosing the version to restore).
    """
    with _manager(directory) as manager:
        step = manager.latest_step() if policy_version is None else int(policy_version)
        if step is None or step not in manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for policy_version={policy_version} under {directory}; "
                                    f"available: {sorted(manager.all_steps())}")
        if verify:
            verify_checkpoint(directory, step)
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        expected = json.loads(json.dumps(_meta(trainer)))
        meta["lora"], expected["lora"] = _lora_of(meta), _lora_of(expected)
        for field in ("agent", "model_config", "loss", "optimizer", "lora", "base"):
            if meta.get(field) != expected.get(field):
                raise ValueError(f"checkpoint {directory}/{step} has {field}={meta.get(field)!r}, but this trainer "
                                 f"has {field}={expected.get(field)!r}")
        template, treedef = flatten_to_names(trainer.checkpoint_state())
        shardings, _ = flatten_to_names(trainer.checkpoint_shardings())
        target = {name: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=shardings[name])
                  for name, leaf in template.items()}
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    state = jax.tree_util.tree_unflatten(treedef, [restored["state"][name] for name in template])
    trainer.load_checkpoint_state(state, meta["policy_version"])
    logger.info("restored agent %r policy_version %d from %s onto mesh %s", trainer.agent, step, directory,
                dict(trainer.mesh.shape))
    return step


def save_all(trainers: Mapping[str, AgentTrainer], root: str | os.PathLike, **kwargs) -> dict[str, int]:
    """Saves every agent under ``root/<agent>``; returns {agent: policy_version}."""
    return {name: save_trainer(t, orbax_directory(root, name), **kwargs) for name, t in trainers.items()}


def restore_all(trainers: Mapping[str, AgentTrainer], root: str | os.PathLike) -> dict[str, int]:
    """Restores every agent from ``root/<agent>`` (latest version each); returns {agent: policy_version}."""
    return {name: restore_trainer(t, orbax_directory(root, name)) for name, t in trainers.items()}


class PolicySnapshot(NamedTuple):
    """One agent's policy network as saved at one version (what `restore_policy` returns)."""

    policy_version: int
    model_config: ModelConfig
    graphdef: Any
    params: nnx.State | None  # on one device, in the trainer's dtype; a LoRA agent's base with its adapter merged
    # (None where `restore_policy(merged=False)` left a LoRA agent's base unread)
    lora: LoraSpec | None = None  # a LoRA agent's spec, with its adapter and base record:
    adapters: dict | None = None
    base: dict | None = None


def checkpoint_versions(directory: str | os.PathLike) -> list[int]:
    """The policy versions saved under ``directory`` (one agent's checkpoints), ascending; [] if none."""
    directory = orbax_directory(directory)
    if not directory.is_dir():
        return []
    with _reader(directory) as manager:
        return sorted(manager.all_steps())


def _reader(directory) -> ocp.CheckpointManager:
    # create=False: reading never makes a directory (nothing else is written without a save); the handlers let
    # item_metadata see the tree.
    options = ocp.CheckpointManagerOptions(create=False)
    return ocp.CheckpointManager(directory, options=options, item_names=("state", "meta"),
                                 item_handlers={"state": ocp.PyTreeCheckpointHandler(),
                                                "meta": ocp.JsonCheckpointHandler()})


def restore_policy(directory: str | os.PathLike, policy_version: int | None = None, *,
                   device: jax.Device | None = None, merged: bool = True) -> PolicySnapshot:
    """Reads only the policy parameters of one agent's checkpoint onto one device (default: the first CPU).

    Builds no trainer and reads no optimizer state, so exporting a model needs memory for its parameters
    only. ``policy_version=None`` takes the latest. The arrays keep the dtype they were saved in. The step is
    verified against its manifest first (CheckpointCorrupted). ``merged=False``: a LoRA agent's snapshot carries
    its adapter and base record but no params, and the base is not read (an engine serving a base group reads it
    once for all its agents); a full fine-tune's params are read either way.
    """
    directory = orbax_directory(directory)
    versions = checkpoint_versions(directory)
    step = (versions[-1] if versions else None) if policy_version is None else int(policy_version)
    if step is None or step not in versions:
        raise FileNotFoundError(f"no checkpoint for policy_version={policy_version} under {directory}; "
                                f"available: {versions}")
    verify_checkpoint(directory, step)
    sharding = jax.sharding.SingleDeviceSharding(device if device is not None else jax.devices("cpu")[0])
    with _reader(directory) as manager:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        saved = manager.item_metadata(step)["state"]
        model_config = ModelConfig(**meta["model_config"])
        if _lora_of(meta)["rank"]:
            return _restore_lora_policy(manager, directory, step, meta, saved, sharding, merged)
        dtype = saved[_POLICY_PREFIX + "embed.embedding.value"].dtype
        graphdef, abstract = abstract_model(model_config, dtype=dtype)
        policy = _restore_partial(manager, directory, step, saved, {"trainable": {"policy": abstract}},
                                  sharding)["trainable"]["policy"]
    return PolicySnapshot(int(meta["policy_version"]), model_config, graphdef, policy)


def _restore_partial(manager, directory, step, saved, tree, sharding) -> Any:
    """``tree`` (of ShapeDtypeStructs) read from the checkpoint's state by name, onto ``sharding``; a missing or
    differently shaped array is a ValueError."""
    expected, treedef = flatten_to_names(tree)
    for name, leaf in expected.items():
        if name not in saved or tuple(saved[name].shape) != tuple(leaf.shape):
            found = tuple(saved[name].shape) if name in saved else "nothing"
            raise ValueError(f"checkpoint {directory}/{step} holds {found} at {name}, but its model_config "
                             f"needs shape {tuple(leaf.shape)}")
    target = {name: jax.ShapeDtypeStruct(saved[name].shape, saved[name].dtype, sharding=sharding)
              for name in expected}
    restore_args = {name: ocp.ArrayRestoreArgs(sharding=sharding, dtype=saved[name].dtype) for name in expected}
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(target, restore_args=restore_args, partial_restore=True)))["state"]
    return jax.tree_util.tree_unflatten(treedef, [restored[name] for name in expected])


def _restore_lora_policy(manager, directory, step, meta, saved, sharding, merged: bool) -> PolicySnapshot:
    """A LoRA agent's policy: its adapter from the checkpoint, merged onto the base its meta records (unless not
    `merged`: then params is None and the base is not read)."""
    lora = meta["lora"]
    spec = LoraSpec(lora["rank"], lora["alpha"], tuple(lora["targets"]))
    model_config = ModelConfig(**meta["model_config"])
    abstract = jax.eval_shape(functools.partial(init_adapters, model_config, spec, seed=0))
    adapters = _restore_partial(manager, directory, step, saved, {"trainable": {"adapters": abstract}},
                                sharding)["trainable"]["adapters"]
    if not merged:
        graphdef, _ = abstract_model(model_config, dtype=jnp.dtype(meta["base"]["dtype"]))
        return PolicySnapshot(int(meta["policy_version"]), model_config, graphdef, None, lora=spec, adapters=adapters,
                              base=dict(meta["base"]))
    graphdef, base = load_base(meta["base"], model_config, sharding)
    return PolicySnapshot(int(meta["policy_version"]), model_config, graphdef, merge_adapter(base, adapters, spec),
                          lora=spec, adapters=adapters, base=dict(meta["base"]))


def load_base(record: Mapping[str, Any], model_config: ModelConfig, sharding) -> tuple[Any, nnx.State]:
    """(graphdef, params) of the LoRA base a checkpoint records (`ModelSource.base_record` plus its dtype): the
    directory, refused when its weights changed since (SHA-256), or the preset initialised with its seed."""
    dtype = jnp.dtype(record["dtype"])
    if "sha256" in record:
        directory = record["model"]
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"the LoRA base {directory} this checkpoint was trained on is gone")
        found = weights_digest(directory)
        if found != record["sha256"]:
            raise ValueError(f"the LoRA base {directory} has changed since this checkpoint was trained on it "
                             f"(sha256 {found[:12]}..., recorded {record['sha256'][:12]}...)")
        loaded = from_pretrained(directory, dtype=dtype)
        return loaded.graphdef, jax.device_put(loaded.params, sharding)
    graphdef, params = init_params(model_config, seed=int(record["init_seed"]), dtype=dtype)
    return graphdef, jax.device_put(params, sharding)
