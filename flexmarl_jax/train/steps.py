"""The jitted steps of one agent's training (accumulate, apply, log-probs, values) and their shardings, for one
(model, `TrainerConfig`, mesh); `steps_for` caches them, so trainers with equal settings share one compile.
`AgentTrainer` (trainer.py) holds the state and calls these.

What the optimizer updates is the trainable tree: ``{"policy": params}`` (plus ``"critic"`` for PPO), or for a
LoRA agent (`TrainerConfig.lora` with rank > 0) ``{"adapters": tree}`` in float32, replicated. Beside it every
step that runs the policy takes a frozen tree: the LoRA agent's base parameters (its policy is the base with
the adapter; its KL reference is the base alone, the adapter at zero), or the frozen reference copy a full
agent keeps when the KL is on (else None).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flexmarl_jax.distributed.cpu_completion import completed, needs_completion
from flexmarl_jax.models import functional
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.lora import init_adapters, merge_adapter, stack_adapters
from flexmarl_jax.models.sampling_distribution import is_plain_softmax, sampling_token_logprobs
from flexmarl_jax.train.batch import ARRAY_FIELDS, MicroBatch
from flexmarl_jax.train.losses import LOSSES, accumulate_metrics
from flexmarl_jax.train.optim import make_optimizer
from flexmarl_jax.train.trainer_config import TrainerConfig


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


class TrainSteps:
    """The jitted steps and shardings of one (model, trainer config, mesh); shared by equal trainers.

    Building this traces and compiles, so trainers with the same model/config/mesh (e.g. a trainer
    rebuilt to restore a checkpoint) reuse one instance via `steps_for`.
    """

    def __init__(self, graphdef, model_config: ModelConfig, config: TrainerConfig, mesh: Mesh):
        self.graphdef = graphdef
        self.vocab_size = model_config.vocab_size
        self.config = config
        self.loss_fn = LOSSES.get(config.loss.name)
        self.tx = make_optimizer(config.optimizer)
        self.has_critic = config.loss.needs_values
        self.has_reference = config.loss.kl_coef > 0 and config.reference_in_step
        self.lora = config.lora if config.lora.rank else None
        if self.lora is not None and self.has_critic:
            raise ValueError(f"loss {config.loss.name!r} trains a critic, a full copy of the model; LoRA agents "
                             "(lora rank > 0) train with a critic-free algorithm (grpo, drgrpo, ...)")

        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.waits_for_completion = needs_completion(mesh)  # a CPU mesh over several processes
        # Rows over "fsdp" (data parallel inside FSDP); replicate when the rows don't split evenly.
        fsdp = dict(mesh.shape).get("fsdp", 1)
        row_axis = "fsdp" if config.pass_rows % fsdp == 0 else None
        self.batch = NamedSharding(mesh, PartitionSpec(row_axis, None))

        _, abstract_policy = functional.abstract_model(model_config, dtype=jnp.dtype(config.dtype))
        policy_sh = functional.param_shardings(abstract_policy, mesh)
        self.policy = policy_sh
        if self.lora is None:
            self.trainable = {"policy": policy_sh}
            abstract_trainable = {"policy": abstract_policy}
        else:  # adapters are small: replicated on the mesh, float32 whatever the base's dtype
            abstract_adapters = jax.eval_shape(functools.partial(init_adapters, model_config, self.lora, seed=0))
            self.trainable = {"adapters": jax.tree.map(lambda _: self.replicated, abstract_adapters)}
            abstract_trainable = {"adapters": abstract_adapters}
        if self.has_critic:
            head_sh = {"kernel": self.replicated, "bias": self.replicated}
            self.trainable["critic"] = {"backbone": policy_sh, "head": head_sh}
            abstract_trainable["critic"] = {"backbone": abstract_policy, "head": self.abstract_value_head()}
        # A full agent keeps a reference copy (has_reference); a LoRA agent's reference is its base.
        self.reference = policy_sh if self.has_reference and self.lora is None else None
        self.frozen = policy_sh if self.lora is not None or self.has_reference else None
        # The float32 copy the optimizer updates (None without master weights, and for float32 adapters).
        self.master = self.trainable if config.fp32_master_weights and self.lora is None else None
        abstract_updated = abstract_trainable  # what the optimizer updates (its state has this dtype)
        if self.master is not None:
            abstract_updated = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), abstract_trainable)
        abstract_opt = jax.eval_shape(self.tx.init, abstract_updated)
        self.opt = _shardings_like_params(abstract_opt, jax.tree.structure(abstract_trainable),
                                          self.trainable, self.replicated)
        abstract_frozen = abstract_policy if self.frozen is not None else None
        batch = abstract_micro_batch(config.pass_rows, config.max_len)
        self.metric_names = sorted(jax.eval_shape(self.loss_and_metrics, abstract_trainable, abstract_frozen,
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
                                  remat=self.config.remat, segment_ids=batch.segment_ids)

    def token_logprobs(self, params, batch: MicroBatch) -> jax.Array:
        """[B, T] float32 log-prob of ``batch.targets`` under ``params``."""
        return functional.token_logprobs(self.logits(params, batch), batch.targets)

    def policy_logits(self, trainable, frozen, batch: MicroBatch) -> jax.Array:
        """[B, T, V] logits of the agent's policy: its params, or for a LoRA agent its base (`frozen`) with the
        adapter on every row."""
        if self.lora is None:
            return self.logits(trainable["policy"], batch)
        adapters = stack_adapters([trainable["adapters"]], [self.lora])
        return functional.forward(self.graphdef, frozen, batch.tokens, batch.positions, batch.attention_mask,
                                  remat=self.config.remat, adapters=adapters, segment_ids=batch.segment_ids)

    def policy_params(self, trainable, frozen):
        """The policy as one parameter tree: a LoRA agent's base with its adapter merged (what a full-model
        engine or export takes)."""
        if self.lora is None:
            return trainable["policy"]
        return merge_adapter(frozen, trainable["adapters"], self.lora)

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
                                    batch.attention_mask, remat=self.config.remat, segment_ids=batch.segment_ids)
        return logits.astype(jnp.float32) @ critic["head"]["kernel"] + critic["head"]["bias"]

    def loss_and_metrics(self, trainable, frozen, batch: MicroBatch):
        logits = self.policy_logits(trainable, frozen, batch)
        logprobs = functional.token_logprobs(logits, batch.targets)
        if self.config.old_logprobs_in_step:
            # Only the truncated IS weight reads the sampling log-probs; without it they would be a wasted pass.
            needs_sampling = self.config.loss.tis_cap is not None
            old_sampling = self.sampling_logprobs(logits, batch.targets) if needs_sampling else logprobs
            batch = batch.replace(old_logprobs=jax.lax.stop_gradient(logprobs),
                                  old_sampling_logprobs=jax.lax.stop_gradient(old_sampling))
        if self.has_reference:  # the frozen reference copy, or a LoRA agent's base
            batch = batch.replace(ref_logprobs=jax.lax.stop_gradient(self.token_logprobs(frozen, batch)))
        values = self.critic_values(trainable["critic"], batch) if "critic" in trainable else None
        return self.loss_fn(logprobs, values, batch, self.config.loss)

    def zeros(self, trainable):
        return {"grads": jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable),
                "metrics": {name: jnp.zeros((), jnp.float32) for name in self.metric_names}}

    def accumulate(self, trainable, frozen, accum, batch):
        grads, metrics = jax.grad(self.loss_and_metrics, has_aux=True)(trainable, frozen, batch)
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
            self.accumulate, in_shardings=(trainable, self.frozen, accum, self.batch),
            out_shardings=accum, donate_argnums=(2,))
        donate = (0, 1, 2, 3) if self.config.donate_params else (1, 2, 3)
        self.apply_step = jax.jit(self.apply, in_shardings=(trainable, self.master, opt, accum),
                                  out_shardings=(trainable, self.master, opt, accum, self.replicated),
                                  donate_argnums=donate)
        self.logprobs_step = jax.jit(
            lambda trainable, frozen, batch: functional.token_logprobs(
                self.policy_logits(trainable, frozen, batch), batch.targets),
            in_shardings=(trainable, self.frozen, self.batch), out_shardings=self.batch)
        self.sampling_logprobs_step = jax.jit(
            lambda trainable, frozen, batch: self.sampling_logprobs(self.policy_logits(trainable, frozen, batch),
                                                                   batch.targets),
            in_shardings=(trainable, self.frozen, self.batch), out_shardings=self.batch)
        self.reference_logprobs_step = jax.jit(self.token_logprobs, in_shardings=(self.policy, self.batch),
                                               out_shardings=self.batch)
        self.policy_params_step = jax.jit(self.policy_params, in_shardings=(trainable, self.frozen),
                                          out_shardings=self.policy)
        if self.has_critic:
            self.values_step = jax.jit(self.critic_values, in_shardings=(trainable["critic"], self.batch),
                                       out_shardings=self.batch)
        if self.waits_for_completion:  # each step ends on every local device first (distributed/cpu_completion.py)
            for name in ("copy_policy", "init_opt", "to_float32", "zeros_step", "accumulate_step", "apply_step",
                         "logprobs_step", "sampling_logprobs_step", "reference_logprobs_step",
                         "policy_params_step", "values_step"):
                if hasattr(self, name):
                    setattr(self, name, completed(getattr(self, name)))


@functools.lru_cache(maxsize=16)
def steps_for(graphdef, model_config: ModelConfig, config: TrainerConfig, mesh: Mesh) -> TrainSteps:
    # A compile cache, not state: TrainSteps holds only pure functions and shardings.
    return TrainSteps(graphdef, model_config, config, mesh)
