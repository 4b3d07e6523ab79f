"""The invariant checker itself catches each kind of violation."""

import pytest

from flexmarl_jax.orchestrator.invariants import ConsistencyChecker, InvariantViolation


def _checker(max_staleness=0):
    checker = ConsistencyChecker(max_staleness)
    checker.weights_synced("a", 0)
    checker.weights_synced("b", 0)
    return checker


def test_a_clean_strict_iteration_passes():
    checker = _checker()
    checker.generated("q_0_0", "a", {"a": 0})
    checker.generated("q_1_0", "b", {"a": 0, "b": 0})
    checker.trained(["q_0_0"], "a", {"a": 0, "b": 0})
    checker.trained(["q_1_0"], "b", {"a": 0, "b": 0})
    checker.check_all_consumed()
    assert checker.checks == 4


def test_training_twice_or_stale_or_unknown_is_caught():
    checker = _checker()
    checker.generated("s", "a", {"a": 0})
    checker.trained(["s"], "a", {"a": 0, "b": 0})
    with pytest.raises(InvariantViolation, match="trained 2 times"):
        checker.trained(["s"], "a", {"a": 0, "b": 0})
    checker.generated("t", "b", {"a": 0, "b": 0})
    with pytest.raises(InvariantViolation, match="max_staleness=0"):
        checker.trained(["t"], "b", {"a": 1, "b": 0})
    with pytest.raises(InvariantViolation, match="unknown sample"):
        checker.trained(["nope"], "a", {"a": 0, "b": 0})


def test_staleness_bound_and_drops():
    checker = _checker(max_staleness=1)
    checker.generated("s", "a", {"a": 0})
    checker.weights_synced("a", 1)
    checker.weights_synced("a", 2)
    with pytest.raises(InvariantViolation, match="max_staleness=1"):
        checker.trained(["s"], "a", {"a": 2, "b": 0})
    checker.dropped(["s"], "a")
    assert checker.untrained() == []


def test_rollout_cannot_use_unsynced_weights():
    checker = _checker()
    with pytest.raises(InvariantViolation, match="before that version reached rollout"):
        checker.generated("s", "a", {"a": 1})
    with pytest.raises(InvariantViolation, match="went back"):
        checker.weights_synced("a", -1)


def test_agents_may_share_sample_ids():
    checker = _checker()
    checker.generated("q_0_0", "a", {"a": 0})
    checker.generated("q_0_0", "b", {"b": 0})
    checker.trained(["q_0_0"], "a", {"a": 0, "b": 0})
    checker.trained(["q_0_0"], "b", {"a": 0, "b": 0})
    checker.check_all_consumed()


def test_unconsumed_samples_fail_the_iteration():
    checker = _checker()
    checker.generated("s", "a", {"a": 0})
    with pytest.raises(InvariantViolation, match="never trained"):
        checker.check_all_consumed()
