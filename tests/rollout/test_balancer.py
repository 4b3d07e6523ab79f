"""InstanceBalancer: moves as many instances to the busiest agent as its queue gap, keeps every agent's minimum,
respects the cooldown, loses nothing, and a moved real engine serves with its new agent's weights."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexmarl_jax.metrics import INSTANCES, MIGRATION, QUEUE_LENGTH, Timeline
from flexmarl_jax.rollout.balancer import InstanceBalancer, PlannedMove
from flexmarl_jax.rollout.instance import EngineInstance
from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest
from flexmarl_jax.rollout.router import RequestRouter
from tests.settings_views import balancer_settings, router_settings

from .conftest import make_tiny_model, prompts_of_mixed_lengths
from .test_router import AGENTS, FakeClock, FakeInstance


def _fake_router(per_agent=(2, 2, 2), capacity=2, clock=None, **settings):
    """A router over fake instances; `settings` replace the default run's router settings."""
    fakes = {agent: [FakeInstance(f"{agent}{k}", agent, capacity=capacity) for k in range(n)]
             for agent, n in zip(AGENTS, per_agent, strict=True)}
    router = RequestRouter(fakes, **router_settings(**settings), clock=clock or FakeClock(),
                           initial_weights={a: (a, 0) for a in AGENTS})
    return router, [f for agent in AGENTS for f in fakes[agent]]


def _submit(router, agent, count, start=0):
    return [router.submit(agent, RolloutRequest((start + k, AGENTS.index(agent)))) for k in range(count)]


def test_moves_as_many_instances_as_the_gap_allows_keeping_every_minimum():
    router, fakes = _fake_router(per_agent=(3, 3, 3), capacity=1)
    timeline = Timeline()
    balancer = InstanceBalancer(router, **balancer_settings(delta=5, min_instances_per_agent=1, cooldown_s=0),
                                timeline=timeline)
    _submit(router, "solver", 3 + 17)  # 3 dispatched, 17 waiting: gap 17 > 5 -> up to 17 moves, 4 spare
    assert balancer.plan() == [PlannedMove("planner0", "planner", "solver"),
                               PlannedMove("planner1", "planner", "solver"),
                               PlannedMove("critic0", "critic", "solver"),
                               PlannedMove("critic1", "critic", "solver")]
    moves = balancer.poll_once()
    assert len(moves) == 4 and router.instance_counts() == {"planner": 1, "solver": 7, "critic": 1}
    assert router.queue_length("solver") == 13  # the four idle movers took one request each at once
    assert [f.weights_agent for f in fakes if f.name in ("planner0", "planner1", "critic0", "critic1")] == \
        ["solver"] * 4
    assert [(e.resource, e.attrs["from_agent"], e.agent) for e in timeline.events(MIGRATION)][0] == \
        ("rollout/planner0", "planner", "solver")
    assert timeline.gauge(INSTANCES)["solver"][1].tolist() == [3, 7]
    assert timeline.gauge(QUEUE_LENGTH)["solver"][1].tolist() == [0, 13]
    # gap 13 - 0 > 5 still, but planner and critic are at their minimum: nothing more moves
    assert balancer.poll_once() == [] and router.instance_counts() == {"planner": 1, "solver": 7, "critic": 1}


def test_a_gap_smaller_than_the_spare_instances_moves_that_many():
    router, _ = _fake_router(per_agent=(4, 2, 4), capacity=1)
    balancer = InstanceBalancer(router, **balancer_settings(delta=5, min_instances_per_agent=1, cooldown_s=0))
    _submit(router, "solver", 2 + 7)  # gap 7 > 5: seven moves wanted, six spare (3 + 3)
    assert len(balancer.plan()) == 6
    router2, _ = _fake_router(per_agent=(6, 2, 6), capacity=1)
    balancer2 = InstanceBalancer(router2, **balancer_settings(delta=5, min_instances_per_agent=1, cooldown_s=0))
    _submit(router2, "solver", 2 + 6)  # gap 6: six moves, though ten are spare
    assert len(balancer2.plan()) == 6


def test_no_move_within_delta_or_cooldown():
    clock = FakeClock()
    router, _ = _fake_router(per_agent=(2, 2, 2), capacity=1, clock=clock)
    balancer = InstanceBalancer(router, **balancer_settings(delta=5, cooldown_s=10.0))
    _submit(router, "solver", 2 + 5)  # gap 5: not more than delta
    assert balancer.poll_once() == []
    _submit(router, "solver", 1, start=100)  # gap 6 -> up to six moves: one spare each from planner and critic
    assert [m.instance for m in balancer.poll_once()] == ["planner0", "critic0"]
    # now critic is swamped; planner0 and critic0 just moved to solver (cooldown), solver1/solver0 are busy but
    # allowed
    _submit(router, "critic", 2 + 20, start=200)
    moves = balancer.poll_once()
    assert "planner0" not in [m.instance for m in moves] and all(m.to_agent == "critic" for m in moves)


def test_bad_balancer_config():
    router, _ = _fake_router(per_agent=(1, 1, 1))
    with pytest.raises(ValueError, match=r"delta=0 must be a positive integer"):
        InstanceBalancer(router, **balancer_settings(delta=0))
    with pytest.raises(ValueError, match=r"delta=2.5 must be a positive integer"):
        InstanceBalancer(router, **balancer_settings(delta=2.5))
    with pytest.raises(ValueError, match=r"min_instances_per_agent=2 x 3 agents = 6 instances, more than the 3"):
        InstanceBalancer(router, **balancer_settings(min_instances_per_agent=2))
    with pytest.raises(ValueError, match="cooldown_s=-1"):
        InstanceBalancer(router, **balancer_settings(cooldown_s=-1))
    router, _ = _fake_router(per_agent=(1, 3, 2))
    with pytest.raises(ValueError, match=r"agents that start with fewer: \{'planner': 1\}"):
        InstanceBalancer(router, **balancer_settings(min_instances_per_agent=2))


operation = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 2), st.integers(1, 12)),
    st.tuples(st.just("complete"), st.integers(0, 20), st.integers(0, 3)),
    st.tuples(st.just("tick"), st.floats(0.0, 2.0), st.just(0)),
    st.tuples(st.just("poll"), st.just(0), st.just(0)),
    st.tuples(st.just("sync"), st.integers(0, 2), st.just(0)),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(operation, min_size=1, max_size=60), per_agent=st.lists(st.integers(1, 3), min_size=3, max_size=3),
       delta=st.integers(1, 6), min_instances=st.integers(1, 2))
def test_balancing_loses_nothing_and_keeps_minimums(ops, per_agent, delta, min_instances):
    per_agent = [max(n, min_instances) for n in per_agent]
    clock = FakeClock()
    router, fakes = _fake_router(per_agent=per_agent, capacity=2, clock=clock, timeout_s=3.0, max_retries=1)
    cooldown = 1.5
    moved_at = collections.defaultdict(list)
    router.add_migration_listener(lambda inst, src, dst: moved_at[inst.name].append(clock.now))
    balancer = InstanceBalancer(router, **balancer_settings(delta=delta, cooldown_s=cooldown,
                                                            min_instances_per_agent=min_instances))
    futures = []
    for op, a, b in ops:
        if op == "submit":
            futures += [(AGENTS[a], f) for f in _submit(router, AGENTS[a], b, start=len(futures))]
        elif op == "complete":
            for _ in range(b + 1):
                busy = [f for f in fakes if f.held]
                if busy:
                    busy[a % len(busy)].complete(a)
        elif op == "tick":
            clock.now += a
            router.check_timeouts()
        elif op == "poll":
            balancer.poll_once()
        elif op == "sync":
            router.update_params(AGENTS[a], AGENTS[a], int(clock.now))
        assert all(n >= min_instances for n in router.instance_counts().values())
    for _ in range(10_000):
        busy = [f for f in fakes if f.held]
        if not busy:
            break
        busy[0].complete(0)
    assert router.pending() == 0
    for agent, future in futures:
        assert future.done()
        if future.exception() is None:
            assert AGENTS[future.result()[0].token_ids[0]] == agent
    assert all(not f.violations for f in fakes), [f.violations for f in fakes]
    assert router.stats["completed"] + router.stats["failed"] == len(futures)
    for times in moved_at.values():
        assert all(later - earlier >= cooldown for earlier, later in zip(times, times[1:], strict=False))


@pytest.mark.timeout(90)
def test_migrated_instance_generates_with_new_agents_weights(engine, tiny_model):
    other = make_tiny_model(seed=1)  # the critic: same architecture, other weights
    solver_params, critic_params = tiny_model.params, other.params
    from flexmarl_jax.orchestrator.rollout_setup import TimedInstance

    timeline = Timeline()
    instances = {"solver": [EngineInstance(engine, solver_params, policy_version=7, name="solver0")],
                 "critic": [TimedInstance(engine, critic_params, name="critic0").attach(timeline, "critic"),
                            EngineInstance(engine, critic_params, name="critic1")]}
    router = RequestRouter(instances, **router_settings(),
                           initial_weights={"solver": (solver_params, 7), "critic": (critic_params, 0)})
    balancer = InstanceBalancer(router, **balancer_settings(delta=5), timeline=timeline)
    prompts = prompts_of_mixed_lengths(tiny_model.tokenizer, 16, seed=5)
    futures = [router.submit("solver", RolloutRequest(p, max_new_tokens=6)) for p in prompts]
    assert router.queue_length("solver") == 8  # solver0's 8 slots are full
    assert [(m.instance, m.to_agent) for m in balancer.poll_once()] == [("critic0", "solver")]
    assert router.queue_length("solver") == 0
    everything = [i for group in instances.values() for i in group]
    while any(i.has_work() for i in everything):
        for instance in everything:
            instance.step()
    moved = instances["critic"][0]
    assert moved.generated_tokens > 0 and moved.policy_version == 7 and instances["critic"][1].generated_tokens == 0
    results = [f.result(timeout=0)[0] for f in futures]
    own = RolloutLoop(engine, solver_params, policy_version=7).generate([RolloutRequest(p, max_new_tokens=6)
                                                                         for p in prompts])
    critics = RolloutLoop(engine, critic_params).generate([RolloutRequest(p, max_new_tokens=6) for p in prompts])
    for result, reference, critic in zip(results, own, critics, strict=True):
        assert result.token_ids == reference[0].token_ids and result.policy_version == 7
        np.testing.assert_allclose(result.logprobs, reference[0].logprobs, atol=1e-4)
        assert result.logprobs != critic[0].logprobs  # the critic's weights would have scored otherwise
    events = timeline.events(MIGRATION)
    assert [(e.resource, e.attrs["from_agent"], e.agent) for e in events] == [("rollout/critic0", "critic", "solver")]
    # the move paid its weight load: on the moved instance's timeline row, and in the router's move time
    loads = [i for i in timeline.intervals("rollout/critic0") if i.kind == "load"]
    assert len(loads) == 1 and loads[0].end <= events[0].time + 1e-6
    assert router.stats["migrations"] == 1 and router.stats["migration_s"] >= loads[0].end - loads[0].start
