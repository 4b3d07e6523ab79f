"""Rows without signal (train/rows_without_signal.py): a GRPO row whose advantage is 0 adds exactly nothing, so
passes of such rows are not computed. The gradient and the applied update are the ones of computing every row,
and so are the metrics the trainer reports; where the loss reads a row beyond its advantage (the KL term), nothing
is skipped, and `train.skip_rows_without_signal=false` turns it off."""

import dataclasses

import jax
import numpy as np
import pytest

from flexmarl_jax.train.batch import build_iteration
from flexmarl_jax.train.rows_without_signal import rows_with_signal, skips_rows_without_signal
from flexmarl_jax.train.trainer import AgentTrainer
from tests.settings_views import lora_spec, loss_config, trainer_config
from tests.train.conftest import ADAM, MAX_LEN, random_rows, rel_err

MICRO = 8
GRPO = loss_config(aggregation="seq_mean", kl_coef=0.0, tis_cap=None)


def _iteration(groups_with_signal: list[bool], seed: int = 0) -> list:
    """Two micro-batches of four groups of 4 samples, in group order as the store hands them out; a group
    without signal has one reward for all its samples, so GRPO gives each of them advantage 0."""
    rows = random_rows(4 * len(groups_with_signal), seed=seed)
    advantages = np.asarray(rows["advantages"]).reshape(len(groups_with_signal), 4)
    advantages[~np.asarray(groups_with_signal)] = 0.0
    rows["advantages"] = list(advantages.ravel())
    return build_iteration(agent="solver", aggregation=GRPO.aggregation, micro_batch_size=MICRO, max_len=MAX_LEN,
                           **rows)


def _trainers(tiny_model_config, initial, *, pack: bool, lora: bool = False, loss=GRPO):
    """(a trainer that skips rows without signal, one that computes every row), alike in all else."""
    config = trainer_config(micro_batch_size=MICRO, max_len=MAX_LEN, loss=loss, optimizer=ADAM, rows_per_pass=2,
                            pack_rows=pack, lora=lora_spec(rank=4, alpha=8.0) if lora else lora_spec(rank=0))
    # the reference computes every pass, as before rows were skipped
    skipping, computing = (AgentTrainer("solver", tiny_model_config,
                                        dataclasses.replace(config, skip_rows_without_signal=skip), initial=initial)
                           for skip in (True, False))
    return skipping, computing


class _CountingSteps:
    """A trainer's compiled steps (shared between trainers of one config), counting this trainer's passes."""

    def __init__(self, steps):
        self.steps, self.calls = steps, []

    def __getattr__(self, name):
        return getattr(self.steps, name)

    def accumulate_step(self, *args):
        self.calls.append(1)
        return self.steps.accumulate_step(*args)


def _passes_computed(trainer, monkeypatch) -> list[int]:
    counting = _CountingSteps(trainer._steps)
    monkeypatch.setattr(trainer, "_steps", counting)
    return counting.calls


@pytest.mark.parametrize("pack,lora", [(False, False), (True, False), (False, True)])
def test_skipping_rows_without_signal_changes_no_gradient_update_or_metric(tiny_model_config, initial, monkeypatch,
                                                                          pack, lora):
    skipping, computing = _trainers(tiny_model_config, initial, pack=pack, lora=lora)
    batches = _iteration([True, False, False, False])  # the second micro-batch has no row of signal
    calls = {name: _passes_computed(trainer, monkeypatch)
             for name, trainer in (("skipping", skipping), ("computing", computing))}
    for trainer in (skipping, computing):
        for batch in batches:
            trainer.accumulate(batch)
    assert len(calls["computing"]) > len(calls["skipping"]) >= 1
    if not pack:  # passes of 2 rows: the first micro-batch's 2 with signal, none of the second's 4
        assert (len(calls["computing"]), len(calls["skipping"])) == (8, 2)
    # Exactly: a skipped pass would have added +0 to every gradient element.
    grads = [jax.device_get(t.accumulated_gradients()) for t in (skipping, computing)]
    if pack:  # the bins hold other sequences together, so sums run in another order
        assert rel_err(grads[0], grads[1]) < 1e-6
    else:
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]),
                                                       strict=True))
    assert any(np.any(leaf) for leaf in jax.tree.leaves(grads[0]))  # the rows with signal did train
    applied = {name: trainer.apply() for name, trainer in (("skipping", skipping), ("computing", computing))}
    assert applied["skipping"].pop("skipped_rows") == 12 and applied["computing"].pop("skipped_rows") == 0
    assert applied["skipping"].keys() == applied["computing"].keys()
    for name, value in applied["computing"].items():
        assert applied["skipping"][name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
    assert applied["computing"]["num_tokens"] == sum(float(np.asarray(b.loss_mask).sum()) for b in batches)
    weights = [jax.device_get(jax.tree.leaves(t.rollout_weights)) for t in (skipping, computing)]
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(*weights, strict=True)) < 1e-6
    # the count starts again with the next update
    skipping.accumulate(batches[0])
    assert skipping.apply()["skipped_rows"] == 4


def test_a_micro_batch_without_any_signal_still_counts_toward_the_update(tiny_model_config, initial, monkeypatch):
    skipping, _ = _trainers(tiny_model_config, initial, pack=False)
    calls = _passes_computed(skipping, monkeypatch)
    skipping.accumulate(_iteration([False, False, False, False])[0])
    assert calls == [] and skipping.pending_micro_batches == 1
    metrics = skipping.apply()  # an update of zero gradient, as computing the rows would have given
    assert metrics["grad_norm"] == 0.0 and metrics["skipped_rows"] == 8 and skipping.policy_version == 1


def test_nothing_is_skipped_where_the_loss_reads_more_than_the_advantage(tiny_model_config, initial, monkeypatch):
    """With the KL term a row of advantage 0 still has a gradient (towards the reference)."""
    with_kl = loss_config(aggregation="seq_mean", kl_coef=0.1, tis_cap=None)
    truncated_is = loss_config(aggregation="seq_mean", kl_coef=0.0, tis_cap=2.0)
    ppo = loss_config(name="ppo", aggregation="token_mean", advantage_estimator="grpo", kl_coef=0.0, tis_cap=None)
    for loss in (with_kl, truncated_is, ppo):
        config = trainer_config(micro_batch_size=MICRO, max_len=MAX_LEN, loss=loss, optimizer=ADAM, rows_per_pass=2)
        assert not skips_rows_without_signal(config), loss
    config = trainer_config(micro_batch_size=MICRO, max_len=MAX_LEN, loss=GRPO, optimizer=ADAM, rows_per_pass=2)
    assert skips_rows_without_signal(config)
    # train.skip_rows_without_signal=false (the emulation's calibration runs so)
    assert not skips_rows_without_signal(trainer_config(micro_batch_size=MICRO, max_len=MAX_LEN, loss=GRPO,
                                                        optimizer=ADAM, skip_rows_without_signal=False))
    batch = _iteration([True, False, False, False])[1]
    assert not rows_with_signal(batch).any()
    trainer = AgentTrainer("solver", tiny_model_config,
                           trainer_config(micro_batch_size=MICRO, max_len=MAX_LEN, loss=with_kl, optimizer=ADAM,
                                          rows_per_pass=2), initial=initial)
    calls = _passes_computed(trainer, monkeypatch)
    trainer.accumulate(batch)
    assert len(calls) == 4
