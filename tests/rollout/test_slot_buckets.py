"""The engine steps only the leading slots a batch occupies, and the loop moves its sequences down to let it:
tokens, log-probs and the untouched slots stay exactly what a full step gives."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from flexmarl_jax.models import functional
from flexmarl_jax.rollout.engine import SlotSampling
from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest

from .conftest import prompts_of_mixed_lengths


def _filled_state(engine, tiny_model, prompts):
    """A decode state with prompt i in slot i, sampled at temperature 1 with seed i."""
    state = engine.init_decode_state()
    for slot, prompt in enumerate(prompts):
        padded = np.full((8,), tiny_model.tokenizer.pad_id, np.int32)
        padded[: len(prompt)] = prompt
        prefix = engine.prefill(params=tiny_model.params, padded_tokens=padded, true_length=len(prompt),
                                sampling=SlotSampling(temperature=1.0, seed=slot))
        state = engine.insert(prefix, state, slot)
    return state


def test_slot_buckets_are_powers_of_two_from_four_up_to_every_slot(engine):
    assert engine.max_concurrent_decodes == 8
    assert [engine.slot_bucket(n) for n in (None, 1, 3, 4, 5, 7, 8, 9)] == [8, 4, 4, 4, 8, 8, 8, 8]
    assert engine.slot_buckets() == (4, 8)


def test_a_leading_slot_bucket_steps_those_slots_exactly_and_leaves_the_others_untouched(engine, tiny_model):
    prompts = [p[:7] for p in prompts_of_mixed_lengths(tiny_model.tokenizer, 8, seed=4) if len(p) >= 3][:8]
    assert len(prompts) == 8
    full_state = _filled_state(engine, tiny_model, prompts)
    bucket_state = _filled_state(engine, tiny_model, prompts)
    before = jax.tree.map(np.asarray, bucket_state)
    for _ in range(3):
        full_state, full = engine.generate(tiny_model.params, full_state)
        bucket_state, part = engine.generate(tiny_model.params, bucket_state, 3)  # 3 live -> bucket 4
    full, part = full.convert_to_numpy(), part.convert_to_numpy()
    after = jax.tree.map(np.asarray, bucket_state)

    np.testing.assert_array_equal(part.data[:4, :3], full.data[:4, :3])  # tokens, valid, lengths
    np.testing.assert_allclose(part.logprobs()[:4], full.logprobs()[:4], atol=1e-5)
    assert part.data[4:, 1].sum() == 0  # nothing valid past the bucket
    np.testing.assert_array_equal(after.positions[:4], before.positions[:4] + 3)
    np.testing.assert_array_equal(after.positions[4:], before.positions[4:])
    np.testing.assert_array_equal(after.generated[4:], before.generated[4:])
    np.testing.assert_array_equal(after.next_logits[4:], before.next_logits[4:])
    for name in ("k", "v"):
        np.testing.assert_array_equal(after.cache[name][:, 4:], before.cache[name][:, 4:])
        assert not np.array_equal(after.cache[name][:, :4], before.cache[name][:, :4])


def test_moving_a_slot_carries_its_whole_state(engine, tiny_model):
    prompts = [p[:7] for p in prompts_of_mixed_lengths(tiny_model.tokenizer, 8, seed=9) if len(p) >= 3][:8]
    state = engine.generate(tiny_model.params, _filled_state(engine, tiny_model, prompts))[0]
    before = jax.tree.map(np.asarray, state)
    after = jax.tree.map(np.asarray, engine.move_slots(state, [6, 7], [1, 2]))
    for source, destination in ((6, 1), (7, 2)):
        for name in ("positions", "generated", "seed", "sample_index", "temperature", "next_logits"):
            np.testing.assert_array_equal(getattr(after, name)[destination], getattr(before, name)[source])
        for name in ("k", "v"):
            np.testing.assert_array_equal(after.cache[name][:, destination], before.cache[name][:, source])
    np.testing.assert_array_equal(after.cache["k"][:, [0, 3, 4, 5]], before.cache["k"][:, [0, 3, 4, 5]])
    with pytest.raises(ValueError, match="distinct slots"):
        engine.move_slots(engine.init_decode_state(), [1, 2], [2, 3])


def test_the_loop_steps_smaller_buckets_in_a_tail_and_gives_the_same_samples(engine, tiny_model, monkeypatch):
    prompts = prompts_of_mixed_lengths(tiny_model.tokenizer, 8, seed=2)
    # Long budgets in the last slots: without moves, the tail would keep all 8 slots stepping.
    requests = [RolloutRequest(p, max_new_tokens=3 if i < 6 else 20, ignore_eos=True,
                               sampling=SlotSampling(temperature=1.0, seed=100 + i)) for i, p in enumerate(prompts)]

    def run(compaction: bool):
        buckets, moves = [], []
        generate, move_slots = engine.generate, engine.move_slots

        def counting_generate(params, state, live_slots=None):
            buckets.append(engine.slot_bucket(live_slots))
            return generate(params, state, live_slots)

        def counting_move(state, sources, destinations):
            moves.append((list(sources), list(destinations)))
            return move_slots(state, sources, destinations)

        with monkeypatch.context() as patch:
            patch.setattr(engine, "generate", counting_generate)
            patch.setattr(engine, "move_slots", counting_move)
            loop = RolloutLoop(engine, tiny_model.params)
            if not compaction:
                patch.setattr(loop, "_compact", lambda: None)
                patch.setattr(loop, "_live_slots", lambda: engine.max_concurrent_decodes)
            results = loop.generate(requests)
        return results, buckets, moves

    moved, moved_buckets, moves = run(compaction=True)
    fixed, fixed_buckets, _ = run(compaction=False)
    # One move, once the six short ones are done: the two long ones (wherever their prompts' buckets put them)
    # into the two lowest free slots.
    assert len(moves) == 1 and len(moves[0][0]) == 2 and min(moves[0][0]) >= 4 and moves[0][1] == [0, 1]
    assert set(fixed_buckets) == {8} and moved_buckets.count(4) >= 15
    for with_moves, without in zip(moved, fixed, strict=True):
        assert with_moves[0].token_ids == without[0].token_ids
        np.testing.assert_allclose(with_moves[0].logprobs, without[0].logprobs, atol=1e-5)


def test_prefill_logits_at_one_position_equal_that_row_of_the_full_logits(tiny_model):
    tokens = np.asarray([[5, 9, 3, 7, 0, 0], [4, 4, 8, 1, 2, 6]], np.int32)
    mask = np.asarray([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)

    def cache():
        return functional.init_cache(tiny_model.config, 2, 6, np.float32)

    full, _ = functional.prefill(tiny_model.graphdef, tiny_model.params, tokens, mask, cache())
    last, _ = functional.prefill(tiny_model.graphdef, tiny_model.params, tokens, mask, cache(),
                                 logits_at=np.asarray([3, 5], np.int32))
    assert last.shape == (2, 1, full.shape[-1])
    np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(full)[[0, 1], [3, 5]], atol=1e-5)
