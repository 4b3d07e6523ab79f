"""Packed micro-batches (train/packing.py): every token lands once, sequences never see each other, and a packed
trainer's loss and gradients are the unpacked one's, on a long-tailed batch whose 16 rows pack into 2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexmarl_jax.models import functional
from flexmarl_jax.train.batch import build_iteration, validate_micro_batch
from flexmarl_jax.train.packing import first_fit_bins, pack_micro_batch, packed_bin_counts, padding_fraction
from flexmarl_jax.train.trainer import AgentTrainer
from tests.settings_views import lora_spec, trainer_config
from tests.train.conftest import ADAM, LOSS, rel_err

MAX_LEN = 64
MICRO = 16


def _long_tailed_rows(count: int, seed: int) -> dict:
    """Store-like rows: responses of 1-6 tokens, one of 55 (the long tail), prompts of 1-4."""
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(3, 100, size=rng.integers(1, 5)))) for _ in range(count)]
    sizes = [int(n) for n in rng.integers(1, 7, size=count)]
    sizes[count // 2] = 55
    responses = [list(map(int, rng.integers(3, 100, size=n))) for n in sizes]
    return dict(prompt_ids=prompts, response_ids=responses,
                behaviour_logprobs=[list(-4.6 + 0.1 * rng.normal(size=len(r))) for r in responses],
                advantages=list(rng.normal(size=count)))


def _batches(rows, micro=MICRO):
    return build_iteration(agent="solver", aggregation=LOSS.aggregation, micro_batch_size=micro, max_len=MAX_LEN,
                           **rows)  # PPO's old_values and returns too, when the rows carry them


def test_bin_counts_and_first_fit():
    assert packed_bin_counts(16, 16) == (1, 2, 4, 8, 16)
    assert packed_bin_counts(16, 4) == (1, 2, 4, 8, 12, 16)
    assert packed_bin_counts(8, 4, row_multiple=2) == (2, 4, 8)
    lengths = [int(n) for n in np.random.default_rng(0).integers(1, 40, size=50)]
    bins = first_fit_bins(lengths, 64)
    assert sorted(row for group in bins for row in group) == list(range(50))  # each row once
    assert all(sum(lengths[row] for row in group) <= 64 for group in bins)
    assert len(bins) <= int(np.ceil(11 / 9 * sum(lengths) / 64)) + 1
    assert bins == first_fit_bins(lengths, 64)
    with pytest.raises(ValueError, match="row 1 has 65 tokens, more than a bin's 64"):
        first_fit_bins([3, 65], 64)


def test_every_token_lands_once_with_its_values_and_restarted_positions():
    batch = _batches(_long_tailed_rows(MICRO, seed=1))[0]
    packed = pack_micro_batch(batch, packed_bin_counts(MICRO, MICRO))
    assert packed.shape == (2, MAX_LEN) and batch.shape == (MICRO, MAX_LEN)  # 16 rows, 2 bins
    assert padding_fraction(packed) < 0.1 < 0.8 < padding_fraction(batch)
    segments = np.asarray(packed.segment_ids)
    found = 0
    for row in range(MICRO):
        n = int(np.asarray(batch.attention_mask)[row].sum())
        # the row is the one segment of some bin whose tokens, targets and weights are the row's, in order
        matches = [(b, s) for b in range(2) for s in range(1, segments[b].max() + 1)
                   if (segments[b] == s).sum() == n
                   and np.array_equal(np.asarray(packed.tokens)[b][segments[b] == s], np.asarray(batch.tokens)[row, :n])
                   and np.array_equal(np.asarray(packed.token_weights)[b][segments[b] == s],
                                      np.asarray(batch.token_weights)[row, :n])]
        assert matches, row
        b, s = matches[0]
        assert np.array_equal(np.asarray(packed.positions)[b][segments[b] == s], np.arange(n))
        found += n
    assert found == int((segments > 0).sum()) == int(np.asarray(batch.attention_mask).sum())
    assert float(np.asarray(packed.token_weights).sum()) == pytest.approx(float(np.asarray(batch.token_weights).sum()))
    with pytest.raises(ValueError, match="packed already"):
        pack_micro_batch(packed, (4,))
    with pytest.raises(ValueError, match=r"2 bins do not fit any allowed bin count \(1,\)"):
        pack_micro_batch(batch, (1,))
    with pytest.raises(ValueError, match=r"a packed micro-batch of \(2,\) bins; agent 'solver' takes \[8, 16\]"):
        validate_micro_batch(packed, agent="solver", batch_size=MICRO, max_len=MAX_LEN, bin_counts=(8, 16))


def test_packed_sequences_do_not_see_each_other(tiny_model_config, initial):
    """Each packed sequence's logits are its logits alone (float32, 1e-5): no attention crosses a segment."""
    graphdef, params = initial
    batch = _batches(_long_tailed_rows(MICRO, seed=2))[0]
    packed = pack_micro_batch(batch, packed_bin_counts(MICRO, MICRO))
    alone = np.asarray(functional.forward(graphdef, params, jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
                                          jnp.asarray(batch.attention_mask)))
    together = np.asarray(functional.forward(graphdef, params, jnp.asarray(packed.tokens),
                                             jnp.asarray(packed.positions), jnp.asarray(packed.attention_mask),
                                             segment_ids=jnp.asarray(packed.segment_ids)))
    lengths = np.asarray(batch.attention_mask).sum(axis=1)
    for bin_index, group in enumerate(first_fit_bins([int(n) for n in lengths], MAX_LEN)):  # pack's own layout
        offset = 0
        for row in group:
            n = int(lengths[row])
            assert np.max(np.abs(together[bin_index, offset:offset + n] - alone[row, :n])) < 1e-5, row
            offset += n


@pytest.mark.parametrize("lora,rows_per_pass,algorithm", [(False, 0, "grpo"), (True, 0, "grpo"), (False, 4, "grpo"),
                                                          (False, 0, "ppo")])
def test_a_packed_trainer_has_the_unpacked_loss_and_gradient(tiny_model_config, initial, lora, rows_per_pass,
                                                             algorithm):
    """Two micro-batches of a long-tailed iteration (KL on, so the reference's log-probs pack too): gradients
    within 1e-5 relative, every metric within 1e-5, in fewer rows; with passes of 4, fewer passes. PPO: the
    critic's old values and the returns are per token, fixed per sequence before packing (GAE runs on each
    unpacked row), so they pack as the log-probs do and the value loss is the unpacked one's."""
    from flexmarl_jax.train.algorithms import loss_config_for

    spec = lora_spec(rank=4, alpha=8.0) if lora else lora_spec(rank=0)
    rows = _long_tailed_rows(2 * MICRO, seed=3)
    loss = LOSS
    if algorithm == "ppo":
        loss = loss_config_for("ppo", kl_coef=LOSS.kl_coef, tis_cap=LOSS.tis_cap)
        rng = np.random.default_rng(4)
        rows["old_values"] = [list(rng.normal(size=len(r))) for r in rows["response_ids"]]
        rows["returns"] = [list(rng.normal(size=len(r))) for r in rows["response_ids"]]
    trainers = {}
    for pack in (False, True):
        config = trainer_config(micro_batch_size=MICRO, max_len=MAX_LEN, loss=loss, optimizer=ADAM, lora=spec,
                                rows_per_pass=rows_per_pass, pack_rows=pack)
        trainer = trainers[pack] = AgentTrainer("solver", tiny_model_config, config, initial=initial)
        for batch in _batches(rows):
            trainer.accumulate(batch)
    unpacked, packed = trainers[False], trainers[True]
    assert rel_err(packed.accumulated_gradients(), unpacked.accumulated_gradients()) < 1e-5
    metrics = {pack: jax.device_get(trainer._accum["metrics"]) for pack, trainer in trainers.items()}
    for name, value in metrics[False].items():
        assert float(metrics[True][name]) == pytest.approx(float(value), rel=1e-5, abs=1e-6), name
    if algorithm == "ppo":  # the critic's loss is in the compared gradients and metrics
        assert float(metrics[False]["value_loss"]) > 0.1
    if rows_per_pass:
        bins = [packed._place_passes(pack_micro_batch(b, packed._bin_counts())) for b in _batches(rows)]
        assert sum(len(passes) for passes in bins) < 2 * MICRO // rows_per_pass
    applied = {pack: trainer.apply() for pack, trainer in trainers.items()}
    assert applied[True]["loss"] == pytest.approx(applied[False]["loss"], rel=1e-5)


def test_the_emulated_trainer_charges_the_bins_it_would_compute():
    """With pack_rows the emulated trainer charges bins x the batch's length (dense attention per bin), as the real
    step computes them: here 2 bins where the padded step computes 16 rows of the longest row."""
    from flexmarl_jax.emulation import get_chip
    from flexmarl_jax.emulation.timescale import TimeScale
    from flexmarl_jax.emulation.trainer import EmulatedTrainer
    from flexmarl_jax.models.presets import get_preset
    from tests.settings_views import cost_model

    batch = _batches(_long_tailed_rows(MICRO, seed=1))[0]
    charges = {}
    for pack in (False, True):
        config = trainer_config(micro_batch_size=MICRO, max_len=MAX_LEN, loss=LOSS, optimizer=ADAM, pack_rows=pack)
        trainer = EmulatedTrainer("solver", cost_model(get_preset("tiny"), get_chip("v5e")), config,
                                  timescale=TimeScale(1e6))
        trainer.accumulate(batch)
        charges[pack] = trainer.charges[-1]
    longest = int(np.asarray(batch.attention_mask).sum(axis=1).max())  # 55 response tokens and a short prompt
    assert (charges[False].rows, charges[False].length) == (MICRO, longest) and longest > 54
    assert (charges[True].rows, charges[True].length) == (2, MAX_LEN)
    assert charges[True].device_s < 0.5 * charges[False].device_s
