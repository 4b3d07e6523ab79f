"""StoreSink: complete groups reach the store a micro-batch at a time, all of them on flush."""

import threading
import time

import numpy as np
import pytest

from flexmarl_jax.orchestrator.sink import StoreSink
from flexmarl_jax.store import ExperienceStore
from flexmarl_jax.workflows.records import CallRecord

pytestmark = pytest.mark.timeout(30)


class CountingStore:
    """The real memory store, counting appends per agent."""

    def __init__(self):
        self.store = ExperienceStore.open(None, agents=["solver", "verifier"])
        self.appends: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def append_rows(self, agent, **kwargs):
        with self.lock:
            self.appends.append((agent, len(kwargs["input_ids"])))
        return self.store.append_rows(agent, **kwargs)


def add_group(sink, agent, query, size, *, turn=0, upstream=None):
    records = [CallRecord(sample_id=f"{query}_{turn}_{j}", input_id=query, turn=turn, trajectory_id=j, agent=agent,
                          node=agent, group_id=f"{query}_{turn}", prompt="p", prompt_token_ids=(1, 2), text="t",
                          token_ids=(3, 4, 5), logprobs=(-0.1, -0.2, -0.3), finish_reason="stop",
                          policy_version=0, upstream_policy_versions=dict(upstream or {})) for j in range(size)]
    sink.add_calls(records)
    sink.close_group(agent, f"{query}_{turn}", size)
    sink.set_rewards(agent, [r.sample_id for r in records], [float(j) for j in range(size)])


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_an_agent_is_written_once_it_has_a_micro_batch_of_rows_and_everything_on_flush():
    counting = CountingStore()
    sink = StoreSink(counting, lambda r: r - r.mean(), rows_per_write=8, max_delay_s=60.0)
    add_group(sink, "solver", "q0", 4)
    add_group(sink, "verifier", "v0", 4)
    time.sleep(0.2)
    assert counting.appends == []  # 4 rows each: below the micro-batch
    add_group(sink, "solver", "q1", 4)
    assert wait_for(lambda: counting.appends == [("solver", 8)])
    time.sleep(0.1)
    assert counting.appends == [("solver", 8)]  # the verifier's 4 rows still wait
    sink.flush()
    assert counting.appends == [("solver", 8), ("verifier", 4)]
    sink.close()
    assert sink.unfinished() == {}
    solver = counting.store.read_rows("solver", columns=["reward", "advantage"])
    np.testing.assert_allclose(solver["advantage"], solver["reward"] - 1.5)  # per-group: rewards 0..3
    assert counting.store.counters("verifier")["ready"] == 4


def test_rows_below_a_micro_batch_are_written_after_max_delay():
    counting = CountingStore()
    sink = StoreSink(counting, lambda r: r, rows_per_write=64, max_delay_s=0.1)
    started = time.monotonic()
    add_group(sink, "solver", "q0", 2)
    assert wait_for(lambda: counting.appends == [("solver", 2)])
    assert time.monotonic() - started >= 0.1
    sink.close()


def test_held_groups_wait_for_release_whatever_their_size():
    counting = CountingStore()
    sink = StoreSink(counting, lambda r: r, hold=True, rows_per_write=2, max_delay_s=0.0)
    add_group(sink, "solver", "q0", 4)
    time.sleep(0.1)
    assert counting.appends == []
    sink.release_held()
    assert counting.appends == [("solver", 4)]
    sink.close()


def test_groups_of_one_agent_with_different_dependencies_share_a_write():
    """A debater's first round depends only on itself, its second round on every debater: both groups are
    complete at once and go out in one write, yet no row gets a version for an agent it does not depend on
    (the store refuses negative versions, which is how `debate` used to fail in its first iteration)."""
    counting = CountingStore()
    sink = StoreSink(counting, lambda r: r - r.mean(), rows_per_write=64, max_delay_s=60.0)
    add_group(sink, "solver", "q0", 4, turn=0)
    add_group(sink, "solver", "q0", 4, turn=1, upstream={"solver": 0, "verifier": 0})
    sink.flush()
    rows = counting.store.read_rows("solver")
    by_id = dict(zip(rows["sample_id"], np.asarray(rows["policy_versions"]["verifier"]), strict=True))
    assert sorted(by_id) == [f"q0_{turn}_{j}" for turn in (0, 1) for j in range(4)]
    assert [by_id[f"q0_0_{j}"] for j in range(4)] == [-1] * 4  # round 0: no verifier dependency
    assert [by_id[f"q0_1_{j}"] for j in range(4)] == [0] * 4
    sink.close()
