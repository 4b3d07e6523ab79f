import numpy as np
import pytest

from flexmarl_jax.train.batch import ARRAY_FIELDS, build_micro_batch, stack_rows, validate_micro_batch
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
