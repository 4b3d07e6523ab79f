"""Stuck and crashed instances: a hung engine step blocks neither the instance's API nor the router's checks;
an instance that makes no progress is taken out of routing and its requests are served by the agent's other
instances, each request resolving exactly once; retries are bounded, then the request fails naming itself."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from flexmarl_jax.rollout.health import InstanceHealthMonitor
from flexmarl_jax.rollout.instance import EngineInstance
from flexmarl_jax.rollout.loop import RolloutRequest
from flexmarl_jax.rollout.progress import StepProgress
from flexmarl_jax.rollout.router import BROKEN, SERVING, RequestFailed, RequestRouter
from tests.settings_views import router_settings

from .test_router import FakeClock, FakeInstance


class SteppingFake(FakeInstance):
    """A FakeInstance with a step counter; `tick()` is one engine step that finishes nothing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.progress = StepProgress()

    def tick(self) -> None:
        self.progress.begin()
        self.progress.end()


def _returns_within(call, seconds: float):
    """Runs `call` on a thread; (True, its result) if it returned within `seconds`, else (False, None)."""
    box = []
    thread = threading.Thread(target=lambda: box.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    return (not thread.is_alive(), box[0] if box else None)


def _hung_and_healthy(engine, tiny_model):
    """Two instances of one engine: "hung", whose steps wait for the returned event (a device call that never
    returns until the test sets it), and "healthy"."""
    hung, healthy = EngineInstance(engine, tiny_model.params, name="hung"), \
        EngineInstance(engine, tiny_model.params, name="healthy")
    release = threading.Event()
    real_step = hung._loop.step

    def hanging_step():
        release.wait()
        real_step()

    hung._loop.step = hanging_step
    return hung, healthy, release


def test_an_instance_without_progress_is_taken_out_and_its_requests_move():
    clock = FakeClock()
    stuck, healthy = SteppingFake("s0", "solver", capacity=1), SteppingFake("s1", "solver", capacity=1)
    router = RequestRouter({"solver": [stuck, healthy]}, **router_settings(max_retries=1), clock=clock)
    delivered = []
    futures = [router.submit("solver", RolloutRequest((k, 1), on_done=lambda r, k=k: delivered.append(k)),
                             label=f"q{k}") for k in range(3)]
    assert [len(f.held) for f in (stuck, healthy)] == [1, 1] and router.queue_length("solver") == 1
    assert router.check_progress(stall_s=5.0) == []  # the clock starts when an instance is first seen busy
    clock.now = 4.0
    healthy.tick()
    assert router.check_progress(stall_s=5.0) == []
    clock.now = 6.0  # s0: no step for 6 s while holding q0; s1 stepped at 4 s
    healthy.tick()
    assert router.check_progress(stall_s=5.0) == ["s0"]
    assert router.members()[0].state == BROKEN and router.members()[1].state == SERVING
    assert router.check_progress(stall_s=5.0) == []  # taken out once
    # q0 went back to the front of the queue: s1 serves q1, then q0, then q2.
    order = []
    while healthy.held:
        order.append(healthy.held[0].prompt_ids[0])
        healthy.complete(0)
    assert order == [1, 0, 2]
    stuck.complete(0)  # a late result from the stuck instance is ignored
    assert sorted(delivered) == [0, 1, 2] and len(delivered) == 3  # each request resolved exactly once
    assert all(f.done() and f.exception() is None for f in futures)
    assert router.stats["stuck"] == 1 and router.stats["completed"] == 3 and stuck.submitted == 1


def test_an_instance_compiling_its_first_step_gets_the_longer_first_step_limit():
    """A cold first step compiles the engine's programs; on the loaded host it outlasted instance_stall_s and took
    both instances of an agent out of a clean `faults` run. Until its first step ends an instance gets
    `first_step_s`; after that, `stall_s`."""
    clock = FakeClock()
    cold, warm = SteppingFake("s0", "solver", capacity=1), SteppingFake("s1", "solver", capacity=1)
    router = RequestRouter({"solver": [cold, warm]}, **router_settings(max_retries=1), clock=clock)
    monitor = InstanceHealthMonitor(router, stall_s=5.0, first_step_s=30.0)
    for k in range(2):
        router.submit("solver", RolloutRequest((k, 1)), label=f"q{k}")
    warm.tick()  # s1 finished a step; s0 is still in its first (compiling) step
    assert monitor.poll_once() == []  # the clocks start
    clock.now = 6.0
    assert monitor.poll_once() == ["s1"]  # 6 s without a step after its first one: stuck
    clock.now = 29.0
    assert monitor.poll_once() == []  # s0: 29 s into its first step, within first_step_s
    clock.now = 31.0
    assert monitor.poll_once() == ["s0"]  # past it: a first step that never ends is still caught
    with pytest.raises(ValueError, match=r"first_step_s=1.0 must be >= stall_s=5.0"):
        InstanceHealthMonitor(router, stall_s=5.0, first_step_s=1.0)


def test_an_idle_instance_whose_step_never_returns_is_taken_out_before_it_gets_a_request():
    """bench faults: an instance_hang in a step without requests (a weight swap) went unnoticed, so its thread held
    the run's exit for the backend's whole join timeout. A step running past the limit marks it stuck, idle or not."""
    clock = FakeClock()
    idle, busy = SteppingFake("s0", "solver"), SteppingFake("s1", "solver")
    for instance in (idle, busy):
        instance.progress = StepProgress(clock=clock)
        instance.tick()
    router = RequestRouter({"solver": [idle, busy]}, **router_settings(max_retries=1), clock=clock)
    idle.progress.begin()  # a step that never ends, holding no request
    clock.now = 4.0
    assert router.check_progress(stall_s=5.0) == []
    clock.now = 6.0
    assert router.check_progress(stall_s=5.0) == ["s0"] and router.members()[0].state == BROKEN
    router.submit("solver", RolloutRequest((1, 1)), label="q1")  # goes to s1: s0 is out of routing
    assert idle.submitted == 0 and busy.submitted == 1


def test_failover_retries_are_bounded_and_a_lone_agent_fails_loudly():
    clock = FakeClock()
    first, second = SteppingFake("s0", "solver", capacity=1), SteppingFake("s1", "solver", capacity=1)
    router = RequestRouter({"solver": [first, second]}, **router_settings(max_retries=0), clock=clock)
    future = router.submit("solver", RolloutRequest((0, 1)), label="query-3/solver")
    queued = [router.submit("solver", RolloutRequest((k, 1)), label=f"q{k}") for k in (1, 2)]
    router.check_progress(stall_s=1.0)
    clock.now = 2.0
    assert router.check_progress(stall_s=1.0) == ["s0", "s1"]
    with pytest.raises(RequestFailed, match=r"'query-3/solver' failed after 1 attempt\(s\): instance s0 finished no "
                                            r"engine step for 1 s"):
        future.result(timeout=0)
    # With no healthy instance left, the waiting request fails at once instead of waiting forever.
    assert all(isinstance(f.exception(timeout=0), RequestFailed) for f in queued)
    assert "no healthy instance left" in str(queued[-1].exception(timeout=0))
    assert router.pending() == 0


@pytest.mark.timeout(120)
def test_a_hung_step_blocks_neither_the_instance_nor_the_router_and_its_requests_fail_over(engine, tiny_model):
    hung, healthy, release = _hung_and_healthy(engine, tiny_model)
    router = RequestRouter({"solver": [hung, healthy]}, timeout_s=1.0, max_retries=2)
    prompt = tuple(tiny_model.tokenizer.encode("7*6="))
    first = router.submit("solver", RolloutRequest(prompt, num_samples=2, max_new_tokens=4), label="q0")
    assert hung.load().queued_requests == 1  # least loaded first: q0 is on the hung instance
    hung.start()
    healthy.start()
    try:
        deadline = time.monotonic() + 30
        while hung.progress.step_started_at is None:  # its first step has begun, and hangs
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # The instance's own API answers while its step hangs (before: each waited for the step's lock).
        assert _returns_within(hung.load, 1.0)[0]
        assert _returns_within(lambda: hung.cancel(RolloutRequest(prompt)), 2.0) == (True, False)
        # q0's timeout passes: the check that cancels it returns (a cancel waits at most cancel_wait_s), and
        # q0 is served by the healthy instance.
        time.sleep(1.1)
        assert _returns_within(router.check_timeouts, 5.0) == (True, 1)
        assert len(first.result(timeout=60)) == 2
        # Stuck-instance detection reads the step counter, not the lock: a request routed to the hung instance
        # (a fresh router: both instances idle in its eyes) moves to the healthy one.
        fresh = RequestRouter({"solver": [hung, healthy]}, **router_settings(max_retries=1))
        monitor = InstanceHealthMonitor(fresh, stall_s=0.5, poll_s=0.1)
        second = fresh.submit("solver", RolloutRequest(prompt, max_new_tokens=4), label="q1")
        assert fresh.inflight("hung") == 1
        started = time.monotonic()
        returned, _ = _returns_within(lambda: monitor.start() and second.result(timeout=60), 70)
        monitor.stop()
        assert returned and len(second.result(timeout=0)) == 1
        assert monitor.taken_out == ["hung"] and time.monotonic() - started < 30
        assert healthy.generated_tokens > 0 and hung.generated_tokens == 0 and hung.progress.steps == 0
    finally:
        release.set()
        hung.stop(timeout=10)
        healthy.stop(timeout=10)


@pytest.mark.timeout(120)
def test_closing_the_backend_does_not_wait_for_an_instance_taken_out_with_a_hung_step(engine, tiny_model):
    """bench faults: a run that recovered from instance_hang still exited only after the backend's 30 s join of
    the hung thread, past run.stall_timeout_s + 30 s from the fault. A taken-out instance is not waited for."""
    from flexmarl_jax.rollout.routed_backend import RoutedBackend

    hung, healthy, release = _hung_and_healthy(engine, tiny_model)
    router = RequestRouter({"solver": [hung, healthy]}, **router_settings(max_retries=1))
    backend = RoutedBackend(router, tiny_model.tokenizer,
                            services=[InstanceHealthMonitor(router, stall_s=0.5, first_step_s=0.5, poll_s=0.1)])
    try:
        prompt = tuple(tiny_model.tokenizer.encode("1+2="))
        future = router.submit("solver", RolloutRequest(prompt, max_new_tokens=4), label="q0")
        assert len(future.result(timeout=60)) == 1 and router.members()[0].state == BROKEN
        # The hung step still holds its thread; the healthy instance's thread is joined.
        assert _returns_within(backend.close, 10.0)[0]
        assert healthy._thread is None and not release.is_set()
    finally:
        release.set()
        hung.stop(timeout=10)


@pytest.fixture
def _disarmed():
    from flexmarl_jax import faults

    faults.disarm()
    yield faults
    faults.disarm()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["instance_crash", "instance_hang", "instance_slow"])
def test_injected_instance_faults_fail_over_or_slow_down(engine, tiny_model, _disarmed, fault):
    """The instance fault points: a crash or a hang on `bad` moves its requests to `good`; a slow `bad` keeps
    stepping, so it is not taken out, and still serves its share."""
    faults = _disarmed
    bad, good = EngineInstance(engine, tiny_model.params, name="bad"), EngineInstance(engine, tiny_model.params,
                                                                                      name="good")
    router = RequestRouter({"solver": [bad, good]}, **router_settings(max_retries=1))
    monitor = InstanceHealthMonitor(router, stall_s=1.0, poll_s=0.1)
    faults.arm(fault, where="bad", times=0 if fault == "instance_slow" else 1)
    prompt = tuple(tiny_model.tokenizer.encode("1+2="))
    for instance in (bad, good):
        instance.start()
    monitor.start()
    try:
        futures = [router.submit("solver", RolloutRequest(prompt, max_new_tokens=4), label=f"q{k}") for k in range(4)]
        done, _ = concurrent.futures.wait(futures, timeout=60)
        assert len(done) == 4 and all(len(f.result()) == 1 for f in futures)
        assert faults.fired(fault) >= 1
        if fault == "instance_slow":
            assert bad.generated_tokens > 0 and router.stats["stuck"] == 0 and router.stats["retries"] == 0
        else:
            assert router.members()[0].state == BROKEN and router.stats["retries"] >= 1
            assert bad.generated_tokens == 0 and good.generated_tokens > 0
    finally:
        monitor.stop()
        faults.disarm()
        for instance in (bad, good):
            instance.stop(timeout=10)
