"""Timeline: union-of-intervals utilization, pooled groups, busy() context, threads, JSON round trip."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexmarl_jax import metrics
from flexmarl_jax.metrics.utilization import union_length


class FakeClock:
    def __init__(self, start: float = 100.0):
        self.value = start

    def __call__(self) -> float:
        return self.value


def test_utilization_merges_overlaps_and_counts_gaps():
    timeline = metrics.Timeline()
    for start, end in [(0, 2), (1, 3), (5, 6), (5.5, 5.75)]:
        timeline.add_interval("rollout/instance0", start, end, "decode", "solver")
    # union = [0, 3] + [5, 6] = 4 s of a 10 s window
    assert timeline.busy_seconds("rollout/instance0", 0, 10) == pytest.approx(4.0)
    assert timeline.utilization("rollout/instance0", 0, 10) == pytest.approx(0.4)
    # clipped to [1.5, 5.5]: [1.5, 3] + [5, 5.5] = 2 s of 4 s
    assert timeline.utilization("rollout/instance0", 1.5, 5.5) == pytest.approx(0.5)
    # default window is [0, last recorded time] = [0, 6]
    assert timeline.utilization("rollout/instance0") == pytest.approx(4 / 6)


def test_pooled_group_utilization_counts_declared_idle_resources():
    timeline = metrics.Timeline()
    timeline.declare("rollout/a", "rollout/b", "rollout/idle", "train/slice0")
    timeline.add_interval("rollout/a", 0, 5, "decode", "solver")
    timeline.add_interval("rollout/b", 0, 1, "prefill", "planner")
    timeline.add_interval("rollout/b", 0.5, 1, "decode", "planner")  # overlaps the prefill: counts once
    timeline.add_interval("train/slice0", 2, 4, "train", "solver")
    assert timeline.group_utilization("rollout", 0, 10) == pytest.approx((0.5 + 0.1 + 0.0) / 3)
    assert timeline.group_utilization("train", 0, 10) == pytest.approx(0.2)
    assert timeline.group_utilization("nonexistent", 0, 10) == 0.0
    report = timeline.utilization_report(0, 10)
    assert report["rollout"] == pytest.approx(0.2)
    assert report["train"] == pytest.approx(0.2)
    assert report["all"] == pytest.approx((0.5 + 0.1 + 0.0 + 0.2) / 4)
    assert report["resources"] == pytest.approx(
        {"rollout/a": 0.5, "rollout/b": 0.1, "rollout/idle": 0.0, "train/slice0": 0.2}
    )
    assert timeline.groups() == ["rollout", "train"]


def test_time_split_charges_each_instant_once_and_sums_to_the_window():
    serial = metrics.Timeline()
    serial.add_interval("rollout/instance0", 0, 6, "decode", "solver")
    serial.add_interval("train/slice0", 6, 9, "train", "solver")
    serial.add_interval("train/slice0", 9, 9.5, "sync", "solver")
    assert serial.time_split(0, 10) == pytest.approx(
        {"sync_s": 0.5, "rollout_s": 6.0, "train_s": 3.0, "other_s": 0.5}
    )
    # Pipelined: training overlaps rollout; only its exposed tail (8..10) counts as train_s.
    pipelined = metrics.Timeline()
    pipelined.add_interval("rollout/instance0", 0, 5, "decode", "solver")
    pipelined.add_interval("rollout/instance1", 3, 8, "decode", "planner")
    pipelined.add_interval("train/slice0", 2, 10, "train", "solver")
    pipelined.add_interval("train/slice0", 10, 11, "sync")
    split = pipelined.time_split(0, 12)
    assert split == pytest.approx({"sync_s": 1.0, "rollout_s": 8.0, "train_s": 2.0, "other_s": 1.0})
    assert sum(split.values()) == pytest.approx(12.0)
    custom = pipelined.time_split(0, 12, {"train_s": lambda i: i.group == "train"})
    assert custom == pytest.approx({"train_s": 9.0, "other_s": 3.0})

    pipelined.increment(metrics.GENERATED_TOKENS, "solver", 600, time=1.0)
    pipelined.increment(metrics.GENERATED_TOKENS, "planner", 300, time=7.0)
    pipelined.increment(metrics.GENERATED_TOKENS, "planner", 999, time=13.0)  # outside the window
    assert pipelined.counter_rate(metrics.GENERATED_TOKENS, 0, 12) == pytest.approx(900 / 12)
    assert pipelined.counter_rate(metrics.GENERATED_TOKENS, 0, 12, key="planner") == pytest.approx(300 / 12)


@settings(max_examples=150, deadline=None)
@given(
    spans=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 15)), max_size=12),
    window=st.tuples(st.integers(0, 30), st.integers(1, 30)),
)
def test_union_length_matches_unit_cell_count(spans, window):
    """Integer intervals: the union length equals the number of unit cells [k, k+1) covered in the window."""
    intervals = [(start, start + length) for start, length in spans]
    t0, t1 = window[0], window[0] + window[1]
    covered = {cell for start, end in intervals for cell in range(max(start, t0), min(end, t1))}
    assert union_length(intervals, t0, t1) == pytest.approx(len(covered))

    timeline = metrics.Timeline()
    timeline.declare("train/x")
    for start, end in intervals:
        timeline.add_interval("train/x", start, end, "train")
    utilization = timeline.utilization("train/x", t0, t1)
    assert 0.0 <= utilization <= 1.0
    assert utilization == pytest.approx(len(covered) / (t1 - t0))


def test_busy_context_records_interval_with_labels_even_on_error():
    clock = FakeClock()
    timeline = metrics.Timeline(clock=clock)
    clock.value += 1.0
    with timeline.busy("train/slice1", "train", agent="solver"):
        clock.value += 2.5
        # While the block is open the interval already counts (up to now).
        assert timeline.busy_seconds("train/slice1", 0, 10) == pytest.approx(2.5)
        assert timeline.intervals("train/slice1") == []
    with pytest.raises(RuntimeError):
        with timeline.busy("train/slice1", "sync"):
            clock.value += 0.5
            raise RuntimeError("boom")
    intervals = timeline.intervals("train/slice1")
    assert [(i.start, i.end, i.kind, i.agent) for i in intervals] == [
        (1.0, 3.5, "train", "solver"),
        (3.5, 4.0, "sync", None),
    ]
    assert intervals[0].duration == pytest.approx(2.5)
    assert intervals[0].group == "train"


@pytest.mark.timeout(60)
def test_concurrent_recording_from_many_threads_loses_nothing():
    timeline = metrics.Timeline()
    threads_count, per_thread = 8, 300
    barrier = threading.Barrier(threads_count)

    def work(index: int) -> None:
        barrier.wait()
        for step in range(per_thread):
            with timeline.busy(f"rollout/instance{index % 4}", "decode", agent=f"agent{index}"):
                pass
            timeline.increment(metrics.REQUESTS, f"agent{index % 2}")
            timeline.sample(metrics.QUEUE_LENGTH, f"agent{index}", step)
            if step % 100 == 0:
                timeline.event("tick", agent=f"agent{index}")

    threads = [threading.Thread(target=work, args=(index,)) for index in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(timeline.intervals()) == threads_count * per_thread
    assert len(timeline.intervals("rollout/instance0")) == 2 * per_thread
    assert timeline.counter_total(metrics.REQUESTS) == threads_count * per_thread
    assert timeline.counter_total(metrics.REQUESTS, "agent0") == threads_count * per_thread / 2
    assert len(timeline.events("tick")) == threads_count * 3
    assert sorted(timeline.gauge(metrics.QUEUE_LENGTH)) == [f"agent{i}" for i in range(threads_count)]


def test_events_gauges_and_counters():
    timeline = metrics.Timeline()
    timeline.record_migration("rollout/instance3", from_agent="verifier", to_agent="solver", time=2.0)
    timeline.record_policy_version("solver", np.int64(3), time=5.0)
    timeline.event("checkpoint", time=1.0, step=np.int32(7), loss=np.float32(0.25))
    assert [event.name for event in timeline.events()] == [
        "checkpoint",
        metrics.MIGRATION,
        metrics.POLICY_VERSION,
    ]
    migration = timeline.events(metrics.MIGRATION)[0]
    assert (migration.resource, migration.agent) == ("rollout/instance3", "solver")
    assert dict(migration.attrs) == {"from_agent": "verifier", "to_agent": "solver"}
    assert timeline.events(metrics.POLICY_VERSION)[0].attrs == {"version": 3}
    assert timeline.events("checkpoint")[0].attrs == {"step": 7, "loss": 0.25}

    for time, value in [(3.0, 5), (1.0, 2), (2.0, 9)]:  # out of order on purpose
        timeline.sample(metrics.QUEUE_LENGTH, "solver", value, time=time)
    times, values = timeline.gauge(metrics.QUEUE_LENGTH)["solver"]
    np.testing.assert_array_equal(times, [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(values, [2, 9, 5])

    for time, amount in [(1.0, 64), (2.0, 32), (4.0, 16)]:
        timeline.increment(metrics.GENERATED_TOKENS, "solver", amount, time=time)
    timeline.increment(metrics.GENERATED_TOKENS, "planner", 8, time=2.5)
    times, totals = timeline.counter(metrics.GENERATED_TOKENS)["solver"]
    np.testing.assert_array_equal(totals, [64, 96, 112])
    assert timeline.counter_total(metrics.GENERATED_TOKENS, t0=1.5, t1=4.0) == 32 + 8 + 16
    assert timeline.counter_total(metrics.GENERATED_TOKENS, "solver", t0=1.5, t1=3.0) == 32
    assert timeline.counter_keys(metrics.GENERATED_TOKENS) == ["solver", "planner"]
    assert timeline.end_time() == 5.0


def test_json_round_trip_keeps_everything(tmp_path, synthetic_timeline):
    path = synthetic_timeline.save(tmp_path)
    assert path == tmp_path / metrics.TIMELINE_FILENAME
    loaded = metrics.Timeline.load(tmp_path)
    assert loaded.resources == synthetic_timeline.resources
    # Times are stored to the microsecond; labels exactly.
    original_intervals, restored_intervals = synthetic_timeline.intervals(), loaded.intervals()
    assert len(restored_intervals) == len(original_intervals) > 100
    for original, restored in zip(original_intervals, restored_intervals, strict=True):
        assert (restored.resource, restored.kind, restored.agent) == (
            original.resource,
            original.kind,
            original.agent,
        )
        assert (restored.start, restored.end) == pytest.approx((original.start, original.end), abs=1e-6)
    assert [(e.name, e.agent, e.resource, dict(e.attrs)) for e in loaded.events()] == [
        (e.name, e.agent, e.resource, dict(e.attrs)) for e in synthetic_timeline.events()
    ]
    for series in (metrics.QUEUE_LENGTH, metrics.INSTANCES):
        original, restored = synthetic_timeline.gauge(series), loaded.gauge(series)
        assert original.keys() == restored.keys()
        for key in original:
            np.testing.assert_allclose(restored[key][0], original[key][0], atol=1e-6)
            np.testing.assert_array_equal(restored[key][1], original[key][1])
    assert loaded.counter_total(metrics.REQUESTS) == synthetic_timeline.counter_total(metrics.REQUESTS)
    assert metrics.flatten(loaded.utilization_report(0, 80)) == pytest.approx(
        metrics.flatten(synthetic_timeline.utilization_report(0, 80)), abs=1e-6
    )
    assert loaded.origin_unix == synthetic_timeline.origin_unix
    # New records after loading land after the old ones.
    assert loaded.now() >= synthetic_timeline.end_time()


def test_bad_input_is_rejected_with_the_value_named(tmp_path):
    timeline = metrics.Timeline()
    with pytest.raises(ValueError, match="end=1.0 before start=2.0"):
        timeline.add_interval("train/x", 2.0, 1.0)
    with pytest.raises(ValueError, match="resource name ''"):
        timeline.declare("")
    with pytest.raises(ValueError, match=r"window \[t0=3.0, t1=3.0\] is empty"):
        timeline.utilization("train/x", 3.0, 3.0)
    (tmp_path / "other.json").write_text('{"format": "something-else", "version": 1}')
    with pytest.raises(ValueError, match="not a flexmarl timeline"):
        metrics.Timeline.load(tmp_path / "other.json")
