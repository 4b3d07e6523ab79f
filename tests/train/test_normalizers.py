import numpy as np
import pytest

from flexmarl_jax.train.normalizers import IterationNormalizers, token_weights_for


def _mask(lengths, width=6):
    m = np.zeros((len(lengths), width), bool)
    for i, n in enumerate(lengths):
        m[i, 1:1 + n] = True
    return m


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "seq_mean_token_sum_norm"])
def test_weights_of_split_iteration_equal_weights_of_whole(aggregation):
    lengths = [1, 4, 2, 5, 3]
    norm = IterationNormalizers.from_response_lengths(lengths, norm_length=5)
    whole = token_weights_for(aggregation, _mask(lengths), norm)
    parts = np.concatenate([token_weights_for(aggregation, _mask(lengths[:2]), norm),
                            token_weights_for(aggregation, _mask(lengths[2:]), norm)])
    np.testing.assert_array_equal(whole, parts)


def test_weight_totals():
    lengths = [1, 4, 2]
    norm = IterationNormalizers.from_response_lengths(lengths, norm_length=8)
    mask = _mask(lengths)
    assert token_weights_for("token_mean", mask, norm).sum() == pytest.approx(1.0)
    assert token_weights_for("seq_mean", mask, norm).sum() == pytest.approx(1.0)
    assert token_weights_for("seq_mean_token_sum_norm", mask, norm).sum() == pytest.approx(7 / 8 / 3)
    assert np.all(token_weights_for("seq_mean", mask, norm)[~mask] == 0)


def test_bad_normalizers_and_names():
    with pytest.raises(ValueError, match="total_tokens=0"):
        IterationNormalizers(total_tokens=0, num_sequences=1, norm_length=1)
    with pytest.raises(ValueError, match="at least one sample"):
        IterationNormalizers.from_response_lengths([])
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'; allowed"):
        token_weights_for("mean", _mask([1]), IterationNormalizers(1, 1, 1))
