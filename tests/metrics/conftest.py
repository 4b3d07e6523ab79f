"""Synthetic but realistic run data (skewed agents, migrations, version updates) for metrics tests."""

from __future__ import annotations

import numpy as np
import pytest

from flexmarl_jax import metrics

AGENTS = ("planner", "solver", "verifier")


def make_synthetic_timeline(seed: int = 0, iterations: int = 4) -> metrics.Timeline:
    """Four rollout instances, two train slices; solver gets ~75% of requests and gains instances."""
    rng = np.random.default_rng(seed)
    timeline = metrics.Timeline()
    instances = [f"rollout/instance{index}" for index in range(4)]
    timeline.declare(*instances, "train/slice0", "train/slice1")
    serving = {
        instances[0]: "solver",
        instances[1]: "solver",
        instances[2]: "planner",
        instances[3]: "verifier",
    }
    share = {"planner": 0.15, "solver": 0.75, "verifier": 0.10}
    queue = {agent: 0 for agent in AGENTS}
    clock = 0.0
    for iteration in range(iterations):
        iteration_end = clock + 20.0
        _sample_instances(timeline, serving, clock)
        for resource in instances:
            cursor = clock + rng.uniform(0, 0.5)
            while cursor < iteration_end - 1.0:
                agent = serving[resource]
                prefill = rng.uniform(0.05, 0.2)
                decode = rng.uniform(0.3, 1.5) * (2.0 if agent == "solver" else 1.0)
                timeline.add_interval(resource, cursor, cursor + prefill, "prefill", agent)
                timeline.add_interval(resource, cursor + prefill, cursor + prefill + decode, "decode", agent)
                cursor += prefill + decode + rng.exponential(0.3 if agent == "solver" else 1.5)
        for step in np.arange(clock, iteration_end, 0.5):
            for agent in AGENTS:
                arrivals = rng.poisson(6 * share[agent])
                timeline.increment(metrics.REQUESTS, agent, arrivals, time=step)
                timeline.increment(metrics.GENERATED_TOKENS, agent, arrivals * 64, time=step)
                served = sum(a == agent for a in serving.values()) * 1.2
                queue[agent] = max(0, queue[agent] + arrivals - int(rng.poisson(served)))
                timeline.sample(metrics.QUEUE_LENGTH, agent, queue[agent], time=step)
        if iteration == 1:  # the balancer lends the verifier's instance to solver, then returns it
            timeline.record_migration(instances[3], "verifier", "solver", time=clock + 2.0)
            serving[instances[3]] = "solver"
            _sample_instances(timeline, serving, clock + 2.0)
        if iteration == 2:
            timeline.record_migration(instances[3], "solver", "verifier", time=clock + 1.0)
            serving[instances[3]] = "verifier"
            _sample_instances(timeline, serving, clock + 1.0)
        for slice_index, agents in enumerate((("solver",), ("planner", "verifier"))):
            cursor = clock + 4.0 + slice_index
            for agent in agents * 2:
                duration = rng.uniform(1.5, 3.0)
                timeline.add_interval(f"train/slice{slice_index}", cursor, cursor + duration, "train", agent)
                cursor += duration + rng.uniform(0.5, 2.0)
            timeline.add_interval(
                f"train/slice{slice_index}", iteration_end - 0.8, iteration_end - 0.5, "sync"
            )
        for agent in AGENTS:
            timeline.record_policy_version(agent, iteration + 1, time=iteration_end - 0.5)
        clock = iteration_end
    return timeline


def _sample_instances(timeline: metrics.Timeline, serving: dict[str, str], time: float) -> None:
    for agent in AGENTS:
        timeline.sample(metrics.INSTANCES, agent, sum(a == agent for a in serving.values()), time=time)


def make_synthetic_records(iterations: int = 12, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    records = []
    for iteration in range(iterations):
        progress = iteration / max(iterations - 1, 1)
        per_agent = {
            agent: {
                "reward": np.float32(0.2 + 0.5 * progress * (index + 1) / 3 + rng.normal(0, 0.03)),
                "accuracy": np.float64(0.1 + 0.6 * progress * (index + 2) / 4 + rng.normal(0, 0.02)),
                "kl": np.float32(0.001 * iteration * (index + 1)),
                "clip_frac": np.float32(rng.uniform(0.0, 0.2)),
                "entropy": np.float32(2.0 - 0.08 * iteration),
            }
            for index, agent in enumerate(AGENTS)
        }
        rollout_s, train_s, sync_s, other_s = (
            float(x) for x in rng.uniform([8, 3, 0.5, 0.2], [12, 5, 1.0, 0.6])
        )
        records.append(
            {
                "iteration": iteration,
                "team_accuracy": np.float32(0.15 + 0.5 * progress),
                "team_reward": np.float32(0.3 + 0.4 * progress),
                "e2e_s": rollout_s + train_s + sync_s + other_s,
                "rollout_s": rollout_s,
                "train_s": train_s,
                "sync_s": sync_s,
                "other_s": other_s,
                "tokens_per_s": np.float64(800 + 20 * iteration),
                "utilization": {
                    "rollout": 0.6,
                    "train": 0.3,
                    "all": 0.5,
                    "resources": {"rollout/instance0": 0.7},
                },
                "agent": per_agent,
            }
        )
    return records


@pytest.fixture
def synthetic_timeline() -> metrics.Timeline:
    return make_synthetic_timeline()


@pytest.fixture
def synthetic_records() -> list[dict]:
    return make_synthetic_records()
