"""Concurrent producers and consumers: each row claimed exactly once, only complete and fresh; none lost."""

import collections
import random
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexmarl_jax.store import ExperienceStore

CURRENT = {"solver": 5, "planner": 9}
LATE_COLUMNS = ("response_tokens", "behaviour_logprobs", "advantage")


def expected_values(sample_id: str) -> dict:
    """The final value of every data column of a row, derived from its sample id."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(sample_id))
    return {
        "prompt_tokens": np.arange(seed % 3 + 1, dtype=np.int32) + seed,
        "response_tokens": np.arange(seed % 7 + 1, dtype=np.int32) * 3 + seed,
        "behaviour_logprobs": -np.arange(seed % 7 + 1, dtype=np.float32) / 7,
        "reward": np.float32(seed % 11 + 1),
        "advantage": np.float32(seed % 13 + 0.5),
    }


def columns_for(sample_ids, names):
    values = [expected_values(s) for s in sample_ids]
    out = {}
    for name in names:
        column = [v[name] for v in values]
        out[name] = column if np.ndim(column[0]) else np.array(column)
    return out


group_plan = st.fixed_dictionaries(
    {
        "size": st.integers(1, 3),
        "solver_lag": st.integers(0, 3),
        "planner_lag": st.one_of(st.none(), st.integers(0, 3)),
        "split_append": st.booleans(),  # rows arrive in two appends
        "late_columns": st.booleans(),  # some columns are set after the append
        "never_complete": st.booleans() | st.just(False),  # a late column is never set
    }
)


def run_scenario(store, groups, max_staleness, seed, consumers=2):
    """Two producer threads append/set the planned groups while consumer threads claim; returns the log."""
    rng = random.Random(seed)
    order = list(range(len(groups)))
    rng.shuffle(order)
    producers_done = threading.Event()
    claimed, errors = [], []
    lock = threading.Lock()

    def produce(group_numbers):
        try:
            for number in group_numbers:
                plan = groups[number]
                ids = [f"g{number}_0_{t}" for t in range(plan["size"])]
                versions = {"solver": CURRENT["solver"] - plan["solver_lag"]}
                if plan["planner_lag"] is not None:
                    versions["planner"] = CURRENT["planner"] - plan["planner_lag"]
                early = [n for n in expected_values("x") if not plan["late_columns"] or n not in LATE_COLUMNS]
                parts = [ids[:1], ids[1:]] if plan["split_append"] and plan["size"] > 1 else [ids]
                for part in parts:
                    store.append_rows(
                        "solver",
                        input_ids=[f"g{number}"] * len(part),
                        trajectory_ids=[int(s.rsplit("_", 1)[1]) for s in part],
                        group_size=plan["size"],
                        policy_versions=versions,
                        columns=columns_for(part, early),
                    )
                if plan["late_columns"]:
                    late = LATE_COLUMNS[:-1] if plan["never_complete"] else LATE_COLUMNS
                    for name in late:  # one column at a time: rows pass through partly complete states
                        store.set_columns("solver", ids[::-1], columns_for(ids[::-1], [name]))
        except BaseException as error:  # noqa: BLE001 - reported by the test thread
            errors.append(error)

    def consume(worker):
        local = random.Random(seed * 31 + worker)
        try:
            while True:
                done = producers_done.is_set()
                batch = store.claim_micro_batch(
                    "solver",
                    6,
                    current_versions=CURRENT,
                    max_staleness=max_staleness,
                    allow_partial=done or local.random() < 0.5,
                    timeout=0.01,
                )
                if batch is None:
                    if done:
                        return
                    continue
                for position, sample_id in enumerate(batch.sample_ids):
                    want = expected_values(sample_id)
                    for name, value in want.items():  # complete at claim time: final values only
                        np.testing.assert_array_equal(batch.columns[name][position], value)
                for agent, versions in batch.policy_versions.items():
                    depends = versions >= 0
                    assert (versions[depends] >= CURRENT[agent] - max_staleness).all()
                    assert (versions[depends] <= CURRENT[agent]).all()
                if local.random() < 0.2:
                    store.release(batch)
                else:
                    store.mark_consumed(batch)
                    with lock:
                        claimed.extend(batch.sample_ids)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=produce, args=(order[i::2],)) for i in range(2)]
    threads += [threading.Thread(target=consume, args=(w,)) for w in range(consumers)]
    for thread in threads:
        thread.start()
    for thread in threads[:2]:
        thread.join()
    producers_done.set()
    for thread in threads[2:]:
        thread.join()
    if errors:
        raise errors[0]
    return claimed


def check_invariants(store, groups, max_staleness, claimed):
    stale, complete, eligible, every_row = set(), set(), set(), set()
    for number, plan in enumerate(groups):
        ids = {f"g{number}_0_{t}" for t in range(plan["size"])}
        lags = [plan["solver_lag"]] + ([plan["planner_lag"]] if plan["planner_lag"] is not None else [])
        is_stale = max(lags) > max_staleness
        is_complete = not (plan["late_columns"] and plan["never_complete"])
        stale |= ids if is_stale else set()
        eligible |= ids if is_complete and not is_stale else set()
        complete |= ids if is_complete else set()
        every_row |= ids
    duplicates = [s for s, n in collections.Counter(claimed).items() if n > 1]
    assert duplicates == []
    assert set(claimed) == eligible  # none lost, none beyond the bound, none incomplete
    dropped = store.drop_stale_rows(current_versions=CURRENT, max_staleness=max_staleness)
    assert dropped == len(stale)
    counts = store.counters("solver")
    assert counts["consumed"] == len(eligible) and counts["claimed"] == 0 and counts["ready"] == 0
    assert counts["pending"] == len(every_row - complete - stale)
    assert counts["total"] == len(every_row)


@pytest.mark.timeout(120)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=st.lists(group_plan, min_size=1, max_size=24),
    max_staleness=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_concurrent_claims_are_exactly_once_complete_and_fresh(groups, max_staleness, seed):
    store = ExperienceStore.open(None, agents=["solver", "planner"])
    claimed = run_scenario(store, groups, max_staleness, seed)
    check_invariants(store, groups, max_staleness, claimed)


@pytest.mark.timeout(120)
def test_concurrent_claims_on_the_durable_backend(tmp_path):
    rng = random.Random(7)
    groups = [
        {
            "size": rng.randint(1, 3),
            "solver_lag": rng.choice([0, 0, 1, 3]),
            "planner_lag": rng.choice([None, 0, 2]),
            "split_append": rng.random() < 0.5,
            "late_columns": rng.random() < 0.5,
            "never_complete": rng.random() < 0.2,
        }
        for _ in range(40)
    ]
    store = ExperienceStore.open(tmp_path, agents=["solver", "planner"], backend="file")
    claimed = run_scenario(store, groups, 1, seed=3, consumers=3)
    check_invariants(store, groups, 1, claimed)
    store.close()
    reopened = ExperienceStore.open(tmp_path, backend="file")
    assert reopened.counters("solver") == store.counters("solver")
    assert reopened.claim_micro_batch("solver", 6, current_versions=CURRENT, max_staleness=3) is None


@pytest.mark.timeout(120)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_staleness=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_claims_respect_the_bound_while_versions_advance(max_staleness, seed):
    """Producers generate under the newest version while it advances; every row ends consumed exactly once
    (within the bound of the versions current when it was claimed) or dropped as stale; none lost."""
    store = ExperienceStore.open(None, agents=["solver", "planner"])
    version = {"value": 0}
    version_lock = threading.Lock()
    stop = threading.Event()
    consumed, errors = [], []

    def current():
        with version_lock:
            return {"solver": version["value"], "planner": version["value"]}

    def produce(worker):
        rng = random.Random(seed + worker)
        try:
            for number in range(30):
                generated_under = current()["solver"]
                ids = [f"w{worker}n{number}_0_{t}" for t in range(2)]
                late = rng.random() < 0.5
                names = [n for n in expected_values("x") if not late or n not in LATE_COLUMNS]
                store.append_rows(
                    "solver",
                    input_ids=[f"w{worker}n{number}"] * 2,
                    trajectory_ids=[0, 1],
                    group_size=2,
                    policy_versions={"solver": generated_under, "planner": generated_under},
                    columns=columns_for(ids, names),
                )
                if late:
                    store.set_columns("solver", ids, columns_for(ids, LATE_COLUMNS))
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    def advance():
        rng = random.Random(seed)
        while not stop.wait(rng.uniform(0.001, 0.01)):
            with version_lock:
                version["value"] += 1

    def consume():
        try:
            while not stop.is_set():
                versions = current()
                batch = store.claim_micro_batch(
                    "solver",
                    4,
                    current_versions=versions,
                    max_staleness=max_staleness,
                    allow_partial=True,
                    timeout=0.005,
                )
                if batch is None:
                    continue
                for agent, got in batch.policy_versions.items():
                    assert (got >= versions[agent] - max_staleness).all() and (got <= versions[agent]).all()
                store.mark_consumed(batch)
                consumed.extend(batch.sample_ids)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    producers = [threading.Thread(target=produce, args=(w,)) for w in range(2)]
    others = [threading.Thread(target=advance)] + [threading.Thread(target=consume) for _ in range(2)]
    for thread in producers + others:
        thread.start()
    for thread in producers:
        thread.join()
    stop.set()
    for thread in others:
        thread.join()
    assert errors == []
    final = current()
    while (
        batch := store.claim_micro_batch(
            "solver", 4, current_versions=final, max_staleness=max_staleness, allow_partial=True
        )
    ) is not None:
        store.mark_consumed(batch)
        consumed.extend(batch.sample_ids)
    dropped = store.drop_stale_rows(current_versions=final, max_staleness=max_staleness)
    assert len(consumed) == len(set(consumed))
    counts = store.counters("solver")
    assert counts["consumed"] == len(consumed) and counts["dropped"] == dropped
    assert counts["consumed"] + counts["dropped"] == counts["total"] == 2 * 2 * 30
