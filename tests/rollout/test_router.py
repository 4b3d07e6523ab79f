"""RequestRouter: least-loaded dispatch, exactly-once resolution under completions, timeouts and migrations,
and the RoutedBackend over real engine instances."""

from __future__ import annotations

import collections
import concurrent.futures

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexmarl_jax.rollout.instance import EngineInstance
from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest, SequenceResult
from flexmarl_jax.rollout.routed_backend import RoutedBackend
from flexmarl_jax.rollout.router import SERVING, RequestFailed, RequestRouter
from flexmarl_jax.workflows.generation import GenerationBackend, GenerationRequest, SamplingParams
from tests.settings_views import router_settings

AGENTS = ("planner", "solver", "critic")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeInstance:
    """The interface the router routes to (protocols.RoutableInstance). It 'generates' by echoing the prompt and
    answering with the agent whose weights it holds, so a result shows which weights served it."""

    def __init__(self, name: str, agent: str, capacity: int = 2, architecture: str = "tiny", can_cancel=False):
        self.name, self.capacity, self.architecture = name, capacity, architecture
        self.can_cancel = can_cancel
        self.weights_agent, self.version = agent, 0
        self.held: list[RolloutRequest] = []
        self.violations: list[str] = []
        self.submitted = 0

    def check_request(self, request: RolloutRequest) -> None:
        pass  # any prompt will do

    def submit(self, request: RolloutRequest) -> None:
        request_agent = AGENTS[request.prompt_ids[1]]
        if request_agent != self.weights_agent:
            self.violations.append(f"{self.name} got a {request_agent} request holding {self.weights_agent} weights")
        if sum(r.num_samples for r in self.held) + request.num_samples > self.capacity and self.held:
            self.violations.append(f"{self.name} over capacity")
        self.held.append(request)
        self.submitted += 1

    def update_params(self, params, version) -> None:
        if self.held and params != self.weights_agent:  # a sync of its own agent may land any time
            self.violations.append(f"{self.name} got {params} weights with {len(self.held)} requests in flight")
        self.weights_agent, self.version = params, version

    def wait_for_weights(self) -> None:
        pass  # its weights are a name: nothing to transfer

    def cancel(self, request) -> bool:
        if not self.can_cancel:
            return False
        self.held.remove(request)
        return True

    def complete(self, index: int) -> None:
        request = self.held.pop(index % len(self.held))
        results = [SequenceResult(request.prompt_ids, (AGENTS.index(self.weights_agent),), (-0.5,), "length",
                                  self.version, k) for k in range(request.num_samples)]
        request.on_done(results)


operation = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 2), st.integers(1, 2)),
    st.tuples(st.just("complete"), st.integers(0, 7), st.integers(0, 7)),
    st.tuples(st.just("tick"), st.floats(0.0, 3.0), st.just(0)),
    st.tuples(st.just("migrate"), st.integers(0, 7), st.integers(0, 2)),
    st.tuples(st.just("sync"), st.integers(0, 2), st.just(0)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(operation, min_size=1, max_size=80), max_retries=st.integers(0, 2),
       can_cancel=st.booleans(), capacities=st.lists(st.integers(1, 3), min_size=6, max_size=6))
def test_no_request_lost_or_duplicated(ops, max_retries, can_cancel, capacities):
    clock = FakeClock()
    fakes = [FakeInstance(f"i{k}", AGENTS[k % 3], capacity=capacities[k], can_cancel=can_cancel) for k in range(6)]
    instances = {agent: [f for f in fakes if f.weights_agent == agent] for agent in AGENTS}
    router = RequestRouter(instances, timeout_s=2.0, max_retries=max_retries, clock=clock,
                           initial_weights={agent: (agent, 0) for agent in AGENTS})
    futures, deliveries = {}, collections.Counter()
    for op, a, b in ops:
        if op == "submit":
            number = len(futures)
            request = RolloutRequest((number, a), num_samples=b, max_new_tokens=4,
                                     on_done=lambda r, n=number: deliveries.update([n]),
                                     on_error=lambda e, n=number: deliveries.update([n]))
            futures[number] = (AGENTS[a], b, router.submit(AGENTS[a], request, label=f"req-{number}"))
        elif op == "complete":
            busy = [f for f in fakes if f.held]
            if busy:
                busy[a % len(busy)].complete(b)
        elif op == "tick":
            clock.now += a
            router.check_timeouts()
        elif op == "migrate":
            try:
                router.migrate(fakes[a % 6].name, AGENTS[b])
            except ValueError:
                pass  # already there / moving / would leave its agent empty
        elif op == "sync":
            router.update_params(AGENTS[a], AGENTS[a], clock.now)
        counts = router.instance_counts()
        assert all(counts[agent] >= 1 for agent in AGENTS), counts
        assert sum(counts.values()) == 6
    # Drain with the clock frozen: every held request finishes, every queue empties.
    for _ in range(10_000):
        busy = [f for f in fakes if f.held]
        if not busy:
            break
        busy[0].complete(0)
    assert not any(f.held for f in fakes)
    assert router.pending() == 0 and sum(router.queue_lengths().values()) == 0
    for number, (agent, samples, future) in futures.items():
        assert future.done(), f"req-{number} never resolved"
        error = future.exception()
        if error is None:
            results = future.result()
            assert [r.sample_index for r in results] == list(range(samples))
            assert all(r.prompt_ids == (number, AGENTS.index(agent)) for r in results)  # its own results
            assert all(AGENTS[r.token_ids[0]] == agent for r in results)  # served with its agent's weights
        else:
            assert isinstance(error, RequestFailed) and f"'req-{number}'" in str(error)
            assert error.attempts == max_retries + 1
    assert deliveries == collections.Counter(list(futures))  # each request's own callback exactly once
    assert all(not f.violations for f in fakes), [f.violations for f in fakes]
    stats = router.stats
    assert stats["completed"] + stats["failed"] == len(futures)


def test_least_loaded_dispatch_and_admission():
    fakes = [FakeInstance(f"s{k}", "solver", capacity=2) for k in range(3)]
    router = RequestRouter({"solver": fakes}, **router_settings())
    futures = [router.submit("solver", RolloutRequest((k, 1), max_new_tokens=10 if k == 0 else 4)) for k in range(7)]
    # 3 instances x 2 slots: 6 dispatched, one waits in the router's queue.
    assert [len(f.held) for f in fakes] == [2, 2, 2] and router.queue_length("solver") == 1
    # the first request (10 tokens) made s0 the heaviest: it got one short request, the others two
    assert sorted(r.max_new_tokens for r in fakes[0].held) == [4, 10]
    fakes[1].complete(0)  # s1 frees a slot -> the waiting request goes there
    assert router.queue_length("solver") == 0 and len(fakes[1].held) == 2
    while any(f.held for f in fakes):
        next(f for f in fakes if f.held).complete(0)
    assert all(f.done() and not f.exception() for f in futures)


def test_timeouts_requeue_then_fail_naming_the_request():
    clock = FakeClock()
    fakes = [FakeInstance("s0", "solver", capacity=1), FakeInstance("s1", "solver", capacity=1)]
    router = RequestRouter({"solver": fakes}, timeout_s=5.0, max_retries=1, clock=clock)
    future = router.submit("solver", RolloutRequest((0, 1)), label="query-7/solver")
    assert [len(f.held) for f in fakes] == [1, 0]
    clock.now = 5.1
    assert router.check_timeouts() == 1  # re-queued: s0 cannot cancel, so it keeps the zombie and s1 gets it
    assert [len(f.held) for f in fakes] == [1, 1] and not future.done()
    fakes[0].complete(0)  # the late result of the cancelled attempt is ignored
    assert not future.done()
    clock.now = 10.5
    router.check_timeouts()
    with pytest.raises(RequestFailed, match=r"'query-7/solver' failed after 2 attempt\(s\): timed out"):
        future.result(timeout=0)
    assert router.stats["timeouts"] == 2 and router.stats["failed"] == 1


def test_migration_waits_for_drain_and_loads_receiver_weights():
    solver = [FakeInstance("s0", "solver"), FakeInstance("s1", "solver")]
    critic = [FakeInstance("c0", "critic")]
    moved = []
    router = RequestRouter({"solver": solver, "critic": critic}, **router_settings(),
                           initial_weights={"critic": ("critic", 3)},
                           on_migrated=lambda inst, src, dst: moved.append((inst.name, src, dst)))
    router.submit("solver", RolloutRequest((0, 1)))
    router.submit("solver", RolloutRequest((1, 1)))
    holder = next(f for f in solver if f.held)
    router.migrate(holder.name, "critic")
    assert router.num_instances("critic") == 2 and moved == []  # still draining its solver request
    assert holder.weights_agent == "solver"
    router.update_params("critic", "critic", 4)  # a sync while it drains must reach it too
    holder.complete(0)
    assert moved == [(holder.name, "solver", "critic")] and (holder.weights_agent, holder.version) == ("critic", 4)
    assert router.members()[[m.name for m in router.members()].index(holder.name)].state == SERVING
    with pytest.raises(ValueError, match="would leave 'solver' with 0 instance"):
        router.migrate(next(f for f in solver if f is not holder).name, "critic")
    assert all(not f.violations for f in solver + critic)


def test_migration_across_architectures_is_refused():
    router = RequestRouter({"solver": [FakeInstance("s0", "solver"), FakeInstance("s1", "solver", architecture="7b")],
                            "critic": [FakeInstance("c0", "critic")]}, **router_settings(),
                           initial_weights={"critic": ("critic", 0)})
    with pytest.raises(ValueError, match="cannot move instance 's1' from 'solver' to 'critic': its model architecture"):
        router.migrate("s1", "critic")


def test_bad_router_arguments():
    with pytest.raises(ValueError, match="timeout_s=0"):
        RequestRouter({"solver": [FakeInstance("s0", "solver")]}, **router_settings(timeout_s=0))
    with pytest.raises(ValueError, match="max_retries=-1"):
        RequestRouter({"solver": [FakeInstance("s0", "solver")]}, **router_settings(max_retries=-1))
    with pytest.raises(ValueError, match="no engine instance"):
        RequestRouter({"solver": []}, **router_settings())
    with pytest.raises(ValueError, match="'s0' is used twice"):
        RequestRouter({"solver": [FakeInstance("s0", "solver")], "critic": [FakeInstance("s0", "critic")]},
                      **router_settings())
    router = RequestRouter({"solver": [FakeInstance("s0", "solver"), FakeInstance("s1", "solver")],
                            "critic": [FakeInstance("c0", "critic")]}, **router_settings())
    with pytest.raises(ValueError, match="unknown agent 'judge'"):
        router.submit("judge", RolloutRequest((0, 1)))
    with pytest.raises(ValueError, match="no weights known for agent 'critic'"):
        router.migrate("s0", "critic")


@pytest.mark.timeout(90)
def test_routed_backend_on_real_engines(engine, tiny_model):
    tokenizer = tiny_model.tokenizer
    instances = {"solver": [EngineInstance(engine, tiny_model.params, name="s0"),
                            EngineInstance(engine, tiny_model.params, name="s1")],
                 "verifier": [EngineInstance(engine, tiny_model.params, policy_version=3, name="v0")]}
    router = RequestRouter(instances, **router_settings(timeout_s=60.0))
    with RoutedBackend(router, tokenizer) as backend:
        assert isinstance(backend, GenerationBackend)
        futures = [backend.submit(GenerationRequest(f"q{k}", "solver", f"{k}*{k}=", 3, SamplingParams(seed=k,
                                                                                                      max_new_tokens=6)))
                   for k in range(8)]
        checked = backend.submit(GenerationRequest("v", "verifier", "ok?", 2, SamplingParams(max_new_tokens=5)))
        concurrent.futures.wait(futures + [checked], timeout=80)
        with pytest.raises(ValueError, match="more than rollout.max_prompt_length=32"):
            backend.submit(GenerationRequest("long", "solver", "x" * 40, 1, SamplingParams()))
    assert all(len(f.result()) == 3 for f in futures)
    assert all(c.policy_version == 3 for c in checked.result())
    assert all(np.all(np.asarray(c.logprobs) <= 0) and len(c.logprobs) == len(c.token_ids)
               for f in futures for c in f.result())
    assert all(i.generated_tokens > 0 for i in instances["solver"])  # 8 x 3 samples > one instance's 8 slots
    assert router.stats["completed"] == 9 and router.pending() == 0


@pytest.mark.timeout(60)
def test_timeout_cancels_on_a_real_instance_and_retries_elsewhere(engine, tiny_model):
    clock = FakeClock()
    stuck, healthy = EngineInstance(engine, tiny_model.params, name="stuck"), \
        EngineInstance(engine, tiny_model.params, name="healthy")
    router = RequestRouter({"solver": [stuck, healthy]}, timeout_s=1.0, max_retries=1, clock=clock)
    prompt = tuple(tiny_model.tokenizer.encode("7*6="))
    future = router.submit("solver", RolloutRequest(prompt, num_samples=2, max_new_tokens=5), label="q42")
    assert stuck.load().queued_requests == 1 and healthy.load().queued_requests == 0
    stuck.step()  # it starts decoding, then "hangs" (nobody steps it again)
    clock.now = 1.5
    assert router.check_timeouts() == 1
    assert stuck.load().active_slots == 0 and router.inflight("stuck") == 0  # cancelled: its slots are free
    healthy.run_until_idle()
    stuck.run_until_idle()
    results = future.result(timeout=0)
    reference = RolloutLoop(engine, tiny_model.params).generate([RolloutRequest(prompt, num_samples=2,
                                                                                max_new_tokens=5)])[0]
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]  # same seeds, same samples
    assert router.stats["timeouts"] == 1 and router.stats["retries"] == 1 and router.stats["completed"] == 1


class SharedFake(FakeInstance):
    """One instance serving several agents at once (a LoRA base group's engine): any of its agents' requests, one
    capacity for all of them, and a per-agent weight sync."""

    def __init__(self, name: str, agents: tuple[str, ...], capacity: int):
        super().__init__(name, agents[0], capacity=capacity, architecture=("tiny", agents))
        self.agents, self.synced = agents, []

    def submit(self, request: RolloutRequest) -> None:
        if AGENTS[request.prompt_ids[1]] not in self.agents:
            self.violations.append(f"{self.name} got a request of an agent it does not serve")
        if sum(r.num_samples for r in self.held) + request.num_samples > self.capacity and self.held:
            self.violations.append(f"{self.name} over capacity")
        self.held.append(request)

    def update_params(self, params, version) -> None:
        self.violations.append("a shared instance synced without naming the agent")

    def update_agent_params(self, agent, params, version) -> None:
        self.synced.append((agent, params, version))


def test_an_instance_shared_by_two_agents_takes_both_within_one_capacity_and_never_moves():
    shared = SharedFake("group", ("planner", "solver"), capacity=3)
    critic = FakeInstance("c", "critic")
    router = RequestRouter({"planner": [shared], "solver": [shared], "critic": [critic]}, timeout_s=None,
                           max_retries=1, initial_weights={agent: (agent, 0) for agent in AGENTS})
    assert router.instances_of("planner") == router.instances_of("solver") == [shared]
    futures = [router.submit(AGENTS[agent], RolloutRequest((n, agent), num_samples=1, max_new_tokens=4))
               for n, agent in enumerate([0, 1, 0, 1, 1])]
    assert len(shared.held) == 3 and router.queue_lengths() == {"planner": 0, "solver": 2, "critic": 0}
    shared.complete(0)  # a planner request ends: its slot goes to a solver request
    assert len(shared.held) == 3 and sum(router.queue_lengths().values()) == 1
    while shared.held:
        shared.complete(0)
    assert all(future.done() for future in futures) and not shared.violations
    router.update_params("solver", "solver-v1", 1)
    assert shared.synced == [("solver", "solver-v1", 1)]
    with pytest.raises(ValueError, match=r"serves \['planner', 'solver'\] at once .* does not move"):
        router.migrate("group", "critic")
