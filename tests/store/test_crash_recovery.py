"""Crash test: a writer process SIGKILLed at random points; the reopened durable store keeps the invariants.

Each trial starts ``crash_child.py`` on the same workdir (so every trial also recovers from the previous
kill), kills it after a random delay, reopens the store and checks: every row the child reported committed is
there and intact, no row is half written (every value marked complete equals its expected value, groups are
whole), consumed rows are CONSUMED and never claimable again, and every other complete row (including rows
claimed but not consumed when the child died) is claimable again, exactly once.
"""

import collections
import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from flexmarl_jax.store import ExperienceStore, RowState

CHILD_PATH = Path(__file__).with_name("crash_child.py")
_spec = importlib.util.spec_from_file_location("store_crash_child", CHILD_PATH)
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)

TRIALS = 20
APPEND_COLUMNS = ("prompt_tokens", "reward", "advantage")


def run_child_until_killed(workdir: Path, trial: int, rng: random.Random, log: Path) -> list[list[str]]:
    """Starts the child, SIGKILLs it at a random point once it is working; returns its complete log lines."""
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, str(CHILD_PATH), str(workdir), str(trial), str(rng.randrange(2**31))],
            stdout=out,
            stderr=subprocess.PIPE,
            env=env,
        )
    deadline = time.monotonic() + 60
    while "READY" not in log.read_text():
        if process.poll() is not None:
            pytest.fail(f"child exited with {process.returncode}: {process.stderr.read().decode()[-2000:]}")
        assert time.monotonic() < deadline, "child did not open the store within 60 s"
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, 0.35))
    process.send_signal(signal.SIGKILL)
    process.wait()
    process.stderr.close()
    assert process.returncode == -signal.SIGKILL, "the child must die by SIGKILL, not on its own"
    text = log.read_text()
    complete = text[: text.rfind("\n") + 1]  # a line cut by the kill is not a report
    return [line.split() for line in complete.splitlines()]


def verify(store: ExperienceStore, reported: dict[str, set], trial: int, stats: collections.Counter) -> None:
    rows = store.read_rows("solver")
    position = {sample_id: i for i, sample_id in enumerate(rows["sample_id"])}
    on_disk = set(position)
    assert reported["A"] <= on_disk, f"committed rows lost: {sorted(reported['A'] - on_disk)[:5]}"
    assert len(on_disk) == len(rows["sample_id"])
    groups = collections.Counter(rows["group_id"])
    for sample_id, i in position.items():
        input_id, _, trajectory = sample_id.split("_")
        assert int(input_id[1:].split("g")[0]) <= trial
        assert groups[rows["group_id"][i]] == rows["group_size"][i], f"group of {sample_id} is not whole"
        want = child.expected_values(sample_id)
        state = RowState(rows["state"][i])
        for name in APPEND_COLUMNS:
            assert rows["complete"][name][i], f"{sample_id}: {name} written at append is not complete"
        for name, value in want.items():
            if rows["complete"][name][i] and rows[name][i] is None:  # freed by a consuming child
                assert state == RowState.CONSUMED and np.ndim(value) == 1, f"{sample_id}.{name} lost"
            elif rows["complete"][name][i]:
                np.testing.assert_array_equal(rows[name][i], value, err_msg=f"{sample_id}.{name}")
            else:
                assert sample_id not in reported["S"], f"{sample_id}: reported set but {name} is incomplete"
        for agent, version in child.expected_versions(input_id).items():
            assert rows["policy_versions"][agent][i] == version
        all_complete = all(rows["complete"][name][i] for name in want)
        if sample_id in reported["X"]:
            assert state == RowState.CONSUMED, f"{sample_id} was reported consumed but is {state.name}"
        else:
            assert state in (
                RowState.READY,
                RowState.GENERATING,
                RowState.CONSUMED,
            )  # consume may be in flight
            assert (state == RowState.GENERATING) == (not all_complete)
    consumed = {s for s, i in position.items() if rows["state"][i] == RowState.CONSUMED}
    should_be_claimable = {s for s, i in position.items() if rows["state"][i] == RowState.READY}
    leased_at_kill = reported["C"] - reported["X"] - reported["R"]
    assert leased_at_kill - consumed <= should_be_claimable
    claimed, batches = [], []
    while (
        batch := store.claim_micro_batch("solver", 12, current_versions=0, allow_partial=True)
    ) is not None:
        batches.append(batch)
        claimed.extend(batch.sample_ids)
        for j, sample_id in enumerate(batch.sample_ids):
            want = child.expected_values(sample_id)["response_tokens"]
            np.testing.assert_array_equal(batch.columns["response_tokens"][j], want)
    assert len(claimed) == len(set(claimed)), "a row was claimed twice"
    assert set(claimed) == should_be_claimable and not set(claimed) & consumed
    for batch in batches:  # claims are leases: the next child sees these rows READY again
        store.release(batch)
    stats["consumed_rows_with_freed_values"] = sum(value is None for value in rows["response_tokens"])
    stats["rows"] = len(on_disk)
    stats["consumed"] = len(consumed)
    stats["leased_at_kill_reclaimed"] = len(leased_at_kill - consumed)
    stats["in_flight_rows_committed"] = len(on_disk - reported["A"])


@pytest.mark.timeout(180)
def test_sigkilled_writer_leaves_committed_rows_intact_and_leases_reclaimable(tmp_path):
    rng = random.Random(20240229)
    reported = {kind: set() for kind in "ASCXR"}
    stats = collections.Counter()
    workdir = tmp_path / "run"
    for trial in range(TRIALS):
        for kind, *ids in run_child_until_killed(workdir, trial, rng, tmp_path / f"child{trial}.log"):
            if kind in reported:
                reported[kind].update(ids)
        if trial % 2 == 0:  # also recover from a kill that follows a previous kill directly
            reopened = ExperienceStore.open(workdir, backend="file", must_exist=True)
            verify(reopened, reported, trial, stats)
            reopened.close()
    assert len(reported["X"]) > 0 and stats["rows"] > 100, f"the child did too little work to test: {stats}"
    print(f"crash test: {TRIALS} trials, {dict(stats)}")
