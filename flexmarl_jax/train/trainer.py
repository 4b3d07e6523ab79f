"""AgentTrainer: one agent's policy (and optional critic) trained on its own mesh.

One iteration reads top to bottom:

    normalisers + advantages for the whole iteration   (host, before any micro-batch; see batch.py)
    for each micro-batch:  trainer.accumulate(batch)    (loss -> grads -> add to the fp32 accumulator)
    trainer.apply()                                     (one optimizer step, policy_version += 1)

Because every micro-batch's loss is already scaled by the iteration's normaliser, the accumulated
gradient *is* the full-batch gradient, and `apply` performs exactly the full-batch update.

Parameters, optimizer state and the accumulator live sharded on the agent's training mesh (FSDP over
"fsdp", tensor parallel over "tp", by the model's logical-axis rules); micro-batch rows are split over
"fsdp". Every jitted step has explicit in/out shardings and static shapes ``[micro_batch_size, L]`` with L
one of `TrainerConfig.length_buckets` (powers of two up to max_len): a micro-batch is padded to the smallest
bucket that holds its longest row, so short micro-batches cost less and compiles stay one per bucket.

Precision (`TrainerConfig.dtype`, `fp32_master_weights`): parameters and compute are float32 or bfloat16;
gradients are accumulated in float32 either way. With bfloat16 and master weights the optimizer state and a
float32 copy of the parameters are updated in float32 and the bfloat16 parameters are their cast; without,
the update is computed in float32 and stored in bfloat16 (updates below bfloat16's resolution are lost).

LoRA (`TrainerConfig.lora` with rank > 0): the trainer keeps the initial parameters as a frozen base and
trains a float32 adapter on it (models/lora.py); gradients, optimizer state and checkpoints cover the adapter
only (the base is the agent's `model`, loaded again on resume). `params` is the base with the adapter merged,
which is what a full-model rollout engine takes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from flexmarl_jax.mesh.meshes import make_mesh
from flexmarl_jax.models import functional
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.lora import AgentAdapter, init_adapters
from flexmarl_jax.train.batch import ARRAY_FIELDS, MicroBatch, validate_micro_batch
from flexmarl_jax.train.optim import OptimizerConfig
from flexmarl_jax.train.packing import pack_micro_batch, packed_bin_counts
from flexmarl_jax.train.rows_without_signal import (
    metrics_of_rows,
    rows_with_signal,
    skips_rows_without_signal,
    without_rows,
)
from flexmarl_jax.train.steps import steps_for
from flexmarl_jax.train.trainer_config import TrainerConfig
from flexmarl_jax.transfer import across_processes
from flexmarl_jax.transfer.across_processes import to_host

logger = logging.getLogger(__name__)

__all__ = ["AgentTrainer", "TrainerConfig"]  # TrainerConfig lives in trainer_config.py; most callers import it here


def _with_token_means(metrics: dict[str, float]) -> dict[str, float]:
    """The iteration's metrics plus the token means of its token sums (the truncated IS statistics)."""
    tokens = metrics.get("num_tokens", 0.0)
    if "is_weight_sum" in metrics and tokens > 0:
        metrics["is_weight_mean"] = metrics["is_weight_sum"] / tokens
        metrics["is_clip_fraction"] = metrics["is_clipped_tokens"] / tokens
    return metrics


def _no_skipped_rows() -> dict[str, float]:
    """The metrics of rows left out of the steps since the last `apply` (`AgentTrainer._count_skipped`)."""
    return {"num_tokens": 0.0, "ratio": 0.0, "skipped_rows": 0}


def _cast_params(params, dtype):
    """The parameters in `dtype` (the same arrays when they already are)."""
    return jax.tree.map(lambda leaf: leaf if leaf.dtype == dtype else leaf.astype(dtype), params)


class AgentTrainer:
    """Trains one agent: sharded params + optax state + fp32 gradient accumulator, versioned updates.

    agent: the agent's name; micro-batches of other agents are rejected.
    model_config: this agent's model (agents may differ in model, optimizer and learning rate).
    mesh: the agent's training mesh with axes ("fsdp", "tp"); default one device.
    initial: optional (graphdef, params) to start from (e.g. imported HF weights); else random init.
    seed: the random init's seed, or a LoRA agent's adapter init seed.
    base_record: a LoRA agent's base as its checkpoints record it (`ModelSource.base_record`: the directory and
        its digest, or the preset and its init seed), so that export and serving rebuild the policy from them.
    """

    def __init__(self, agent: str, model_config: ModelConfig, config: TrainerConfig, *,
                 mesh: Mesh | None = None, seed: int = 0, initial: tuple[Any, Any] | None = None,
                 base_record: Mapping[str, Any] | None = None):
        self.agent = agent
        self.base_record = dict(base_record or {})
        self.model_config = model_config
        self.config = config
        self.mesh = mesh if mesh is not None else make_mesh(jax.devices()[:1], fsdp=1)
        self.policy_version = 0
        self._pending_micro_batches = 0
        # Metrics of the rows `accumulate` left out since the last `apply` (train/rows_without_signal.py)
        self._skipped = _no_skipped_rows()

        dtype = jnp.dtype(config.dtype)
        if initial is None:
            # With master weights, initialise in float32 so the master copy holds the exact initial values.
            init_dtype = jnp.float32 if config.fp32_master_weights else dtype
            graphdef, policy = functional.init_params(model_config, seed=seed, mesh=self.mesh, dtype=init_dtype)
        else:
            graphdef, policy = initial
        self.graphdef = graphdef
        self._steps = steps = steps_for(graphdef, model_config, config, self.mesh)
        policy = across_processes.put(policy, steps.policy)
        self._base = None
        if steps.lora is not None:
            self._base = _cast_params(policy, dtype)
            adapters = init_adapters(model_config, steps.lora, seed=seed)
            self._trainable = {"adapters": across_processes.put(adapters, steps.trainable["adapters"])}
            self._master = self._reference = None
            self._opt_state = steps.init_opt(self._trainable)
            self._accum = steps.zeros_step(self._trainable)
            return
        trainable = {"policy": policy}
        if steps.has_critic:
            # The critic starts as a copy of the policy network with a zero value head (values 0).
            head = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), steps.abstract_value_head())
            trainable["critic"] = {"backbone": steps.copy_policy(policy),
                                   "head": across_processes.put(head, steps.trainable["critic"]["head"])}
        self._master = steps.to_float32(trainable) if config.fp32_master_weights else None
        trainable["policy"] = _cast_params(trainable["policy"], dtype)
        if steps.has_critic:
            trainable["critic"]["backbone"] = _cast_params(trainable["critic"]["backbone"], dtype)
        self._trainable = trainable
        self._reference = steps.copy_policy(trainable["policy"]) if steps.has_reference else None
        self._opt_state = steps.init_opt(self._master if self._master is not None else trainable)
        self._accum = steps.zeros_step(trainable)

    # ------------------------------------------------------------------------------ public API

    @property
    def params(self):
        """The policy parameters (nnx.State, sharded on this trainer's mesh) for weight sync; for a LoRA agent
        its base with the adapter merged (a new tree each call)."""
        self._check_attached()
        if self._base is not None:
            return self._steps.policy_params_step(self._trainable, self._base)
        return self._trainable["policy"]

    @property
    def rollout_weights(self):
        """What a weight sync sends to the agent's engines: the policy parameters, or for a LoRA agent its adapter
        alone (`AgentAdapter`): its base group's engines hold the base already."""
        self._check_attached()
        if self._base is not None:
            return AgentAdapter(self._trainable["adapters"], self.config.lora)
        return self._trainable["policy"]

    @property
    def base_params(self):
        """A LoRA agent's frozen base (what its group's engines serve under the adapters); None otherwise."""
        self._check_attached()
        return self._base

    @property
    def adapters(self):
        """A LoRA agent's adapter ({target: {"a", "b"}}, float32); None for a full fine-tune."""
        self._check_attached()
        return None if self._base is None else self._trainable["adapters"]

    @property
    def _frozen(self):
        """What the steps take beside the trainable tree: the base (LoRA) or the reference copy (or None)."""
        return self._base if self._base is not None else self._reference

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches accumulated since the last `apply`."""
        return self._pending_micro_batches

    def _bin_counts(self) -> tuple[int, ...]:
        """How many bins a packed micro-batch of this trainer may have (train/packing.py): a pass's rows split
        over "fsdp" need a multiple of its size."""
        split = self._steps.batch.spec[0] == "fsdp"
        return packed_bin_counts(self.config.micro_batch_size, self.config.pass_rows,
                                 dict(self.mesh.shape).get("fsdp", 1) if split else 1)

    def _place_passes(self, batch: MicroBatch, starts: list[int] | None = None) -> list[MicroBatch]:
        """The micro-batch (checked by `accumulate`, or packed by it) placed on the mesh whole when it has at most
        `pass_rows` rows, else cut into passes of `pass_rows` rows (those beginning at `starts`, default all). A
        packed batch's rows are its bins, fewer than the unpacked rows."""
        packed = batch.segment_ids is not None
        # The step is traced once per trainer config; the agent name was checked above, so drop it from
        # the static metadata to share compiled steps between agents with equal configs.
        batch = batch.replace(agent="")
        rows, total = self.config.pass_rows, batch.shape[0]
        starts = range(0, total, rows) if starts is None else starts
        if total <= rows:
            return [across_processes.put(batch, self._steps.batch) for _ in starts]
        fields = ARRAY_FIELDS + (("segment_ids",) if packed else ())
        return [across_processes.put(batch.replace(**{name: getattr(batch, name)[start:start + rows]
                                                      for name in fields}), self._steps.batch)
                for start in starts]

    def activate(self) -> None:
        """Holds training devices before a micro-batch. A dedicated trainer keeps its mesh for the whole run,
        so there is nothing to do (`orchestrator.shared_training.PooledTrainer` leases a shared slice)."""

    def release(self) -> None:
        """Lets other agents use the training devices while this one has nothing to train: a no-op for a
        dedicated trainer (see `activate`)."""

    def accumulate(self, batch: MicroBatch) -> None:
        """Adds this micro-batch's gradient to the accumulator; parameters do not change.

        Raises ValueError (before touching any state) for a batch of the wrong shape, dtype or agent. With
        `pack_rows`, an unpacked batch is packed first (train/packing.py). Rows whose gradient is exactly 0 are
        not computed where that is exact (train/rows_without_signal.py): with packing they stay out of the
        bins, without it a pass none of whose rows has signal is left out.
        """
        self._check_attached()
        validate_micro_batch(batch, agent=self.agent, batch_size=self.config.micro_batch_size,
                             max_len=self.config.max_len,
                             bin_counts=() if batch.segment_ids is None else self._bin_counts())
        # [rows] True where the row's gradient is exactly 0 and it need not be computed (rows_without_signal.py)
        total = batch.shape[0]
        without_signal = (~rows_with_signal(batch) if skips_rows_without_signal(self.config)
                          else np.zeros(total, bool))
        if self.config.pack_rows and batch.segment_ids is None:
            skipped = without_signal  # left out of the bins
            passes = [] if skipped.all() else self._place_passes(
                pack_micro_batch(without_rows(batch, skipped) if skipped.any() else batch, self._bin_counts()))
        else:  # a pass none of whose rows has signal is left out
            rows = self.config.pass_rows
            empty = np.array([without_signal[start:start + rows].all() for start in range(0, total, rows)])
            skipped = np.repeat(empty, rows)[:total]
            passes = self._place_passes(batch, [index * rows for index in np.flatnonzero(~empty)])
        self._count_skipped(batch, skipped)
        for placed in passes:
            self._accum = self._steps.accumulate_step(self._trainable, self._frozen, self._accum, placed)
        self._pending_micro_batches += 1

    def _count_skipped(self, batch: MicroBatch, rows: np.ndarray) -> None:
        """`rows` of `batch` (without signal) are not computed: their metrics (`metrics_of_rows`) are added at
        `apply`, and `skipped_rows` counts those that hold a sequence."""
        for name, value in metrics_of_rows(batch, rows).items():
            self._skipped[name] += value
        real = np.asarray(batch.attention_mask).sum(axis=1) > 0
        self._skipped["skipped_rows"] += int(np.count_nonzero(rows & real))

    def apply(self, *, allow_empty: bool = False) -> dict[str, float]:
        """One optimizer step with the accumulated gradient; policy_version += 1; clears the accumulator.

        Returns the iteration's metrics (weighted sums over its micro-batches, plus ``grad_norm``; with truncated
        IS also ``is_weight_mean``, ``is_weight_max`` and ``is_clip_fraction`` over the iteration's tokens).
        With no accumulated micro-batch this is an error unless ``allow_empty`` (then only the version
        advances, so every agent can move to the next iteration together).
        """
        self._check_attached()
        if self._pending_micro_batches == 0:
            if not allow_empty:
                raise RuntimeError(f"agent {self.agent!r}: apply() with no accumulated micro-batch "
                                   "(pass allow_empty=True to only advance policy_version)")
            self.policy_version += 1
            return {}
        self._trainable, self._master, self._opt_state, self._accum, metrics = self._steps.apply_step(
            self._trainable, self._master, self._opt_state, self._accum)
        self.policy_version += 1
        self._pending_micro_batches = 0
        metrics = {name: float(value) for name, value in jax.device_get(metrics).items()}
        skipped, self._skipped = self._skipped, _no_skipped_rows()
        for name, value in skipped.items():
            metrics[name] = metrics.get(name, 0.0) + value
        return _with_token_means(metrics)

    def reset_reference(self) -> None:
        """The KL's frozen reference becomes the current policy (a no-op when no reference is kept). Why: the
        reference is RL's starting point, and a supervised warm-up moves the policy after the trainer is built."""
        self._check_attached()
        if self._reference is not None:
            self._reference = self._steps.copy_policy(self._trainable["policy"])

    def reset_optimizer(self, optimizer: OptimizerConfig | None = None) -> None:
        """Starts a fresh optimizer state (zero moments) on the current parameters, with `optimizer` from now on
        when given (a learning rate for another phase of training) else the current one.

        Why: a supervised warm-up and RL are two trainings. Adam moments carried over from the warm-up, whose
        gradients shrank as it converged, turn RL's first, larger gradients into steps of several times the
        learning rate. Needs an empty accumulator (RuntimeError otherwise)."""
        self._check_attached()
        if self._pending_micro_batches:
            raise RuntimeError(f"agent {self.agent!r}: {self._pending_micro_batches} accumulated micro-batch(es) "
                               "would be lost; apply() or discard_accumulated() first")
        if optimizer is not None and optimizer != self.config.optimizer:
            self.config = dataclasses.replace(self.config, optimizer=optimizer)
            self._steps = steps_for(self.graphdef, self.model_config, self.config, self.mesh)
        steps = self._steps
        self._opt_state = steps.init_opt(self._master if self._master is not None else self._trainable)
        self._accum = steps.zeros_step(self._trainable)

    def discard_accumulated(self) -> None:
        """Drops the accumulated gradient without an update (e.g. an iteration aborted by a crash)."""
        self._accum = self._steps.zeros_step(self._trainable)
        self._pending_micro_batches = 0
        self._skipped = _no_skipped_rows()

    def accumulated_gradients(self):
        """The fp32 gradient sum so far (same structure as the trainable tree: {"policy": ..., ...})."""
        return self._accum["grads"]

    def logprobs(self, batch: MicroBatch, *, which: str = "policy") -> np.ndarray:
        """[micro_batch_size, max_len] float32 log-probs of ``batch.targets``.

        ``which="policy"`` uses the current parameters (the old-policy log-probs of this iteration),
        ``which="sampling"`` the same parameters under the agent's sampling distribution (temperature, top-k,
        top-p: what the truncated IS weight compares with behaviour log-probs), ``which="reference"`` the frozen
        reference (only when the KL is on).
        """
        self._check_attached()
        steps, frozen = self._steps, self._frozen
        if which == "policy":
            step = functools.partial(steps.logprobs_step, self._trainable, frozen)
        elif which == "sampling":
            step = functools.partial(steps.sampling_logprobs_step, self._trainable, frozen)
        elif which == "reference":
            if not steps.has_reference:
                raise ValueError(f"agent {self.agent!r} keeps no reference model (kl_coef=0 or "
                                 "reference_in_step=False)")
            step = functools.partial(steps.reference_logprobs_step, frozen)  # a LoRA agent's base is its reference
        else:
            raise ValueError(f"which={which!r}; allowed: 'policy', 'sampling', 'reference'")
        return np.concatenate([np.asarray(step(placed)) for placed in self._place_passes(batch)])

    def values(self, batch: MicroBatch) -> np.ndarray:
        """[micro_batch_size, max_len] float32 critic values (PPO only), for GAE before the iteration."""
        if "critic" not in self._trainable:
            raise ValueError(f"agent {self.agent!r} has no critic (loss {self.config.loss.name!r})")
        # to_host: on a training mesh over several processes the values are gathered first.
        return np.concatenate([to_host(self._steps.values_step(self._trainable["critic"], placed))
                               for placed in self._place_passes(batch)])

    # ------------------------------------------------------------------------- checkpoint state

    def checkpoint_state(self) -> dict:
        """{"trainable", "opt_state"} pytrees to save (plus "master" with float32 master weights and
        "reference" with a frozen reference); refuses while gradients are pending."""
        self._check_attached()
        if self._pending_micro_batches:
            raise RuntimeError(f"agent {self.agent!r}: {self._pending_micro_batches} micro-batches are "
                               "accumulated but not applied; checkpoint at an iteration boundary")
        state = {"trainable": self._trainable, "opt_state": self._opt_state}
        if self._master is not None:
            state["master"] = self._master
        if self._reference is not None:
            state["reference"] = self._reference
        return state

    def checkpoint_shardings(self) -> dict:
        """Target shardings of `checkpoint_state` on *this* trainer's mesh (for restore)."""
        shardings = {"trainable": self._steps.trainable, "opt_state": self._steps.opt}
        if self._steps.master is not None:
            shardings["master"] = self._steps.master
        if self._reference is not None:
            shardings["reference"] = self._steps.policy
        return shardings

    def load_checkpoint_state(self, state: dict, policy_version: int) -> None:
        """Adopts restored pytrees (already placed with `checkpoint_shardings`) and the version."""
        self._trainable = state["trainable"]
        self._opt_state = state["opt_state"]
        self._master = state.get("master")
        if self._reference is not None:
            self._reference = state["reference"]
        self.policy_version = int(policy_version)
        self.discard_accumulated()

    # ------------------------------------------------------------------------------- swap state
    # Agent-centric allocation suspends a trainer between micro-batches of an iteration and resumes it,
    # maybe on another mesh; unlike `checkpoint_state` this covers the pending gradient sum too.

    def swap_state(self) -> dict:
        """Hands over all of the trainer's state, mid-iteration too; the trainer then holds no arrays.

        Returns {"trainable", "opt_state", "accum" (fp32 gradient and metric sums), "master" (with float32
        master weights), "reference" (when a frozen reference is kept), "pending_micro_batches",
        "policy_version"}. Call `load_swap_state`
        before using the trainer again.
        """
        self._check_attached()
        state = {"trainable": self._trainable, "opt_state": self._opt_state, "accum": self._accum,
                 "pending_micro_batches": self._pending_micro_batches, "policy_version": self.policy_version}
        if self._master is not None:
            state["master"] = self._master
        if self._steps.reference is not None:
            state["reference"] = self._reference
        if self._base is not None:
            state["base"] = self._base
        self._trainable = self._opt_state = self._accum = self._reference = self._master = self._base = None
        self._detached = True
        return state

    def swap_shardings(self, mesh: Mesh | None = None) -> dict:
        """Target shardings of `swap_state` on ``mesh`` (default this trainer's mesh); ints map to None."""
        steps = self._steps if mesh is None else steps_for(self.graphdef, self.model_config, self.config, mesh)
        shardings = {"trainable": steps.trainable, "opt_state": steps.opt, "accum": steps.accum,
                     "pending_micro_batches": None, "policy_version": None}
        if steps.master is not None:
            shardings["master"] = steps.master
        if steps.reference is not None:
            shardings["reference"] = steps.reference
        if steps.lora is not None:
            shardings["base"] = steps.policy
        return shardings

    def load_swap_state(self, state: dict, *, mesh: Mesh | None = None) -> None:
        """Adopts a `swap_state` placed with `swap_shardings(mesh)`; the trainer runs on ``mesh`` from now on."""
        if mesh is not None and mesh != self.mesh:
            self.mesh = mesh
            self._steps = steps_for(self.graphdef, self.model_config, self.config, mesh)
        self._trainable, self._opt_state, self._accum = state["trainable"], state["opt_state"], state["accum"]
        self._reference = state.get("reference")
        self._master = state.get("master")
        self._base = state.get("base")
        self._pending_micro_batches = int(state["pending_micro_batches"])
        self.policy_version = int(state["policy_version"])
        self._detached = False

    _detached = False

    def _check_attached(self) -> None:
        if self._detached:
            raise RuntimeError(f"agent {self.agent!r}: the trainer's state was handed over by swap_state(); "
                               "load_swap_state() it back first")
