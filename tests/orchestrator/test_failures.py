"""Failures inside an iteration: a trainer that raises gives every claimed row back and the iteration is tried
once more, then the run stops; a thread that never returns ends the pipeline's wait instead of hanging it."""

import threading
import time

import pytest

from flexmarl_jax.orchestrator.dispatch import TrainerFailed
from flexmarl_jax.orchestrator.liveness import IterationAbandoned, PipelineStalled
from flexmarl_jax.orchestrator.retry import IterationFailed, run_with_one_retry
from flexmarl_jax.orchestrator.run import _begin_attempt


def _fail_on_call(trainer, calls_before_failure: int | None, *, block: threading.Event | None = None):
    """Makes `trainer.accumulate` raise (or block until `block` is set, then raise) once it was called
    `calls_before_failure` times; None: every call fails. Returns the call counter."""
    original, calls = trainer.accumulate, []

    def accumulate(batch):
        calls.append(len(calls))
        if calls_before_failure is None or len(calls) > calls_before_failure:
            if block is not None:
                block.wait()
            raise RuntimeError("injected trainer failure")
        return original(batch)

    trainer.accumulate = accumulate
    return calls


def _counts(store):
    counters = store.counters()
    return {state: sum(counts[state] for counts in counters.values())
            for state in ("pending", "ready", "claimed", "consumed", "dropped", "total")}


@pytest.mark.timeout(180)
def test_a_trainer_error_releases_every_claimed_row_and_the_retry_trains_each_sample_once(orchestrator_factory):
    orchestrator, _ = orchestrator_factory("flexmarl")
    solver = orchestrator.trainers["solver"]
    calls = _fail_on_call(solver, calls_before_failure=1)  # the second micro-batch of the solver fails
    _begin_attempt(orchestrator, None, 0, durable=False)  # attempt 0, as run.py's loop starts it
    with pytest.raises(TrainerFailed, match="agent 'solver': training a micro-batch of 8 rows failed"):
        orchestrator.run_iteration(0)
    assert len(calls) == 2
    first = _counts(orchestrator.store)
    # Nothing claimed is left behind, nothing was consumed, nothing was applied.
    assert first["claimed"] == 0 and first["consumed"] == 0 and first["ready"] == first["total"] > 0
    assert orchestrator.versions() == {agent: 0 for agent in orchestrator.trainers}
    assert all(trainer.pending_micro_batches == 0 for trainer in orchestrator.trainers.values())

    del solver.accumulate  # the trainer recovers
    _begin_attempt(orchestrator, None, 0, durable=False)  # the retry: attempt 1 drops attempt 0's rows
    record = orchestrator.run_iteration(0)
    after = _counts(orchestrator.store)
    trained = sum(agent["samples"] for agent in record["agent"].values())
    assert after["dropped"] == first["total"]  # the failed attempt's rows: dropped, never trained
    assert after["consumed"] == trained == after["total"] - first["total"]  # the retry's rows: trained once
    assert after["claimed"] == after["ready"] == after["pending"] == 0
    assert orchestrator.versions() == {agent: 1 for agent in orchestrator.trainers}


@pytest.mark.timeout(180)
def test_a_second_trainer_error_stops_the_run_with_nothing_claimed_or_applied(orchestrator_factory):
    orchestrator, _ = orchestrator_factory("sync")
    calls = _fail_on_call(orchestrator.trainers["verifier"], calls_before_failure=None)
    with pytest.raises(IterationFailed, match=r"iteration 0 failed twice: agent 'verifier': .*injected"):
        run_with_one_retry(orchestrator, 0, lambda it: _begin_attempt(orchestrator, None, it, durable=False))
    assert len(calls) == 2  # one micro-batch per attempt, then each attempt gave up
    counts = _counts(orchestrator.store)
    assert counts["claimed"] == counts["consumed"] == 0
    assert counts["dropped"] + counts["ready"] == counts["total"] > 0  # attempt 0 dropped; attempt 1 resumable
    assert orchestrator.versions() == {agent: 0 for agent in orchestrator.trainers}


@pytest.mark.timeout(90)
def test_a_hung_trainer_ends_the_iteration_within_the_stall_timeout(orchestrator_factory):
    orchestrator, _ = orchestrator_factory("flexmarl", stall_timeout_s=2.0)
    unblock = threading.Event()
    _fail_on_call(orchestrator.trainers["solver"], calls_before_failure=0, block=unblock)
    try:
        started = time.monotonic()
        with pytest.raises(PipelineStalled, match=r"no progress for \d+ s \(run.stall_timeout_s=2\) while waiting for"):
            orchestrator.run_iteration(0)
        assert time.monotonic() - started < 30
        # The hung claim was kept from the moment it was claimed, so it was released with the rest.
        assert _counts(orchestrator.store)["claimed"] == 0
    finally:
        unblock.set()


@pytest.mark.timeout(90)
def test_an_abandoned_iteration_applies_nothing_and_releases_its_claims(orchestrator_factory):
    orchestrator, _ = orchestrator_factory("flexmarl")
    started = threading.Event()
    original = orchestrator.trainers["solver"].accumulate

    def accumulate(batch):  # abandon while the solver trains its first micro-batch
        started.set()
        orchestrator.abandon_iteration()
        return original(batch)

    orchestrator.trainers["solver"].accumulate = accumulate
    with pytest.raises(IterationAbandoned, match="abandoned"):
        orchestrator.run_iteration(0)
    assert started.is_set()
    assert _counts(orchestrator.store)["claimed"] == _counts(orchestrator.store)["consumed"] == 0
    assert orchestrator.versions() == {agent: 0 for agent in orchestrator.trainers}
    assert all(trainer.pending_micro_batches == 0 for trainer in orchestrator.trainers.values())


@pytest.mark.timeout(120)
def test_the_trainer_error_fault_point_is_recovered_by_one_retry(orchestrator_factory):
    from flexmarl_jax import faults

    orchestrator, _ = orchestrator_factory("flexmarl")
    faults.arm("trainer_error", after=1, where="verifier")  # the verifier's second micro-batch, once
    try:
        record = run_with_one_retry(orchestrator, 0, lambda it: _begin_attempt(orchestrator, None, it, durable=False))
        assert faults.fired("trainer_error") == 1
    finally:
        faults.disarm()
    counts = _counts(orchestrator.store)
    assert orchestrator.attempts[0] == 1 and orchestrator.versions() == {a: 1 for a in orchestrator.trainers}
    assert counts["consumed"] == sum(agent["samples"] for agent in record["agent"].values())
    assert counts["consumed"] + counts["dropped"] == counts["total"] and counts["claimed"] == counts["ready"] == 0


@pytest.mark.timeout(180)
def test_a_failed_step_that_also_breaks_dropping_the_gradients_still_raises_its_own_error(orchestrator_factory):
    """A step that fails after consuming the trainer's donated state (a collective whose peer died, an
    out-of-memory) leaves nothing to drop: the iteration's rows are still all given back, and the error raised is
    the step's, not the discard's."""
    orchestrator, _ = orchestrator_factory("flexmarl")
    solver = orchestrator.trainers["solver"]
    _fail_on_call(solver, calls_before_failure=0)

    def discard_accumulated():
        raise RuntimeError("Array has been deleted")

    solver.discard_accumulated = discard_accumulated
    _begin_attempt(orchestrator, None, 0, durable=False)
    with pytest.raises(TrainerFailed, match="agent 'solver': training a micro-batch of 8 rows failed") as raised:
        orchestrator.run_iteration(0)
    assert "injected trainer failure" in str(raised.value.__cause__)
    counts = _counts(orchestrator.store)
    assert counts["claimed"] == 0 and counts["consumed"] == 0 and counts["ready"] == counts["total"] > 0
