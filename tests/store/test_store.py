"""ExperienceStore behaviour: readiness, whole-group claims, staleness, consume/release, bad input, reopen."""

import threading
import time

import numpy as np
import pytest

from flexmarl_jax.store import ExperienceStore, RowState

AGENTS = ["solver", "planner"]


def full_columns(num_rows, start=0):
    """Every built-in data column for rows start .. start+num_rows-1 (values derived from the row number)."""
    k = np.arange(start, start + num_rows)
    return {
        "prompt_tokens": [np.array([i, i + 1], np.int32) for i in k],
        "response_tokens": [np.arange(i % 5 + 1, dtype=np.int32) + i for i in k],
        "behaviour_logprobs": [np.full(i % 5 + 1, -i / 100, np.float32) for i in k],
        "reward": (k + 1).astype(np.float32),
        "advantage": (k - 0.5).astype(np.float32),
    }


def append_group(
    store, input_id, group_size, *, version=0, planner=None, columns="all", rows=None, agent="solver"
):
    rows = group_size if rows is None else rows
    versions = {agent: version} if planner is None else {agent: version, "planner": planner}
    cols = full_columns(rows) if columns == "all" else columns
    return store.append_rows(
        agent,
        input_ids=[input_id] * rows,
        trajectory_ids=list(range(rows)),
        group_size=group_size,
        policy_versions=versions,
        columns=cols,
    )


@pytest.fixture
def store():
    return ExperienceStore.open(None, agents=AGENTS, extra_columns={"note": "str", "score": "float64"})


def test_rows_become_ready_only_when_every_data_column_is_complete(store):
    cols = full_columns(4)
    partial = {k: cols[k] for k in ("prompt_tokens", "reward")}
    ids = append_group(store, "q0", 4, columns=partial)
    assert ids == ["q0_0_0", "q0_0_1", "q0_0_2", "q0_0_3"]
    assert store.counters("solver")["pending"] == 4
    store.set_columns(
        "solver", ids, {k: cols[k] for k in ("response_tokens", "behaviour_logprobs", "advantage")}
    )
    store.set_columns("solver", ids[:2], {"note": ["a", "b"]})
    assert store.counters("solver")["pending"] == 4  # "score" and half of "note" are still missing
    assert store.claim_micro_batch("solver", 4, current_versions=0) is None
    store.set_columns("solver", ids[2:], {"note": ["c", "d"]})
    store.set_columns("solver", ids, {"score": np.arange(4.0)})
    assert store.counters("solver") == {
        "pending": 0, "ready": 4, "claimed": 0, "consumed": 0, "dropped": 0, "total": 4
    }  # fmt: skip
    batch = store.claim_micro_batch("solver", 4, current_versions=0)
    assert batch.sample_ids == tuple(ids)
    assert batch.columns["note"] == ["a", "b", "c", "d"]
    np.testing.assert_array_equal(batch.columns["score"], np.arange(4.0))
    for got, want in zip(batch.columns["response_tokens"], cols["response_tokens"], strict=True):
        np.testing.assert_array_equal(got, want)


def test_claims_take_whole_groups_only_when_every_row_exists(store):
    extra = {"note": ["x"] * 3, "score": np.zeros(3)}
    ids = append_group(store, "q0", 4, rows=3, columns={**full_columns(3), **extra})
    assert store.complete_groups("solver") == []
    assert store.claim_micro_batch("solver", 4, current_versions=0, allow_partial=True) is None
    store.append_rows(
        "solver",
        input_ids=["q0"],
        trajectory_ids=[3],
        group_size=4,
        policy_versions={"solver": 0},
        columns={**full_columns(1, start=3), "note": ["x"], "score": [0.0]},
    )
    assert store.complete_groups("solver") == ["q0_0"]
    batch = store.claim_micro_batch("solver", 4, current_versions=0)
    assert batch.sample_ids == (*ids, "q0_0_3")
    np.testing.assert_array_equal(batch.group_index, [0, 0, 0, 0])


def _ready_group(store, input_id, size, **kwargs):
    cols = {**full_columns(size), "note": ["n"] * size, "score": np.zeros(size)}
    return append_group(store, input_id, size, columns=cols, **kwargs)


def test_claim_fills_exact_size_oldest_groups_first_or_returns_none(store):
    for i in range(5):
        _ready_group(store, f"q{i}", 2)
    batch = store.claim_micro_batch("solver", 4, current_versions=0)
    assert batch.group_ids == ("q0_0", "q1_0") and len(batch) == 4
    np.testing.assert_array_equal(batch.group_index, [0, 0, 1, 1])
    assert store.claim_micro_batch("solver", 4, current_versions=0).group_ids == ("q2_0", "q3_0")
    assert store.claim_micro_batch("solver", 4, current_versions=0) is None  # 2 rows left, nothing claimed
    assert store.counters("solver")["ready"] == 2
    assert store.claim_micro_batch("solver", 4, current_versions=0, allow_partial=True).group_ids == ("q4_0",)


def test_size_that_is_not_a_multiple_of_the_group_size_is_an_error(store):
    _ready_group(store, "q0", 4)
    with pytest.raises(ValueError, match=r"size=6 is not a multiple of group_size=4"):
        store.claim_micro_batch("solver", 6, current_versions=0)
    with pytest.raises(ValueError, match=r"size=0"):
        store.claim_micro_batch("solver", 0, current_versions=0)
    assert store.counters("solver")["claimed"] == 0


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_only_groups_within_the_staleness_bound_are_claimable(store, max_staleness):
    current = {"solver": 5, "planner": 7}
    for lag in range(4):
        _ready_group(store, f"solver_lag{lag}", 2, version=5 - lag, planner=7)
        _ready_group(store, f"planner_lag{lag}", 2, version=5, planner=7 - lag)
    _ready_group(store, "no_planner", 2, version=5)  # -1: does not depend on the planner
    claimed = set()
    while (
        batch := store.claim_micro_batch("solver", 2, current_versions=current, max_staleness=max_staleness)
    ) is not None:
        for agent, versions in batch.policy_versions.items():
            depends = versions >= 0
            assert (versions[depends] >= current[agent] - max_staleness).all()
            assert (versions[depends] <= current[agent]).all()
        claimed.update(batch.group_ids)
    lags = range(max_staleness + 1)
    want = {f"solver_lag{lag}_0" for lag in lags} | {f"planner_lag{lag}_0" for lag in lags} | {"no_planner_0"}
    assert claimed == want
    dropped = store.drop_stale_rows(current_versions=current, max_staleness=max_staleness)
    assert dropped == 2 * 2 * (3 - max_staleness)
    assert store.counters("solver")["dropped"] == dropped and store.counters("solver")["ready"] == 0


def test_dropped_group_drops_rows_appended_later(store):
    append_group(store, "q0", 3, rows=2, version=0, columns={"reward": [1.0, 2.0]})
    assert store.drop_stale_rows(current_versions=2, max_staleness=1) == 2
    store.append_rows(
        "solver", input_ids=["q0"], trajectory_ids=[2], group_size=3, policy_versions={"solver": 0}
    )
    ids = ["q0_0_0", "q0_0_1", "q0_0_2"]
    assert store.row_states("solver", ids) == [RowState.DROPPED] * 3
    assert store.counters("solver")["dropped"] == 3


def test_consume_and_release_each_row_exactly_once(store):
    for i in range(3):
        _ready_group(store, f"q{i}", 2)
    first = store.claim_micro_batch("solver", 2, current_versions=0)
    second = store.claim_micro_batch("solver", 2, current_versions=0)
    assert set(first.sample_ids).isdisjoint(second.sample_ids)
    assert store.release(second) == 2
    assert store.mark_consumed(first) == 2
    with pytest.raises(ValueError, match="not held"):
        store.mark_consumed(first)
    with pytest.raises(ValueError, match="not held"):
        store.release(second)
    again = store.claim_micro_batch("solver", 4, current_versions=0)
    assert again.group_ids == ("q1_0", "q2_0")  # the released group comes back, oldest first
    assert store.counters("solver") == {
        "pending": 0, "ready": 0, "claimed": 4, "consumed": 2, "dropped": 0, "total": 6
    }  # fmt: skip
    with pytest.raises(ValueError, match="CLAIMED"):
        store.set_columns("solver", ["q1_0_0"], {"reward": [0.0]})


@pytest.mark.timeout(30)
def test_claim_waits_for_rows_until_timeout(store):
    start = time.monotonic()
    assert store.claim_micro_batch("solver", 2, current_versions=0, timeout=0.2) is None
    assert time.monotonic() - start >= 0.2
    producer = threading.Timer(0.2, lambda: _ready_group(store, "late", 2))
    producer.start()
    batch = store.claim_micro_batch("solver", 2, current_versions=0, timeout=20)
    producer.join()
    assert batch is not None and batch.group_ids == ("late_0",)


def test_padded_sequences(store):
    _ready_group(store, "q0", 4)
    batch = store.claim_micro_batch("solver", 4, current_versions=0)
    tokens, lengths = batch.padded("response_tokens", pad_value=-1)
    np.testing.assert_array_equal(lengths, [1, 2, 3, 4])
    assert tokens.shape == (4, 4) and tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens[1], [1, 2, -1, -1])
    with pytest.raises(ValueError, match="length 4 > length=3"):
        batch.padded("response_tokens", length=3)


def _snapshot(store):
    rows = store.read_rows("solver")
    return store.counters(), rows["sample_id"], rows["state"].tolist()


BAD_CALLS = {
    "undeclared column": (
        lambda s: s.append_rows("solver", input_ids=["a"], trajectory_ids=[0], group_size=1,
                                policy_versions={"solver": 0}, columns={"rewards": [1.0]}),
        ValueError, r"\['rewards'\] are not declared .*data columns: \['prompt_tokens'",
    ),
    "float tokens": (
        lambda s: s.append_rows("solver", input_ids=["a"], trajectory_ids=[0], group_size=1,
                                policy_versions={"solver": 0}, columns={"response_tokens": [[0.5, 1.5]]}),
        TypeError, r"'response_tokens' is int32\[\]; got values of dtype float64",
    ),
    "str reward": (
        lambda s: s.append_rows("solver", input_ids=["a"], trajectory_ids=[0], group_size=1,
                                policy_versions={"solver": 0}, columns={"reward": ["high"]}),
        TypeError, r"'reward' is float32; got values of dtype <U4",
    ),
    "token out of int32 range": (
        lambda s: s.append_rows("solver", input_ids=["a"], trajectory_ids=[0], group_size=1,
                                policy_versions={"solver": 0}, columns={"prompt_tokens": [[2**40]]}),
        TypeError, r"does not fit",
    ),
    "unknown agent": (
        lambda s: s.append_rows("critic", input_ids=["a"], trajectory_ids=[0], group_size=1,
                                policy_versions={"critic": 0}),
        ValueError, r"agent 'critic' is not in this store; agents: \['solver', 'planner'\]",
    ),
    "unknown agent in versions": (
        lambda s: s.append_rows("solver", input_ids=["a"], trajectory_ids=[0], group_size=1,
                                policy_versions={"solver": 0, "critic": 1}),
        ValueError, r"unknown agent\(s\) \['critic'\]",
    ),
    "own version missing": (
        lambda s: s.append_rows("solver", input_ids=["a"], trajectory_ids=[0], group_size=1,
                                policy_versions={"planner": 0}),
        ValueError, r"own agent 'solver'",
    ),
    "duplicate sample id": (
        lambda s: s.append_rows("solver", input_ids=["q0"], trajectory_ids=[0], group_size=2,
                                policy_versions={"solver": 0}),
        ValueError, r"sample_id 'q0_0_0' is already in the table",
    ),
    "group overflow": (
        lambda s: s.append_rows("solver", input_ids=["q0"] * 2, trajectory_ids=[5, 6], group_size=2,
                                policy_versions={"solver": 0}),
        ValueError, r"group 'q0_0' would have 3 rows but group_size=2",
    ),
    "group size changed": (
        lambda s: s.append_rows("solver", input_ids=["q0"], trajectory_ids=[7], group_size=3,
                                policy_versions={"solver": 0}),
        ValueError, r"declared with group_size=2, now 3",
    ),
    "set undeclared column": (
        lambda s: s.set_columns("solver", ["q0_0_0"], {"bonus": [1.0]}), ValueError, r"\['bonus'\]",
    ),
    "set unknown row": (
        lambda s: s.set_columns("solver", ["nope_0_0"], {"reward": [1.0]}), ValueError, r"'nope_0_0' is not",
    ),
    "set wrong dtype": (
        lambda s: s.set_columns("solver", ["q0_0_0"], {"note": [3]}), TypeError, r"'note' is str",
    ),
    "bad extra column type": (
        lambda s: ExperienceStore.open(None, agents=["a"], extra_columns={"x": "float16"}),
        TypeError, r"column 'x' has type 'float16'; allowed types: int32, int64",
    ),
}  # fmt: skip


@pytest.mark.parametrize("backend", ["memory", "file"])
@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_raises_a_clear_error_and_writes_nothing(tmp_path, backend, case):
    call, error, message = BAD_CALLS[case]
    store = ExperienceStore.open(tmp_path, agents=AGENTS, backend=backend, extra_columns={"note": "str"})
    store.append_rows(
        "solver", input_ids=["q0"], trajectory_ids=[0], group_size=2, policy_versions={"solver": 0}
    )
    before = _snapshot(store)
    with pytest.raises(error, match=message):
        call(store)
    assert _snapshot(store) == before
    if backend == "file":
        store.close()
        assert _snapshot(ExperienceStore.open(tmp_path, backend="file")) == before


def test_file_store_reopens_with_consumed_rows_gone_and_claims_released(tmp_path):
    store = ExperienceStore.open(tmp_path, agents=AGENTS, backend="file", extra_columns={"note": "str"})
    for i in range(4):
        cols = {**full_columns(2, start=2 * i), "note": [f"n{i}"] * 2}
        append_group(store, f"q{i}", 2, version=3, planner=1, columns=cols)
    consumed = store.claim_micro_batch("solver", 2, current_versions={"solver": 3, "planner": 1})
    store.mark_consumed(consumed)
    leased = store.claim_micro_batch("solver", 2, current_versions={"solver": 3, "planner": 1})
    store.close()
    with pytest.raises(ValueError, match=r"has agents \['solver', 'planner'\], not \['solver'\]"):
        ExperienceStore.open(tmp_path, agents=["solver"], backend="file")
    with pytest.raises(ValueError, match="extra columns"):
        ExperienceStore.open(tmp_path, backend="file", extra_columns={"note": "int32"})
    reopened = ExperienceStore.open(tmp_path, backend="file")
    assert reopened.counters("solver") == {
        "pending": 0, "ready": 6, "claimed": 0, "consumed": 2, "dropped": 0, "total": 8
    }  # fmt: skip
    again = reopened.claim_micro_batch("solver", 6, current_versions={"solver": 3, "planner": 1})
    assert again.group_ids == (*leased.group_ids, "q2_0", "q3_0")
    assert set(again.sample_ids).isdisjoint(consumed.sample_ids)
    want = full_columns(8)
    for position, row in enumerate(again.rows.tolist()):
        np.testing.assert_array_equal(
            again.columns["response_tokens"][position], want["response_tokens"][row]
        )
        assert again.columns["reward"][position] == want["reward"][row]
    np.testing.assert_array_equal(again.policy_versions["planner"], np.ones(6))
    assert again.columns["note"] == ["n1", "n1", "n2", "n2", "n3", "n3"]


def test_missing_file_store_is_not_created_when_it_must_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="no experience store"):
        ExperienceStore.open(tmp_path, backend="file", must_exist=True)
    with pytest.raises(ValueError, match="needs a workdir"):
        ExperienceStore.open(None, agents=AGENTS, backend="file")
    with pytest.raises(ValueError, match="backend='disk' is not one of"):
        ExperienceStore.open(tmp_path, agents=AGENTS, backend="disk")


def test_current_versions_must_name_every_agent(store):
    with pytest.raises(ValueError, match=r"unknown \['critic'\], missing \['planner'\]"):
        store.claim_micro_batch("solver", 2, current_versions={"solver": 0, "critic": 0})


def _blob_keys(store, column):
    store.flush()  # the memory backend commits in the background
    return [
        k for k in store.kvstore.list().result() if k.startswith(f"tables/solver/blobs/{column}/".encode())
    ]


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_blobs_without_rows_are_deleted_and_memory_frees_consumed_values(tmp_path, backend):
    store = ExperienceStore.open(tmp_path, agents=AGENTS, backend=backend)
    for i in range(3):
        append_group(
            store, f"q{i}", 2, columns={k: v for k, v in full_columns(2).items() if k != "advantage"}
        )
    assert len(_blob_keys(store, "response_tokens")) == 3
    ids = ["q0_0_0", "q0_0_1"]
    store.set_columns("solver", ids, {"response_tokens": [[7], [8]]})  # q0's old blob has no rows left
    store.set_columns("solver", ["q1_0_0"], {"response_tokens": [[9]]})  # q1's old blob still holds q1_0_1
    assert len(_blob_keys(store, "response_tokens")) == 4
    store.set_columns(
        "solver", [f"q{i}_0_{t}" for i in range(3) for t in range(2)], {"advantage": np.zeros(6)}
    )
    store.mark_consumed(store.claim_micro_batch("solver", 6, current_versions=0))
    rows = store.read_rows("solver")
    if backend == "memory":  # consumed rows give their sequence values back
        assert _blob_keys(store, "response_tokens") == [] and _blob_keys(store, "prompt_tokens") == []
        assert rows["response_tokens"] == [None] * 6
    else:  # a durable store keeps its experience
        assert len(_blob_keys(store, "response_tokens")) == 4
        assert [r.tolist() for r in rows["response_tokens"][:3]] == [[7], [8], [9]]


@pytest.mark.timeout(30)
def test_min_rows_holds_a_partial_claim_until_enough_whole_groups():
    store = ExperienceStore.open(None, agents=AGENTS)
    append_group(store, "q0", 3)
    append_group(store, "q1", 2)
    kwargs = dict(current_versions=0, allow_partial=True, timeout=0)
    assert store.claim_micro_batch("solver", 8, min_rows=6, **kwargs) is None  # 5 rows of whole groups < 6
    assert store.counters("solver")["claimed"] == 0
    append_group(store, "q2", 3)
    batch = store.claim_micro_batch("solver", 8, min_rows=6, **kwargs)
    assert len(batch) == 8 and batch.num_groups == 3
    with pytest.raises(ValueError, match="min_rows"):
        store.claim_micro_batch("solver", 4, min_rows=5, **kwargs)


@pytest.mark.timeout(30)
def test_until_and_wake_claims_end_a_blocked_claim_without_a_timeout():
    store = ExperienceStore.open(None, agents=AGENTS)
    done = threading.Event()
    results = []
    waiter = threading.Thread(target=lambda: results.append(
        store.claim_micro_batch("solver", 2, current_versions=0, timeout=None, until=done)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()  # blocked: no rows, no signal
    done.set()
    store.wake_claims()
    waiter.join(timeout=5)
    assert not waiter.is_alive() and results == [None]
    # With rows there, a claim whose `until` is already set still takes them.
    append_group(store, "q0", 2)
    assert len(store.claim_micro_batch("solver", 2, current_versions=0, timeout=None, until=done)) == 2


def test_mark_consumed_takes_several_batches_and_checks_all_before_changing_any():
    store = ExperienceStore.open(None, agents=AGENTS)
    for i in range(3):
        append_group(store, f"q{i}", 2)
    batches = [store.claim_micro_batch("solver", 2, current_versions=0) for _ in range(3)]
    assert store.mark_consumed(batches[:2]) == 4
    with pytest.raises(ValueError, match="not held"):
        store.mark_consumed([batches[2], batches[0]])  # batches[0] is consumed already
    assert store.counters("solver")["claimed"] == 2  # batches[2] is still held, not consumed
    with pytest.raises(ValueError, match="repeat"):
        store.mark_consumed([batches[2], batches[2]])
    assert store.mark_consumed([batches[2]]) == 2
    assert store.counters("solver")["consumed"] == 6
    assert store.mark_consumed([]) == 0


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_consume_rows_settles_whole_ready_groups_without_a_claim(tmp_path, backend):
    store = ExperienceStore.open(tmp_path, agents=AGENTS, backend=backend)
    append_group(store, "q0", 2)
    append_group(store, "q1", 2)
    append_group(store, "q2", 2, columns={})  # values still pending: GENERATING
    with pytest.raises(ValueError, match="whole groups"):
        store.consume_rows("solver", ["q0_0_0"])
    with pytest.raises(ValueError, match="not READY"):
        store.consume_rows("solver", ["q2_0_0", "q2_0_1"])
    held = store.claim_micro_batch("solver", 2, current_versions=0)  # takes q0
    with pytest.raises(ValueError, match="CLAIMED"):
        store.consume_rows("solver", list(held.sample_ids))
    assert store.consume_rows("solver", ["q1_0_0", "q1_0_1"]) == 2
    assert store.consume_rows("solver", ["q1_0_0", "q1_0_1"]) == 0  # idempotent: a resume may repeat it
    # A memory store restarted with its process no longer holds a checkpointed iteration's rows: nothing to settle.
    assert store.consume_rows("solver", ["gone_0_0", "gone_0_1"]) == 0
    assert store.counters("solver")["consumed"] == 2
    store.close()
    if backend == "file":  # durable: a reopened store shows them consumed and never offers them
        reopened = ExperienceStore.open(tmp_path, backend="file", must_exist=True)
        assert reopened.row_states("solver", ["q1_0_0", "q1_0_1"]) == [RowState.CONSUMED] * 2
        batch = reopened.claim_micro_batch("solver", 2, current_versions=0)
        assert batch.group_ids == ("q0_0",)


@pytest.mark.timeout(30)
def test_claim_since_waits_for_new_rows_and_claimable_after_counts_what_is_left():
    store = ExperienceStore.open(None, agents=AGENTS)
    for i in range(3):
        append_group(store, f"q{i}", 2)
    first = store.claim_micro_batch("solver", 4, current_versions=0)
    assert len(first) == 4 and first.claimable_after == 2  # q2 is left: less than another micro-batch
    # Nothing changed since: a `since` claim does not select (even though q2 alone could fill size 2).
    assert store.claim_micro_batch("solver", 2, current_versions=0, since=first.table_changes) is None
    results = []
    waiter = threading.Thread(target=lambda: results.append(store.claim_micro_batch(
        "solver", 4, current_versions=0, timeout=None, since=first.table_changes)))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()
    append_group(store, "q3", 2)  # a change: the waiting claim selects again and takes q2 + q3
    waiter.join(timeout=5)
    assert len(results) == 1 and results[0].group_ids == ("q2_0", "q3_0") and results[0].claimable_after == 0
    store.release(first)  # a release is a change too
    assert len(store.claim_micro_batch("solver", 4, current_versions=0, since=results[0].table_changes)) == 4


def test_values_of_rows_joining_a_dropped_group_are_freed_like_a_drop():
    store = ExperienceStore.open(None, agents=AGENTS)  # memory backend: dropped values are freed
    append_group(store, "q0", 3, rows=2, version=0, columns={"response_tokens": [[1], [2]]})
    assert store.drop_stale_rows(current_versions=2, max_staleness=1) == 2
    store.append_rows("solver", input_ids=["q0"], trajectory_ids=[2], group_size=3, policy_versions={"solver": 0},
                      columns={"response_tokens": [[3]]})
    late = store.read_rows("solver", ["q0_0_2"], columns=["response_tokens"])
    assert late["state"].tolist() == [RowState.DROPPED] and late["response_tokens"] == [None]
    assert _blob_keys(store, "response_tokens") == []  # nothing of the dropped group stays stored
    store.set_columns("solver", ["q0_0_2"], {"response_tokens": [[4]]})  # a late value of a dropped row
    assert store.read_rows("solver", ["q0_0_2"], columns=["response_tokens"])["response_tokens"] == [None]
    assert _blob_keys(store, "response_tokens") == []


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_drop_rows_turns_whole_consumed_or_ready_groups_dropped(tmp_path, backend):
    store = ExperienceStore.open(tmp_path, agents=AGENTS, backend=backend)
    for i in range(4):
        append_group(store, f"q{i}", 2)
    store.mark_consumed(store.claim_micro_batch("solver", 4, current_versions=0))  # q0, q1 consumed
    held = store.claim_micro_batch("solver", 2, current_versions=0)  # q2 claimed
    with pytest.raises(ValueError, match="'q2_0_0' of 'solver' is claimed"):
        store.drop_rows("solver", ["q2_0_0"])
    # A discarded update's rows: q1 consumed (named by one row: the whole group goes), q3 READY; an id the
    # store does not hold (a memory store after a restart) is skipped.
    assert store.drop_rows("solver", ["q1_0_0", "q3_0_0", "q3_0_1", "gone_0_0"]) == 4
    assert store.drop_rows("solver", ["q1_0_0"]) == 0 and store.drop_rows("solver", []) == 0  # idempotent
    assert store.counters("solver") == {"pending": 0, "ready": 0, "claimed": 2, "consumed": 2, "dropped": 4,
                                        "total": 8}
    store.release(held)
    store.close()
    if backend == "file":
        reopened = ExperienceStore.open(tmp_path, backend="file", must_exist=True)
        assert reopened.row_states("solver", ["q0_0_0", "q1_0_1", "q3_0_0"]) == [
            RowState.CONSUMED, RowState.DROPPED, RowState.DROPPED]
        assert reopened.claim_micro_batch("solver", 4, allow_partial=True, current_versions=0).group_ids == ("q2_0",)
