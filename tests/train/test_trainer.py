"""AgentTrainer: exact micro-batch accumulation, versioned updates, sharding, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexmarl_jax.mesh.meshes import make_mesh
from flexmarl_jax.models import functional
from flexmarl_jax.train.advantages import gae
from flexmarl_jax.train.algorithms import loss_config_for
from flexmarl_jax.train.batch import ARRAY_FIELDS, build_iteration
from flexmarl_jax.train.trainer import AgentTrainer
from tests.settings_views import loss_config, optimizer_config, trainer_config
from tests.train.conftest import ADAM, FULL, LOSS, MAX_LEN, all_zero, make_trainer, random_rows, rel_err, run_iteration


@pytest.mark.parametrize("agent,num_samples", [("solver", 29), ("verifier", 13)])
def test_accumulated_gradient_equals_full_batch(tiny_model_config, initial, agent, num_samples):
    """k in {2, 4, 8} micro-batches (uneven counts: the last one is partly padding), KL on."""
    rows = random_rows(num_samples, seed=num_samples)
    full = make_trainer(tiny_model_config, initial, FULL, agent=agent)
    run_iteration(full, rows, FULL)
    reference = full.accumulated_gradients()
    assert not all_zero(reference)
    for k in (2, 4, 8):
        micro = FULL // k
        trainer = make_trainer(tiny_model_config, initial, micro, agent=agent)
        run_iteration(trainer, rows, micro)
        assert trainer.pending_micro_batches == -(-num_samples // micro)
        err = rel_err(trainer.accumulated_gradients(), reference)
        assert err < 1e-5, (k, err)


def test_params_after_iteration_equal_full_batch_update(tiny_model_config, initial):
    rows = random_rows(29, seed=1)
    full, split = (make_trainer(tiny_model_config, initial, m) for m in (FULL, FULL // 4))
    run_iteration(full, rows, FULL)
    run_iteration(split, rows, FULL // 4)
    before = jax.device_get(split.params)
    metrics_full, metrics_split = full.apply(), split.apply()
    assert full.policy_version == split.policy_version == 1
    assert split.pending_micro_batches == 0
    assert rel_err(split.params, before) > 1e-4  # the update did something
    assert rel_err(split.params, full.params) < 1e-6
    assert metrics_split["num_tokens"] == metrics_full["num_tokens"] == sum(len(r) for r in rows["response_ids"])
    assert metrics_split["loss"] == pytest.approx(metrics_full["loss"], rel=1e-5, abs=1e-7)
    # the accumulator was cleared: a new iteration starts from zero
    assert all_zero(split.accumulated_gradients())


@pytest.mark.parametrize("fsdp,tp", [(8, 1), (4, 2)])
def test_sharded_run_equals_one_device(tiny_model_config, initial, fsdp, tp):
    assert jax.device_count() >= 8, "tests/conftest.py fakes 8 CPU devices"
    rows = random_rows(16, seed=2)
    one = make_trainer(tiny_model_config, initial, 8)
    mesh = make_mesh(jax.devices()[:fsdp * tp], fsdp=fsdp, tp=tp)
    sharded = make_trainer(tiny_model_config, initial, 8, mesh=mesh)
    # parameters and optimizer moments are split over the mesh, not replicated
    embedding = sharded.params["embed"]["embedding"][...]
    assert embedding.sharding.spec == jax.sharding.PartitionSpec("tp", "fsdp")  # [vocab, embed]
    assert embedding.addressable_shards[0].data.size == embedding.size // (fsdp * tp)
    moments = [x for x in jax.tree.leaves(sharded._opt_state) if x.shape == embedding.shape]
    assert moments and all(m.addressable_shards[0].data.size == embedding.size // (fsdp * tp) for m in moments)
    for trainer in (one, sharded):
        run_iteration(trainer, rows, 8)
    assert rel_err(sharded.accumulated_gradients(), one.accumulated_gradients()) < 1e-5
    one.apply()
    sharded.apply()
    assert rel_err(sharded.params, one.params) < 1e-5
    assert rel_err(sharded._opt_state, one._opt_state) < 1e-5


def test_bad_micro_batches_are_rejected_before_anything_is_applied(tiny_model_config, initial):
    trainer = make_trainer(tiny_model_config, initial, 8)
    good = build_iteration(agent="solver", aggregation="token_mean", micro_batch_size=8, max_len=MAX_LEN,
                           **random_rows(8))[0]
    wrong_agent = build_iteration(agent="verifier", aggregation="token_mean", micro_batch_size=8,
                                  max_len=MAX_LEN, **random_rows(8))[0]
    wrong_rows = build_iteration(agent="solver", aggregation="token_mean", micro_batch_size=4,
                                 max_len=MAX_LEN, **random_rows(4))[0]
    cases = [
        (wrong_agent, "belongs to agent 'verifier', but this trainer trains 'solver'"),
        (wrong_rows, r"shape \(4, 12\); agent 'solver' needs \(8, 12\)"),
        (good.replace(loss_mask=good.loss_mask.astype(np.int32)), "'loss_mask' has dtype int32; allowed: bool"),
        (good.replace(advantages=good.advantages[:, :5]), r"'advantages' has shape \(8, 5\)"),
    ]
    for batch, message in cases:
        with pytest.raises(ValueError, match=message):
            trainer.accumulate(batch)
    assert trainer.pending_micro_batches == 0
    assert all_zero(trainer.accumulated_gradients())
    with pytest.raises(RuntimeError, match="apply\\(\\) with no accumulated micro-batch"):
        trainer.apply()
    assert trainer.policy_version == 0
    assert trainer.apply(allow_empty=True) == {} and trainer.policy_version == 1


def test_logprobs_are_the_old_policy_of_the_iteration(tiny_model_config, initial):
    """Old log-probs read from the trainer make the PPO ratio exactly 1 (nothing clipped)."""
    trainer = make_trainer(tiny_model_config, initial, 8)
    batch = build_iteration(agent="solver", aggregation="token_mean", micro_batch_size=8, max_len=MAX_LEN,
                            **random_rows(8, seed=5))[0]
    old = trainer.logprobs(batch)
    assert old.shape == (8, MAX_LEN) and np.all(old[batch.loss_mask] < 0)
    ref = trainer.logprobs(batch, which="reference")
    np.testing.assert_allclose(ref, old, rtol=1e-6)  # reference == initial policy
    trainer.accumulate(batch.replace(old_logprobs=np.where(batch.loss_mask, old, 0).astype(np.float32)))
    metrics = trainer.apply()
    assert metrics["clip_fraction"] == 0.0 and metrics["ratio"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)
    moved = trainer.logprobs(batch)
    assert np.abs(moved - old)[batch.loss_mask].max() > 1e-4  # params changed
    np.testing.assert_allclose(trainer.logprobs(batch, which="reference"), ref)  # reference frozen
    trainer.reset_reference()  # what the warm-up does before RL: the reference becomes the current policy
    np.testing.assert_allclose(trainer.logprobs(batch, which="reference"), moved, rtol=1e-6)


def test_heterogeneous_agents_have_own_model_optimizer_and_mesh(tiny_model_config, initial):
    solver = make_trainer(tiny_model_config, initial, 8, agent="solver")
    other_model = dataclasses.replace(tiny_model_config, hidden_size=32, intermediate_size=64, num_heads=2,
                                      num_kv_heads=1)
    sgd = optimizer_config(name="sgd", learning_rate=0.5, max_grad_norm=None)
    verifier = AgentTrainer("verifier", other_model,
                            trainer_config(micro_batch_size=4, max_len=MAX_LEN, optimizer=sgd,
                                           loss=loss_config(aggregation="token_mean")),
                            mesh=make_mesh(jax.devices()[4:8], fsdp=4), seed=1)
    assert functional.param_count(verifier.params) < functional.param_count(solver.params)
    assert verifier.params["embed"]["embedding"][...].sharding.mesh.devices.flat[0] == jax.devices()[4]

    run_iteration(solver, random_rows(16, seed=7), 8)
    run_iteration(verifier, random_rows(6, seed=8), 4, aggregation=verifier.config.loss.aggregation)
    with pytest.raises(ValueError, match="belongs to agent 'solver'"):
        verifier.accumulate(build_iteration(agent="solver", aggregation="token_mean", micro_batch_size=4,
                                            max_len=MAX_LEN, **random_rows(4))[0])
    grads = jax.device_get(verifier.accumulated_gradients()["policy"])
    before = jax.device_get(verifier.params)
    solver.apply()
    verifier.apply()
    assert solver.policy_version == verifier.policy_version == 1
    expected = jax.tree.map(lambda p, g: p - 0.5 * g, before, grads)  # plain SGD with this agent's lr
    assert rel_err(verifier.params, expected) < 1e-6


def test_ppo_critic_learns_returns(tiny_model_config, initial):
    trainer = make_trainer(tiny_model_config, initial, 8, loss=loss_config_for("ppo", gae_lambda=1.0))
    rows = random_rows(16, seed=9)
    rewards = np.where(np.arange(16) % 2 == 0, 1.0, -1.0).astype(np.float32)
    batches = build_iteration(agent="solver", aggregation="token_mean", micro_batch_size=8, max_len=MAX_LEN,
                              **rows)
    value_losses = []
    for _ in range(6):
        prepared = []
        for i, batch in enumerate(batches):
            values = trainer.values(batch)
            mask = batch.loss_mask
            last = mask & ~np.roll(mask, -1, axis=1)  # the last response token of each row
            token_rewards = np.where(last, rewards[i * 8:(i + 1) * 8, None], 0.0)
            advantages, returns = gae(token_rewards, values, mask, gamma=1.0, lam=1.0)
            expected_returns = np.where(mask, rewards[i * 8:(i + 1) * 8, None], 0.0)
            np.testing.assert_allclose(np.asarray(returns), expected_returns, atol=1e-5)
            prepared.append(batch.replace(advantages=np.asarray(advantages, np.float32),
                                          old_values=np.where(mask, values, 0).astype(np.float32),
                                          returns=np.asarray(returns, np.float32)))
        for batch in prepared:
            trainer.accumulate(batch)
        value_losses.append(trainer.apply()["value_loss"])
    assert value_losses[0] == pytest.approx(0.5, rel=1e-3)  # zero-initialised head: 0.5 * (0 - +-1)^2
    assert value_losses[-1] < 0.5 * value_losses[0], value_losses


def test_stale_samples_get_truncated_importance_weights_in_the_step(tiny_model_config, initial):
    """With old log-probs taken in-step, a sample whose behaviour policy made it e^5 less likely than
    the current policy counts tis_cap times; a fresh one counts once. (The KL term is on but has zero
    gradient here: a fresh trainer's policy equals its reference.)"""
    assert LOSS.tis_cap == 2.0
    trainer = make_trainer(tiny_model_config, initial, 8)
    batch = build_iteration(agent="solver", aggregation="token_mean", micro_batch_size=8, max_len=MAX_LEN,
                            **random_rows(8, seed=4))[0]
    current = trainer.logprobs(batch)
    fresh = batch.replace(behaviour_logprobs=np.where(batch.loss_mask, current, 0).astype(np.float32))
    stale = batch.replace(behaviour_logprobs=np.where(batch.loss_mask, current - 5, 0).astype(np.float32))
    trainer.accumulate(fresh)
    g_fresh = jax.device_get(trainer.accumulated_gradients())
    trainer.discard_accumulated()
    trainer.accumulate(stale)
    g_stale = jax.device_get(trainer.accumulated_gradients())
    assert rel_err(g_stale, jax.tree.map(lambda g: 2 * g, g_fresh)) < 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_importance_weight_metrics_match_hand_computed_ratios(tiny_model_config, initial, temperature):
    """Two micro-batches, each trained in two passes: the iteration's IS statistics are those of
    w = min(exp(old - behaviour), cap) over every response token, old being the initial policy's log-prob under
    the agent's sampling distribution (log-softmax of logits / temperature), computed here with numpy."""
    cap = 2.0
    config = trainer_config(micro_batch_size=4, max_len=MAX_LEN, optimizer=ADAM, rows_per_pass=2,
                            loss=loss_config(aggregation="token_mean", tis_cap=cap), sampling_temperature=temperature)
    trainer = AgentTrainer("solver", tiny_model_config, config, initial=initial)
    rng = np.random.default_rng(3)
    rows = random_rows(8, seed=11)
    batches = build_iteration(agent="solver", aggregation="token_mean", micro_batch_size=4, max_len=MAX_LEN, **rows)
    graphdef, params = initial
    weights = []
    for batch in batches:
        logits = np.asarray(functional.forward(graphdef, params, batch.tokens, batch.positions, batch.attention_mask),
                            np.float64) / temperature
        log_softmax = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        old = np.take_along_axis(log_softmax, np.asarray(batch.targets)[..., None], axis=-1)[..., 0]
        mask = np.asarray(batch.loss_mask)
        # behaviour log-probs between 1.5 below and 1 above the old ones: ratios from e^-1 to e^1.5 > cap
        behaviour = np.where(mask, old - rng.uniform(-1.0, 1.5, size=old.shape), 0.0).astype(np.float32)
        weights.append(np.minimum(np.exp(old - behaviour), cap)[mask])
        trainer.accumulate(batch.replace(behaviour_logprobs=behaviour))
    metrics = trainer.apply()
    expected = np.concatenate(weights)
    assert 0 < (expected == cap).mean() < 1 and expected.min() < 1  # the case has clipped and down-weighted tokens
    assert metrics["num_tokens"] == expected.size
    assert metrics["is_weight_mean"] == pytest.approx(expected.mean(), rel=1e-5)
    assert metrics["is_weight_max"] == pytest.approx(expected.max(), rel=1e-6)
    assert metrics["is_clip_fraction"] == pytest.approx(np.mean(expected >= cap), abs=1e-9)


def test_no_importance_metrics_without_a_cap(tiny_model_config, initial):
    trainer = make_trainer(tiny_model_config, initial, 8, loss=loss_config(aggregation="token_mean"))
    run_iteration(trainer, random_rows(8, seed=2), 8)
    assert not {"is_weight_mean", "is_weight_max", "is_clip_fraction"} & set(trainer.apply())


# ------------------------------------------------------------------------------ real sizes


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.device_get(jax.tree.leaves(tree))]


def _fraction_changed(after, before) -> float:
    changed = [np.ravel(np.asarray(a, np.float32) != np.asarray(b, np.float32))
               for a, b in zip(_leaves(after), _leaves(before), strict=True)]
    return float(np.mean(np.concatenate(changed)))


def _rows_with_longest(longest: list[int], per_batch: int, seed: int) -> dict:
    """Rows in micro-batches of `per_batch` whose longest row has prompt+response-1 = longest[i] tokens."""
    rng = np.random.default_rng(seed)
    rows = {"prompt_ids": [], "response_ids": [], "behaviour_logprobs": [], "advantages": []}
    for target in longest:
        for row in range(per_batch):
            inputs = target if row == 0 else int(rng.integers(2, target + 1))
            prompt = int(rng.integers(1, inputs))
            response = inputs + 1 - prompt
            rows["prompt_ids"].append([int(t) for t in rng.integers(3, 100, prompt)])
            rows["response_ids"].append([int(t) for t in rng.integers(3, 100, response)])
            rows["behaviour_logprobs"].append([float(x) for x in -4.6 + 0.1 * rng.normal(size=response)])
            rows["advantages"].append(float(rng.normal()))
    return rows


def test_length_buckets_give_the_max_len_result_and_bound_the_compiles(tiny_model_config, initial):
    micro, max_len = 4, 100
    # a distinct optimizer eps keeps these compiled steps apart from other tests' (they are shared by config)
    config = trainer_config(micro_batch_size=micro, max_len=max_len, loss=LOSS,
                            optimizer=dataclasses.replace(ADAM, eps=2e-6))
    assert config.length_buckets == (16, 32, 64, 100)
    rows = _rows_with_longest([10, 30, 60, 95, 17], micro, seed=0)
    results = {}
    for bucketed in (True, False):
        trainer = AgentTrainer("solver", tiny_model_config, config, initial=initial)
        batches = build_iteration(agent="solver", aggregation=LOSS.aggregation, micro_batch_size=micro,
                                  max_len=max_len, bucketed=bucketed, **rows)
        assert [b.shape[1] for b in batches] == ([16, 32, 64, 100, 32] if bucketed else [100] * 5)
        for batch in batches:
            trainer.accumulate(batch)
        grads = jax.device_get(trainer.accumulated_gradients())
        results[bucketed] = (grads, trainer.apply(), trainer)
    (grads, metrics, bucketed), (grads_full, metrics_full, padded) = results[True], results[False]
    assert rel_err(grads, grads_full) < 1e-5
    assert metrics["loss"] == pytest.approx(metrics_full["loss"], rel=1e-5, abs=1e-7)
    assert metrics["num_tokens"] == metrics_full["num_tokens"]
    assert rel_err(bucketed.params, padded.params) < 1e-6
    # one compile per bucket, however many micro-batches of however many lengths follow
    more = random_rows(24, seed=5, max_prompt=30, max_response=70)
    for batch in build_iteration(agent="solver", aggregation=LOSS.aggregation, micro_batch_size=micro,
                                 max_len=max_len, **more):
        bucketed.accumulate(batch)
    assert bucketed._steps.accumulate_step._cache_size() == len(config.length_buckets)
    with pytest.raises(ValueError, match=r"needs \(4, L\) with L in \(16, 32, 64, 100\)"):
        bucketed.accumulate(batches[0].replace(**{name: getattr(batches[0], name)[:, :12] for name in ARRAY_FIELDS}))


def test_bfloat16_with_float32_master_weights(tiny_model_config, initial):
    rows = random_rows(16, seed=1)
    sgd = optimizer_config(name="sgd", learning_rate=1e-4, max_grad_norm=None)
    trainers, before = {}, jax.device_get(initial[1])
    for master in (False, True):
        config = trainer_config(micro_batch_size=16, max_len=MAX_LEN, loss=LOSS, optimizer=sgd, dtype="bfloat16",
                                fp32_master_weights=master)
        trainer = trainers[master] = AgentTrainer("solver", tiny_model_config, config, initial=initial)
        assert {leaf.dtype for leaf in _leaves(trainer.params)} == {np.dtype(jnp.bfloat16)}
        for _ in range(3):
            run_iteration(trainer, rows, 16)
            assert {leaf.dtype for leaf in _leaves(trainer.accumulated_gradients())} == {np.dtype(np.float32)}
            trainer.apply()
        assert trainer._steps.apply_step._cache_size() == 1  # dtypes stay put from step to step
    plain, mastered = trainers[False], trainers[True]
    master = mastered.checkpoint_state()["master"]["policy"]
    # the master copy starts at the exact float32 weights and the bfloat16 parameters are its cast
    assert {leaf.dtype for leaf in _leaves(master)} == {np.dtype(np.float32)}
    for cast, param in zip(_leaves(jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)),
                           _leaves(mastered.params), strict=True):
        np.testing.assert_array_equal(cast, param)
    # updates ~1e-4 of the weights are below bfloat16's resolution: lost without master weights, kept with
    assert _fraction_changed(master, before) > 0.9
    assert _fraction_changed(plain.params, jax.tree.map(lambda x: x.astype(jnp.bfloat16), before)) < 0.01
    with pytest.raises(ValueError, match="fp32_master_weights=True needs dtype='bfloat16'"):
        trainer_config(micro_batch_size=4, max_len=8, fp32_master_weights=True)


def test_bfloat16_adam_tracks_float32_and_keeps_its_state_dtypes(tiny_model_config, initial):
    rows = random_rows(16, seed=2)
    losses = {}
    for dtype in ("float32", "bfloat16"):
        config = trainer_config(micro_batch_size=16, max_len=MAX_LEN, loss=LOSS, optimizer=ADAM, dtype=dtype)
        trainer = AgentTrainer("solver", tiny_model_config, config, initial=initial)
        state_dtypes = [leaf.dtype for leaf in _leaves(trainer.checkpoint_state()["opt_state"])]
        losses[dtype] = []
        for _ in range(2):
            run_iteration(trainer, rows, 16)
            losses[dtype].append(trainer.apply()["loss"])
        assert [leaf.dtype for leaf in _leaves(trainer.checkpoint_state()["opt_state"])] == state_dtypes
    assert np.dtype(jnp.bfloat16) in state_dtypes  # without master weights the moments are bfloat16 too
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=0.05, atol=5e-3)


def test_remat_trainer_gives_the_same_gradients(tiny_model_config, initial):
    rows = random_rows(16, seed=4)
    grads = {}
    for remat in (False, True):
        config = trainer_config(micro_batch_size=8, max_len=MAX_LEN, loss=LOSS, optimizer=ADAM, remat=remat)
        trainer = AgentTrainer("solver", tiny_model_config, config, initial=initial)
        run_iteration(trainer, rows, 8)
        grads[remat] = trainer.accumulated_gradients()
    assert rel_err(grads[True], grads[False]) < 1e-6


def test_passes_of_fewer_rows_give_the_micro_batch_gradient(tiny_model_config, initial):
    """rows_per_pass cuts each micro-batch into passes whose gradients add up to the whole micro-batch's, and
    the log-probs come back whole; a pass size that does not divide the micro-batch is refused."""
    rows = random_rows(29, seed=7)
    results = {}
    for rows_per_pass in (0, 2, 8):
        config = trainer_config(micro_batch_size=8, max_len=MAX_LEN, loss=LOSS, optimizer=ADAM,
                                rows_per_pass=rows_per_pass)
        trainer = AgentTrainer("solver", tiny_model_config, config, initial=initial)
        batches = build_iteration(agent="solver", aggregation=LOSS.aggregation, micro_batch_size=8, max_len=MAX_LEN,
                                  **rows)
        logprobs = trainer.logprobs(batches[0])
        for batch in batches:
            trainer.accumulate(batch)
        results[rows_per_pass] = (trainer.accumulated_gradients(), logprobs, trainer.pending_micro_batches)
    for rows_per_pass in (2, 8):
        grads, logprobs, pending = results[rows_per_pass]
        assert rel_err(grads, results[0][0]) < 1e-6 and pending == results[0][2] == 4
        assert logprobs.shape == results[0][1].shape and np.allclose(logprobs, results[0][1], atol=1e-6)
    with pytest.raises(ValueError, match="rows_per_pass=3 must divide micro_batch_size=8"):
        trainer_config(micro_batch_size=8, max_len=MAX_LEN, rows_per_pass=3)


def test_reset_optimizer_continues_like_a_new_trainer_on_the_same_weights(tiny_model_config, initial):
    rows = random_rows(16, seed=7)
    plain = loss_config(aggregation="token_mean")  # no KL: a new trainer's reference would be other weights
    trainer = make_trainer(tiny_model_config, initial, FULL, loss=plain)
    for _ in range(2):  # moments and step count away from their initial values
        run_iteration(trainer, rows, FULL)
        trainer.apply()
    run_iteration(trainer, rows, FULL)
    with pytest.raises(RuntimeError, match="accumulated micro-batch"):
        trainer.reset_optimizer()  # would drop the pending gradient
    trainer.discard_accumulated()

    slower = dataclasses.replace(ADAM, learning_rate=1e-3)
    trainer.reset_optimizer(slower)
    assert trainer.config.optimizer == slower
    fresh = make_trainer(tiny_model_config, (initial[0], jax.device_get(trainer.params)), FULL, loss=plain,
                         optimizer=slower)
    other_rows = random_rows(16, seed=8)
    for each in (trainer, fresh):
        run_iteration(each, other_rows, FULL)
        each.apply()
    assert rel_err(trainer.params, fresh.params) < 1e-6
    # and it is a different step from the one the carried-over state at the old rate would have taken
    carried = make_trainer(tiny_model_config, initial, FULL, loss=plain)
    for _ in range(2):
        run_iteration(carried, rows, FULL)
        carried.apply()
    run_iteration(carried, other_rows, FULL)
    carried.apply()
    assert rel_err(carried.params, fresh.params) > 1e-3
