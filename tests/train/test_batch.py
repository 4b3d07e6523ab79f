import numpy as np
import pytest

from flexmarl_jax.train.batch import (
    ARRAY_FIELDS,
    bucket_length,
    build_micro_batch,
    length_buckets,
    stack_rows,
    validate_micro_batch,
)
from flexmarl_jax.train.normalizers import IterationNormalizers


def _rows():
    return dict(
        prompt_ids=[[1, 5, 6], [1, 7]],
        response_ids=[[10, 11], [12, 13, 14]],
        behaviour_logprobs=[[-0.1, -0.2], [-0.3, -0.4, -0.5]],
        advantages=[1.5, -0.5],
    )


def _build(**overrides):
    kwargs = dict(agent="solver", normalizers=IterationNormalizers.from_response_lengths([2, 3]),
                  aggregation="token_mean", batch_size=4, max_len=6, pad_id=0, **_rows())
    kwargs.update(overrides)
    return build_micro_batch(**kwargs)


def test_build_aligns_targets_masks_and_per_token_values():
    b = _build()
    assert b.shape == (4, 6) and b.agent == "solver"
    np.testing.assert_array_equal(b.tokens[0, :4], [1, 5, 6, 10])
    np.testing.assert_array_equal(b.targets[0, :4], [5, 6, 10, 11])
    np.testing.assert_array_equal(b.loss_mask[0], [0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(b.targets[0][b.loss_mask[0]], [10, 11])
    np.testing.assert_array_equal(b.targets[1][b.loss_mask[1]], [12, 13, 14])
    np.testing.assert_allclose(b.behaviour_logprobs[1][b.loss_mask[1]], [-0.3, -0.4, -0.5])
    np.testing.assert_allclose(b.old_logprobs, b.behaviour_logprobs)  # default: on-policy
    np.testing.assert_allclose(b.advantages[0][b.loss_mask[0]], [1.5, 1.5])
    np.testing.assert_array_equal(b.positions[1, :4], [0, 1, 2, 3])
    assert b.attention_mask[0].sum() == 4 and b.attention_mask[1].sum() == 4
    # padding rows add nothing; the weights of the real tokens sum to this micro-batch's share
    assert not b.loss_mask[2:].any() and b.token_weights[2:].sum() == 0
    assert b.token_weights.sum() == pytest.approx(1.0)
    validate_micro_batch(b, agent="solver", batch_size=4, max_len=6)


def test_split_rows_keep_shape_fields():
    b = _build()
    half = stack_rows(b, slice(0, 2))
    assert half.shape == (2, 6)
    assert all(getattr(half, f).shape == (2, 6) for f in ARRAY_FIELDS)


def test_validation_errors_name_the_problem():
    b = _build()
    with pytest.raises(ValueError, match="belongs to agent 'solver', but this trainer trains 'verifier'"):
        validate_micro_batch(b, agent="verifier", batch_size=4, max_len=6)
    with pytest.raises(ValueError, match=r"'tokens' has shape \(4, 6\); agent 'solver' needs \(8, 6\)"):
        validate_micro_batch(b, agent="solver", batch_size=8, max_len=6)
    bad = b.replace(advantages=b.advantages.astype(np.float64))
    with pytest.raises(ValueError, match="'advantages' has dtype float64; allowed: float32"):
        validate_micro_batch(bad, agent="solver", batch_size=4, max_len=6)
    bad = b.replace(tokens=b.tokens.astype(np.int64))
    with pytest.raises(ValueError, match="'tokens' has dtype int64; allowed: int32"):
        validate_micro_batch(bad, agent="solver", batch_size=4, max_len=6)
    with pytest.raises(TypeError, match="expected a MicroBatch"):
        validate_micro_batch({"tokens": 1}, agent="solver", batch_size=4, max_len=6)


def test_build_rejects_bad_rows():
    with pytest.raises(ValueError, match="max_len=3 allows at most 4"):
        _build(max_len=3)
    with pytest.raises(ValueError, match="row 1: behaviour_logprobs has shape \\(2,\\)"):
        _build(behaviour_logprobs=[[-0.1, -0.2], [-0.3, -0.4]])
    with pytest.raises(ValueError, match="needs 1..1 rows"):
        _build(batch_size=1)
    with pytest.raises(ValueError, match="advantages has 1 rows but prompt_ids has 2"):
        _build(advantages=[1.0])


def test_length_buckets_are_powers_of_two_ending_at_max_len():
    assert length_buckets(6) == (6,)
    assert length_buckets(16) == (16,)
    assert length_buckets(100) == (16, 32, 64, 100)
    assert length_buckets(1056) == (16, 32, 64, 128, 256, 512, 1024, 1056)
    for max_len in (17, 100, 1024, 1056, 4097):
        buckets = length_buckets(max_len)
        assert len(buckets) <= 2 + (max_len // 16).bit_length() and buckets[-1] == max_len
        for longest in range(1, max_len + 1, 7):
            bucket = bucket_length(longest, max_len)
            assert bucket >= longest and bucket in buckets
            assert all(smaller < longest for smaller in buckets if smaller < bucket)  # the smallest that fits


def test_build_pads_to_the_smallest_bucket_of_its_longest_row():
    # rows of 3 + 2 and 2 + 3 tokens: 4 inputs each -> bucket 16 of max_len 40; the same rows unbucketed -> 40
    b = _build(max_len=40)
    assert b.shape == (4, 16)
    validate_micro_batch(b, agent="solver", batch_size=4, max_len=40)
    full = _build(max_len=40, bucketed=False)
    assert full.shape == (4, 40)
    for name in ARRAY_FIELDS:
        np.testing.assert_array_equal(getattr(full, name)[:, :16], getattr(b, name), err_msg=name)
        assert not np.any(getattr(full, name)[:, 16:]), name
    long_row = _build(max_len=40, prompt_ids=[[1] * 20, [1, 7]], response_ids=[[10, 11], [12, 13, 14]])
    assert long_row.shape == (4, 32)
    with pytest.raises(ValueError, match=r"'tokens' has shape \(4, 12\); agent 'solver' needs \(4, L\) with L in "
                                         r"\(16, 32, 40\)"):
        validate_micro_batch(b.replace(**{n: getattr(b, n)[:, :12] for n in ARRAY_FIELDS}), agent="solver",
                             batch_size=4, max_len=40)
    with pytest.raises(ValueError, match=r"'targets' has shape \(4, 32\); agent 'solver' needs"):
        validate_micro_batch(b.replace(targets=long_row.targets), agent="solver", batch_size=4, max_len=40)
