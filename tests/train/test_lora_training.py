"""Adapter-only training (`TrainerConfig.lora`): the LoRA trainer's policy, gradients, updates and state against
the full trainer on the same base and against a plain merged-weights reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flexmarl_jax.mesh.meshes import make_mesh
from flexmarl_jax.models import lora
from flexmarl_jax.models.lora import LoraSpec
from flexmarl_jax.train.algorithms import loss_config_for
from flexmarl_jax.train.batch import build_iteration
from flexmarl_jax.train.steps import steps_for
from flexmarl_jax.train.trainer import AgentTrainer
from tests.settings_views import lora_spec, trainer_config
from tests.train.conftest import ADAM, FULL, LOSS, MAX_LEN, random_rows, rel_err, run_iteration

RANK = 4
SPEC = lora_spec(rank=RANK, alpha=8.0)


def _one_device():
    return make_mesh(jax.devices()[:1], fsdp=1)


def _config(micro=FULL, spec=SPEC, **overrides):
    overrides = {"loss": LOSS, "optimizer": ADAM, **overrides}
    return trainer_config(micro_batch_size=micro, max_len=MAX_LEN, lora=spec, **overrides)


def _batches(rows, micro=FULL):
    return build_iteration(agent="solver", aggregation=LOSS.aggregation, micro_batch_size=micro, max_len=MAX_LEN,
                           **rows)


def _random_adapter(model_config, spec, seed):
    """An adapter with A and B both nonzero (a trained one), float32."""
    keys = iter(jax.random.split(jax.random.key(seed), 32))
    tree = lora.init_adapters(model_config, spec, seed=seed)
    return {target: {"a": pair["a"], "b": 0.1 * jax.random.normal(next(keys), pair["b"].shape)}
            for target, pair in tree.items()}


def _plain_merge(params, adapters, scale):
    """W + scale * A @ B per layer and target, with A and B flattened to matrices ([in, r] @ [r, out]): a second,
    independent statement of what an adapter does to a projection."""
    merged = []
    for path, variable in nnx.to_flat_state(params):
        if path[0] == "layers" and path[-1] in adapters:
            layer, pair = path[1], adapters[path[-1]]
            a, b = pair["a"][layer], pair["b"][layer]
            weight = variable.get_value()
            update = a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)
            variable = variable.replace(weight + scale * update.reshape(weight.shape))
        merged.append((path, variable))
    return nnx.from_flat_state(merged)


def test_a_new_adapter_is_the_base_model(tiny_model_config, initial):
    """B starts at zero: the LoRA trainer's log-probs are the full trainer's on the same weights (1e-6) and its
    merged params are the base exactly."""
    batch = _batches(random_rows(FULL, seed=1))[0]
    full = AgentTrainer("solver", tiny_model_config, _config(spec=lora_spec(rank=0)), initial=initial)
    adapted = AgentTrainer("solver", tiny_model_config, _config(), initial=initial)
    assert adapted.adapters is not None and full.adapters is None
    assert np.max(np.abs(adapted.logprobs(batch) - full.logprobs(batch))) < 1e-6
    for merged, base in zip(jax.tree.leaves(adapted.params), jax.tree.leaves(initial[1]), strict=True):
        assert np.array_equal(np.asarray(merged), np.asarray(base))


@pytest.mark.parametrize("targets,remat", [(lora.TARGETS, False), (("q_proj", "o_proj", "down_proj"), True)])
def test_lora_gradients_equal_a_plain_merged_reference(tiny_model_config, initial, targets, remat):
    """The adapter's gradient (KL to the base on, so the reference term counts) equals jax.grad of the full
    model's loss through a plain W + s A B merge, within 1e-5 relative, with and without remat."""
    spec = LoraSpec(RANK, alpha=8.0, targets=targets)
    graphdef, base = initial
    adapters = _random_adapter(tiny_model_config, spec, seed=3)
    batch = _batches(random_rows(FULL, seed=2))[0]
    lora_steps = steps_for(graphdef, tiny_model_config, _config(spec=spec, remat=remat), _one_device())
    full_steps = steps_for(graphdef, tiny_model_config, _config(spec=lora_spec(rank=0), remat=remat),
                           _one_device())
    accum = lora_steps.accumulate({"adapters": adapters}, base, lora_steps.zeros({"adapters": adapters}), batch)

    def plain_loss(tree):
        return full_steps.loss_and_metrics({"policy": _plain_merge(base, tree, spec.scale)}, base, batch)[0]

    reference = jax.jit(jax.grad(plain_loss))(adapters)  # one compile, not one per operation
    assert sorted(accum["grads"]["adapters"]) == sorted(targets)
    assert rel_err(accum["grads"]["adapters"], reference) < 1e-5
    assert float(jnp.max(jnp.abs(reference["q_proj"]["b"]))) > 0  # the check is not on zeros


def test_micro_batches_and_passes_add_up_to_the_full_batch_gradient(tiny_model_config, initial):
    """2 and 4 micro-batches, and passes of 2 rows, accumulate the one-micro-batch adapter gradient (1e-5)."""
    rows = random_rows(29, seed=5)
    whole = AgentTrainer("solver", tiny_model_config, _config(), initial=initial)
    run_iteration(whole, rows, FULL)
    reference = whole.accumulated_gradients()
    assert list(reference) == ["adapters"]
    for micro, rows_per_pass in ((16, 0), (8, 0), (8, 2)):
        trainer = AgentTrainer("solver", tiny_model_config, _config(micro, rows_per_pass=rows_per_pass),
                               initial=initial)
        run_iteration(trainer, rows, micro)
        assert rel_err(trainer.accumulated_gradients(), reference) < 1e-5, (micro, rows_per_pass)


def test_an_update_moves_the_adapter_only(tiny_model_config, initial):
    """After one iteration the base is bit-identical, the optimizer state is the adapter's size (two Adam
    moments and a step count), and the merged policy differs from the base."""
    trainer = AgentTrainer("solver", tiny_model_config, _config(), initial=initial)
    before = jax.device_get(trainer.adapters)
    run_iteration(trainer, random_rows(FULL, seed=6), FULL)
    metrics = trainer.apply()
    assert trainer.policy_version == 1 and metrics["grad_norm"] > 0
    state = trainer.checkpoint_state()
    assert sorted(state) == ["opt_state", "trainable"] and list(state["trainable"]) == ["adapters"]
    count = lora.adapter_count(trainer.adapters)
    assert sum(int(np.size(leaf)) for leaf in jax.tree.leaves(state["opt_state"])) <= 2 * count + 2
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(trainer.adapters))
    assert rel_err(trainer.adapters, before) > 0
    for merged, base in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(initial[1]), strict=True):
        assert merged.shape == base.shape
    changed = [not np.array_equal(np.asarray(m), np.asarray(b))
               for m, b in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(initial[1]), strict=True)]
    assert 0 < sum(changed) < len(changed)  # the targeted projections moved; norms and embeddings did not


def test_bfloat16_base_trains_a_float32_adapter(tiny_model_config, initial):
    trainer = AgentTrainer("solver", tiny_model_config, _config(dtype="bfloat16"), initial=initial)
    run_iteration(trainer, random_rows(FULL, seed=8), FULL)
    trainer.apply()
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(trainer.adapters))
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(trainer.params))


def test_swap_state_carries_the_base_and_the_pending_gradient(tiny_model_config, initial):
    rows = random_rows(FULL, seed=9)
    trainer = AgentTrainer("solver", tiny_model_config, _config(16), initial=initial)
    batches = _batches(rows, 16)
    trainer.accumulate(batches[0])
    want = trainer.logprobs(batches[1])
    state = trainer.swap_state()
    assert "base" in state and "reference" not in state
    with pytest.raises(RuntimeError, match="swap_state"):
        trainer.logprobs(batches[1])
    trainer.load_swap_state(state)
    assert np.array_equal(trainer.logprobs(batches[1]), want) and trainer.pending_micro_batches == 1


def test_a_critic_algorithm_is_refused_for_an_adapter(tiny_model_config, initial):
    with pytest.raises(ValueError, match="critic-free"):
        AgentTrainer("solver", tiny_model_config, _config(loss=loss_config_for("ppo")), initial=initial)
