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
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flexmarl_jax.distributed.cpu_completion import completed, needs_completion
from flexmarl_jax.mesh.meshes import make_mesh
from flexmarl_jax.models import functional
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.dtypes import PARAM_DTYPES
from flexmarl_jax.models.sampling_distribution import is_plain_softmax, sampling_token_logprobs
from flexmarl_jax.train.batch import ARRAY_FIELDS, MicroBatch, length_buckets, validate_micro_batch
from flexmarl_jax.train.losses import LOSSES, LossConfig, accumulate_metrics
from flexmarl_jax.train.optim import OptimizerConfig, make_optimizer
from flexmarl_jax.transfer import across_processes
from flexmarl_jax.transfer.across_processes import to_host

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Static settings of one agent's trainer."""

    micro_batch_size: int  # rows per micro-batch (the static batch dim of every step)
    max_len: int  # longest sequence of a micro-batch (prompt + response - 1 fits in it); the last length bucket
    loss: LossConfig = LossConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    # When the KL is on, compute reference log-probs inside the step from a frozen copy of the initial
    # policy; False uses the `ref_logprobs` the micro-batch carries.
    reference_in_step: bool = True
    # The parameters do not change inside an iteration, so they *are* the old policy: take the PPO
    # ratio's denominator from the same forward pass (exact, no extra pass, ratio == 1), and the truncated
    # IS weight's numerator, the old policy's sampling distribution (below), from the same logits.
    # False uses batch.old_logprobs and batch.old_sampling_logprobs.
    old_logprobs_in_step: bool = True
    # How the agent's rollouts sample: the engine records behaviour log-probs of this distribution
    # (models/sampling_distribution.py), so the truncated IS weight evaluates the old policy under it too.
    # A top-k or top-p filter sorts the vocabulary at every trained position (with truncated IS only).
    sampling_temperature: float = 1.0
    sampling_top_k: int = 0  # 0 = no top-k filter
    sampling_top_p: float = 1.0
    # Donating params saves one parameter copy at apply time, but invalidates arrays anyone else still
    # holds (e.g. a colocated rollout engine that received `trainer.params`), so it is opt-in.
    donate_params: bool = False
    dtype: str = "float32"  # parameters and compute: a name in models/dtypes.PARAM_DTYPES
    fp32_master_weights: bool = False  # bfloat16 only: the optimizer updates a float32 copy of the parameters
    remat: bool = False  # recompute each decoder layer in the backward pass instead of keeping its activations
    # Rows one forward+backward pass takes (0 = the whole micro-batch): a micro-batch is split into passes of
    # this many rows whose gradients add up in the accumulator, so peak activation memory (the float32
    # logits over a 150k vocabulary above all) follows this, not the micro-batch the pipeline claims.
    rows_per_pass: int = 0

    def __post_init__(self):
        if self.micro_batch_size < 1 or self.max_len < 2:
            raise ValueError(f"micro_batch_size={self.micro_batch_size} must be >= 1 and "
                             f"max_len={self.max_len} >= 2")
        if self.rows_per_pass < 0 or self.micro_batch_size % self.pass_rows:
            raise ValueError(f"rows_per_pass={self.rows_per_pass} must divide micro_batch_size="
                             f"{self.micro_batch_size} (0 = the whole micro-batch)")
        if self.dtype not in PARAM_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not allowed; choose one of: {', '.join(PARAM_DTYPES)}")
        if self.fp32_master_weights and self.dtype == "float32":
            raise ValueError("fp32_master_weights=True needs dtype='bfloat16' (float32 parameters are their "
                             "own master copy)")
        if self.sampling_temperature <= 0 or self.sampling_top_k < 0 or not 0 < self.sampling_top_p <= 1:
            raise ValueError(f"sampling_temperature={self.sampling_temperature} must be > 0, sampling_top_k="
                             f"{self.sampling_top_k} >= 0 and sampling_top_p={self.sampling_top_p} in (0, 1]")

    @property
    def pass_rows(self) -> int:
        """Rows of one forward+backward pass."""
        return self.rows_per_pass or self.micro_batch_size

    @property
    def length_buckets(self) -> tuple[int, ...]:
        """Sequence lengths a micro-batch may have (one compile of each step per length)."""
        return length_buckets(self.max_len)


def _cast_like(tree, like):
    """`tree` with every leaf cast to the dtype of the matching leaf of `like`."""
    return jax.tree.map(lambda leaf, target: leaf.astype(target.dtype), tree, like)


def _sum_tree(total, increment):
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), total, increment)


def _shardings_like_params(abstract_tree, param_structure, param_shardings, replicated):
    """Shardings for an optimizer state: every sub-tree shaped like the params gets the params' shardings.

    Optax states hold moment trees with exactly the trainable structure (mu, nu, ...) plus scalars
    (step counts), which are replicated.
    """

    def is_param_tree(node) -> bool:
        return jax.tree.structure(node) == param_structure

    def pick(node):
        return param_shardings if is_param_tree(node) else replicated

    return jax.tree.map(pick, abstract_tree, is_leaf=is_param_tree)


def abstract_micro_batch(batch_size: int, max_len: int, agent: str = "") -> MicroBatch:
    """A MicroBatch of ShapeDtypeStructs ``[batch_size, max_len]`` (for eval_shape / AOT lowering)."""
    dtypes = {name: jnp.float32 for name in ARRAY_FIELDS}
    dtypes.update(tokens=jnp.int32, targets=jnp.int32, positions=jnp.int32,
                  attention_mask=jnp.bool_, loss_mask=jnp.bool_)
    shape = (batch_size, max_len)
    return MicroBatch(**{n: jax.ShapeDtypeStruct(shape, d) for n, d in dtypes.items()}, agent=agent)


class _Steps:
    """The jitted steps and shardings of one (model, trainer config, mesh); shared by equal trainers.

    Building this traces and compiles, so trainers with the same model/config/mesh (e.g. a trainer
    rebuilt to restore a checkpoint) reuse one instance via `_steps_for`.
    """

    def __init__(self, graphdef, model_config: ModelConfig, config: TrainerConfig, mesh: Mesh):
        self.graphdef = graphdef
        self.vocab_size = model_config.vocab_size
        self.config = config
        self.loss_fn = LOSSES.get(config.loss.name)
        self.tx = make_optimizer(config.optimizer)
        self.has_critic = config.loss.needs_values
        self.has_reference = config.loss.kl_coef > 0 and config.reference_in_step

        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.waits_for_completion = needs_completion(mesh)  # a CPU mesh over several processes
        # Rows over "fsdp" (data parallel inside FSDP); replicate when the rows don't split evenly.
        fsdp = dict(mesh.shape).get("fsdp", 1)
        row_axis = "fsdp" if config.pass_rows % fsdp == 0 else None
        self.batch = NamedSharding(mesh, PartitionSpec(row_axis, None))

        _, abstract_policy = functional.abstract_model(model_config, dtype=jnp.dtype(config.dtype))
        policy_sh = functional.param_shardings(abstract_policy, mesh)
        self.policy = policy_sh
        self.trainable = {"policy": policy_sh}
        abstract_trainable = {"policy": abstract_policy}
        if self.has_critic:
            head_sh = {"kernel": self.replicated, "bias": self.replicated}
            self.trainable["critic"] = {"backbone": policy_sh, "head": head_sh}
            abstract_trainable["critic"] = {"backbone": abstract_policy, "head": self.abstract_value_head()}
        self.reference = policy_sh if self.has_reference else None
        # The float32 copy the optimizer updates (None without master weights); sharded like the parameters.
        self.master = self.trainable if config.fp32_master_weights else None
        abstract_updated = abstract_trainable  # what the optimizer updates (its state has this dtype)
        if config.fp32_master_weights:
            abstract_updated = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), abstract_trainable)
        abstract_opt = jax.eval_shape(self.tx.init, abstract_updated)
        self.opt = _shardings_like_params(abstract_opt, jax.tree.structure(abstract_trainable),
                                          self.trainable, self.replicated)
        abstract_ref = abstract_policy if self.has_reference else None
        batch = abstract_micro_batch(config.pass_rows, config.max_len)
        self.metric_names = sorted(jax.eval_shape(self.loss_and_metrics, abstract_trainable, abstract_ref,
                                                  batch)[1])
        self.accum = {"grads": self.trainable, "metrics": {n: self.replicated for n in self.metric_names}}
        self._jit_all()

    def abstract_value_head(self):
        return {"kernel": jax.ShapeDtypeStruct((self.vocab_size,), jnp.float32),
                "bias": jax.ShapeDtypeStruct((), jnp.float32)}

    # ------------------------------------------------------------------------------ model math

    def logits(self, params, batch: MicroBatch) -> jax.Array:
        """[B, T, V] logits of the next token after each input token under ``params``."""
        return functional.forward(self.graphdef, params, batch.tokens, batch.positions, batch.attention_mask,
                                  remat=self.config.remat)

    def token_logprobs(self, params, batch: MicroBatch) -> jax.Array:
        """[B, T] float32 log-prob of ``batch.targets`` under ``params``."""
        return functional.token_logprobs(self.logits(params, batch), batch.targets)

    def sampling_logprobs(self, logits, targets) -> jax.Array:
        """[B, T] float32 log-prob of ``targets`` under the distribution the agent's rollouts sample from."""
        config = self.config
        if is_plain_softmax(config.sampling_temperature, config.sampling_top_k, config.sampling_top_p):
            return functional.token_logprobs(logits, targets)
        return sampling_token_logprobs(logits, targets, temperature=config.sampling_temperature,
                                       top_k=config.sampling_top_k, top_p=config.sampling_top_p)

    def critic_values(self, critic, batch: MicroBatch) -> jax.Array:
        """[B, T] float32 value of the state after each input token (predicting ``targets``).

        The critic is a copy of the policy network plus a linear value head over its output logits:
        that keeps us on the model's public `forward`, and with tied or full-rank output embeddings
        (vocab >= hidden) a linear map of the logits can express any linear map of the final hidden
        state, so this is a regular linear value head.
        """
        logits = functional.forward(self.graphdef, critic["backbone"], batch.tokens, batch.positions,
                                    batch.attention_mask, remat=self.config.remat)
        return logits.astype(jnp.float32) @ critic["head"]["kernel"] + critic["head"]["bias"]

    def loss_and_metrics(self, trainable, reference, batch: MicroBatch):
        logits = self.logits(trainable["policy"], batch)
        logprobs = functional.token_logprobs(logits, batch.targets)
        if self.config.old_logprobs_in_step:
            # Only the truncated IS weight reads the sampling log-probs; without it they would be a wasted pass.
            needs_sampling = self.config.loss.tis_cap is not None
            old_sampling = self.sampling_logprobs(logits, batch.targets) if needs_sampling else logprobs
            batch = batch.replace(old_logprobs=jax.lax.stop_gradient(logprobs),
                                  old_sampling_logprobs=jax.lax.stop_gradient(old_sampling))
        if reference is not None:
            batch = batch.replace(ref_logprobs=jax.lax.stop_gradient(self.token_logprobs(reference, batch)))
        values = self.critic_values(trainable["critic"], batch) if "critic" in trainable else None
        return self.loss_fn(logprobs, values, batch, self.config.loss)

    def zeros(self, trainable):
        return {"grads": jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable),
                "metrics": {name: jnp.zeros((), jnp.float32) for name in self.metric_names}}

    def accumulate(self, trainable, reference, accum, batch):
        grads, metrics = jax.grad(self.loss_and_metrics, has_aux=True)(trainable, reference, batch)
        return {"grads": _sum_tree(accum["grads"], grads), "metrics": accumulate_metrics(accum["metrics"], metrics)}

    def apply(self, trainable, master, opt_state, accum):
        """One optimizer step on the float32 gradient sum: on `master` (float32) when kept, then
        `trainable` is its cast; else on `trainable` itself, computed in float32 and stored in its dtype."""
        grads = accum["grads"]
        grad_norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        updated = trainable if master is None else master
        updates, new_opt_state = self.tx.update(grads, opt_state, updated)
        # Float32 gradients promote bfloat16 moments; keep each state leaf's dtype so the step compiles once.
        opt_state = _cast_like(new_opt_state, opt_state)
        updated = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), updated, updates)
        if master is None:
            trainable = updated
        else:
            master, trainable = updated, _cast_like(updated, trainable)
        return trainable, master, opt_state, self.zeros(trainable), dict(accum["metrics"], grad_norm=grad_norm)

    def _jit_all(self) -> None:
        trainable, accum, opt = self.trainable, self.accum, self.opt
        self.copy_policy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree),
                                   in_shardings=(self.policy,), out_shardings=self.policy)
        self.init_opt = jax.jit(self.tx.init, in_shardings=(trainable,), out_shardings=opt)
        self.to_float32 = jax.jit(lambda tree: jax.tree.map(lambda leaf: leaf.astype(jnp.float32), tree),
                                  in_shardings=(trainable,), out_shardings=trainable)
        self.zeros_step = jax.jit(self.zeros, in_shardings=(trainable,), out_shardings=accum)
        self.accumulate_step = jax.jit(
            self.accumulate, in_shardings=(trainable, self.reference, accum, self.batch),
            out_shardings=accum, donate_argnums=(2,))
        donate = (0, 1, 2, 3) if self.config.donate_params else (1, 2, 3)
        self.apply_step = jax.jit(self.apply, in_shardings=(trainable, self.master, opt, accum),
                                  out_shardings=(trainable, self.master, opt, accum, self.replicated),
                                  donate_argnums=donate)
        self.logprobs_step = jax.jit(self.token_logprobs, in_shardings=(self.policy, self.batch),
                                     out_shardings=self.batch)
        self.sampling_logprobs_step = jax.jit(
            lambda params, batch: self.sampling_logprobs(self.logits(params, batch), batch.targets),
            in_shardings=(self.policy, self.batch), out_shardings=self.batch)
        if self.has_critic:
            self.values_step = jax.jit(self.critic_values, in_shardings=(trainable["critic"], self.batch),
                                       out_shardings=self.batch)
        if self.waits_for_completion:  # each step ends on every local device first (distributed/cpu_completion.py)
            for name in ("copy_policy", "init_opt", "to_float32", "zeros_step", "accumulate_step", "apply_step",
                         "logprobs_step", "sampling_logprobs_step", "values_step"):
                if hasattr(self, name):
                    setattr(self, name, completed(getattr(self, name)))


def _with_token_means(metrics: dict[str, float]) -> dict[str, float]:
    """The iteration's metrics plus the token means of its token sums (the truncated IS statistics)."""
    tokens = metrics.get("num_tokens", 0.0)
    if "is_weight_sum" in metrics and tokens > 0:
        metrics["is_weight_mean"] = metrics["is_weight_sum"] / tokens
        metrics["is_clip_fraction"] = metrics["is_clipped_tokens"] / tokens
    return metrics


def _cast_params(params, dtype):
    """The parameters in `dtype` (the same arrays when they already are)."""
    return jax.tree.map(lambda leaf: leaf if leaf.dtype == dtype else leaf.astype(dtype), params)


@functools.lru_cache(maxsize=16)
def _steps_for(graphdef, model_config: ModelConfig, config: TrainerConfig, mesh: Mesh) -> _Steps:
    # A compile cache, not state: _Steps holds only pure functions and shardings.
    return _Steps(graphdef, model_config, config, mesh)


class AgentTrainer:
    """Trains one agent: sharded params + optax state + fp32 gradient accumulator, versioned updates.

    agent: the agent's name; micro-batches of other agents are rejected.
    model_config: this agent's model (agents may differ in model, optimizer and learning rate).
    mesh: the agent's training mesh with axes ("fsdp", "tp"); default one device.
    initial: optional (graphdef, params) to start from (e.g. imported HF weights); else random init.
    """

    def __init__(self, agent: str, model_config: ModelConfig, config: TrainerConfig, *,
                 mesh: Mesh | None = None, seed: int = 0, initial: tuple[Any, Any] | None = None):
        self.agent = agent
        self.model_config = model_config
        self.config = config
        self.mesh = mesh if mesh is not None else make_mesh(jax.devices()[:1], fsdp=1)
        self.policy_version = 0
        self._pending_micro_batches = 0

        dtype = jnp.dtype(config.dtype)
        if initial is None:
            # With master weights, initialise in float32 so the master copy holds the exact initial values.
            init_dtype = jnp.float32 if config.fp32_master_weights else dtype
            graphdef, policy = functional.init_params(model_config, seed=seed, mesh=self.mesh, dtype=init_dtype)
        else:
            graphdef, policy = initial
        self.graphdef = graphdef
        self._steps = steps = _steps_for(graphdef, model_config, config, self.mesh)
        policy = across_processes.put(policy, steps.policy)
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
        """The policy parameters (nnx.State, sharded on this trainer's mesh) for weight sync."""
        self._check_attached()
        return self._trainable["policy"]

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches accumulated since the last `apply`."""
        return self._pending_micro_batches

    def _place_passes(self, batch: MicroBatch) -> list[MicroBatch]:
        """The micro-batch checked, then cut into passes of `pass_rows` rows placed on the mesh."""
        rows = self.config.pass_rows
        if rows == self.config.micro_batch_size:
            return [self._place(batch)]
        validate_micro_batch(batch, agent=self.agent, batch_size=self.config.micro_batch_size,
                             max_len=self.config.max_len)
        return [across_processes.put(batch.replace(agent="", **{name: getattr(batch, name)[start:start + rows]
                                                                for name in ARRAY_FIELDS}), self._steps.batch)
                for start in range(0, self.config.micro_batch_size, rows)]

    def _place(self, batch: MicroBatch) -> MicroBatch:
        validate_micro_batch(batch, agent=self.agent, batch_size=self.config.micro_batch_size,
                             max_len=self.config.max_len)
        # The step is traced once per trainer config; the agent name was checked above, so drop it from
        # the static metadata to share compiled steps between agents with equal configs.
        return across_processes.put(batch.replace(agent=""), self._steps.batch)

    def activate(self) -> None:
        """Holds training devices before a micro-batch. A dedicated trainer keeps its mesh for the whole run,
        so there is nothing to do (`orchestrator.shared_training.PooledTrainer` leases a shared slice)."""

    def release(self) -> None:
        """Lets other agents use the training devices while this one has nothing to train: a no-op for a
        dedicated trainer (see `activate`)."""

    def accumulate(self, batch: MicroBatch) -> None:
        """Adds this micro-batch's gradient to the accumulator; parameters do not change.

        Raises ValueError (before touching any state) for a batch of the wrong shape, dtype or agent.
        """
        self._check_attached()
        for placed in self._place_passes(batch):
            self._accum = self._steps.accumulate_step(self._trainable, self._reference, self._accum, placed)
        self._pending_micro_batches += 1

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
        return _with_token_means({name: float(value) for name, value in jax.device_get(metrics).items()})

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
            self._steps = _steps_for(self.graphdef, self.model_config, self.config, self.mesh)
        steps = self._steps
        self._opt_state = steps.init_opt(self._master if self._master is not None else self._trainable)
        self._accum = steps.zeros_step(self._trainable)

    def discard_accumulated(self) -> None:
        """Drops the accumulated gradient without an update (e.g. an iteration aborted by a crash)."""
        self._accum = self._steps.zeros_step(self._trainable)
        self._pending_micro_batches = 0

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
        passes = self._place_passes(batch)
        step = self._steps.logprobs_step
        if which == "policy":
            params = self._trainable["policy"]
        elif which == "sampling":
            params, step = self._trainable["policy"], self._steps.sampling_logprobs_step
        elif which == "reference":
            if self._reference is None:
                raise ValueError(f"agent {self.agent!r} keeps no reference model (kl_coef=0 or "
                                 "reference_in_step=False)")
            params = self._reference
        else:
            raise ValueError(f"which={which!r}; allowed: 'policy', 'sampling', 'reference'")
        return np.concatenate([np.asarray(step(params, placed)) for placed in passes])

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
        if self._steps.has_reference:
            state["reference"] = self._reference
        self._trainable = self._opt_state = self._accum = self._reference = self._master = None
        self._detached = True
        return state

    def swap_shardings(self, mesh: Mesh | None = None) -> dict:
        """Target shardings of `swap_state` on ``mesh`` (default this trainer's mesh); ints map to None."""
        steps = self._steps if mesh is None else _steps_for(self.graphdef, self.model_config, self.config, mesh)
        shardings = {"trainable": steps.trainable, "opt_state": steps.opt, "accum": steps.accum,
                     "pending_micro_batches": None, "policy_version": None}
        if steps.master is not None:
            shardings["master"] = steps.master
        if steps.has_reference:
            shardings["reference"] = steps.policy
        return shardings

    def load_swap_state(self, state: dict, *, mesh: Mesh | None = None) -> None:
        """Adopts a `swap_state` placed with `swap_shardings(mesh)`; the trainer runs on ``mesh`` from now on."""
        if mesh is not None and mesh != self.mesh:
            self.mesh = mesh
            self._steps = _steps_for(self.graphdef, self.model_config, self.config, mesh)
        self._trainable, self._opt_state, self._accum = state["trainable"], state["opt_state"], state["accum"]
        self._reference = state.get("reference")
        self._master = state.get("master")
        self._pending_micro_batches = int(state["pending_micro_batches"])
        self.policy_version = int(state["policy_version"])
        self._detached = False

    _detached = False

    def _check_attached(self) -> None:
        if self._detached:
            raise RuntimeError(f"agent {self.agent!r}: the trainer's state was handed over by swap_state(); "
                               "load_swap_state() it back first")
