"""TimedProcessPool with standard-library functions as the workers' function: `time.sleep` is a call that misses
its deadline, `os._exit` a worker that crashes, `math.sqrt(-1)` a function that raises."""

import math
import os
import threading
import time

import pytest

from flexmarl_jax.workflows.process_pool import CallTimeout, PoolCallError, PoolClosed, TimedProcessPool, WorkerLost


@pytest.mark.timeout(60)
def test_results_and_worker_reuse():
    pool = TimedProcessPool(math.sqrt, workers=2, timeout_s=5.0)
    try:
        assert [pool.call(value) for value in (4.0, 9.0, 2.25)] == [2.0, 3.0, 1.5]
        pids = {worker.process.pid for worker in pool._live}
        assert len(pids) == 2 and pool.call(16.0) == 4.0
        assert {worker.process.pid for worker in pool._live} == pids  # reused, not restarted
        with pytest.raises(PoolCallError, match="ValueError: math domain error") as raised:
            pool.call(-1.0)
        assert not isinstance(raised.value, WorkerLost) and pool.replaced == 0  # the worker survives a raise
        assert pool.call(25.0) == 5.0
    finally:
        pool.close()


@pytest.mark.timeout(60)
def test_a_call_past_its_deadline_is_killed_and_the_worker_replaced():
    pool = TimedProcessPool(time.sleep, workers=1, timeout_s=0.5)
    try:
        assert pool.call(0.0) is None  # the worker has started
        started = time.monotonic()
        with pytest.raises(CallTimeout, match="no answer within 0.5 s"):
            pool.call(60.0)
        assert time.monotonic() - started < 0.5 + 2.0  # the caller does not wait for the replacement
        assert pool.replaced == 1
        assert pool.call(0.01) is None  # the replacement serves
    finally:
        pool.close()


@pytest.mark.timeout(60)
def test_a_crashed_worker_is_replaced():
    pool = TimedProcessPool(os._exit, workers=1, timeout_s=5.0)
    try:
        with pytest.raises(WorkerLost, match="died during the call \\(exit code 3\\)"):
            pool.call(3)
        assert pool.replaced == 1
        with pytest.raises(WorkerLost, match="exit code 4"):  # the replacement runs calls again
            pool.call(4)
    finally:
        pool.close()


@pytest.mark.timeout(60)
def test_a_failed_warm_up_breaks_the_pool_without_restarts():
    pool = TimedProcessPool(math.sqrt, workers=2, timeout_s=5.0, warm_up_args=(-1.0,))
    try:
        with pytest.raises(WorkerLost, match="warm-up failed: ValueError"):
            pool.call(4.0)
        for _ in range(3):  # answered at once, without starting workers
            with pytest.raises(PoolCallError, match="workers cannot start: .*warm-up failed"):
                pool.call(4.0)
        assert pool.replaced == 0
    finally:
        pool.close()


@pytest.mark.timeout(60)
def test_close_ends_calls_in_progress_and_refuses_new_ones():
    pool = TimedProcessPool(time.sleep, workers=1, timeout_s=30.0)
    pool.call(0.0)
    errors = []

    def sleep_long():
        try:
            pool.call(30.0)
        except PoolCallError as error:
            errors.append(error)

    callers = [threading.Thread(target=sleep_long) for _ in range(2)]  # one runs, one waits for the worker
    for caller in callers:
        caller.start()
    time.sleep(0.5)
    started = time.monotonic()
    pool.close()
    for caller in callers:
        caller.join(timeout=10)
    assert time.monotonic() - started < 5.0 and not any(caller.is_alive() for caller in callers)
    assert sorted(type(error).__name__ for error in errors) == ["PoolClosed", "WorkerLost"]
    with pytest.raises(PoolClosed):
        pool.call(0.0)
    assert not pool._live
