"""flexmarl_benchmarks/faults.py: seeded trial plans, the per-type summary, bad flags, and a small end-to-end bench
(one trial of two fault types at tiny size: the JSON keys and the zero-loss invariants; no timing asserts)."""

import dataclasses
import json
import subprocess
import sys

import pytest

from flexmarl_benchmarks import _fault_trials as trials_lib
from flexmarl_benchmarks import faults as bench

ISSUE_KEYS = {"trials", "recovered_in_run", "stopped_cleanly", "hangs", "lost_rows", "double_trained_rows",
              "max_seconds_to_detect"}
HITS = {"instance_crash": 600, "instance_hang": 600, "instance_slow": 600, "trainer_error": 24, "store_commit": 50,
        "checkpoint_save": 15, "weight_sync": 15}
STEPS = {"instance0": 300, "instance1": 200, "instance2": 60, "instance3": 40, "instance4": 0, "instance5": 9}


def test_trial_plans_are_seeded_and_every_moment_lies_within_a_clean_run():
    plans = trials_lib.plan_trials(trials_lib.FAULT_TYPES, 20, 7, hits=HITS, instance_hits=STEPS,
                                   kill_window_s=12.0)
    assert plans == trials_lib.plan_trials(trials_lib.FAULT_TYPES, 20, 7, hits=HITS, instance_hits=STEPS,
                                           kill_window_s=12.0)
    assert plans != trials_lib.plan_trials(trials_lib.FAULT_TYPES, 20, 8, hits=HITS, instance_hits=STEPS,
                                           kill_window_s=12.0)
    for plan in plans:
        if plan.fault == trials_lib.SIGKILL:
            assert 0.0 <= plan.kill_after_s <= 12.0
        elif plan.fault in trials_lib.INSTANCE_FAULTS:  # one instance that steps, within its steps
            assert STEPS[plan.where] > 0 and 0 <= plan.after < max(1, int(STEPS[plan.where] * 0.9))
            assert plan.times == (0 if plan.fault == "instance_slow" else 1)
        else:
            assert plan.where is None and 0 <= plan.after < HITS[plan.fault] and plan.times == 1
    assert len({plan.after for plan in plans if plan.fault == "store_commit"}) > 5  # spread, not one moment


def test_the_summary_counts_each_outcome_and_the_acceptance_needs_every_figure():
    def trial(outcome, seconds=None, lost=0, resume=0):
        return trials_lib.TrialResult(trials_lib.TrialPlan("weight_sync", 0), outcome, seconds_to_detect=seconds,
                                      lost_rows=lost, resume_exit_code=resume)

    results = [trial("stopped", 0.5), trial("stopped", 95.0), trial("recovered", None, resume=None),
               trial("hang", None, lost=3, resume=1), trial("not_fired")]
    row = trials_lib.summarize(results, ["weight_sync"], detect_bound_s=90.0)["weight_sync"]
    assert {key: row[key] for key in ISSUE_KEYS} == {
        "trials": 4, "recovered_in_run": 1, "stopped_cleanly": 2, "hangs": 1, "lost_rows": 3,
        "double_trained_rows": 0, "max_seconds_to_detect": 95.0}
    assert (row["late_detections"], row["resume_failures"], row["not_fired"]) == (1, 1, 1)
    assert trials_lib.acceptance({"weight_sync": row}, 4) == {"per_type": {"weight_sync": False}, "passed": False}
    good = trials_lib.summarize([trial("stopped", 0.5)], ["weight_sync"], detect_bound_s=90.0)
    assert trials_lib.acceptance(good, 1)["passed"] and not trials_lib.acceptance(good, 2)["passed"]


def test_bad_flags_are_refused_naming_the_allowed_values(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--types", "trainer_error,disk_full"])
    assert "unknown fault type(s) ['disk_full']; known: instance_crash," in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--trials", "0"])
    assert "--trials=0 must be >= 1" in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_one_trial_of_two_fault_types_recovers_or_stops_and_loses_nothing(tmp_path):
    out = tmp_path / "faults.json"
    completed = subprocess.run(
        [sys.executable, "-m", "flexmarl_benchmarks.faults", "--types", "trainer_error,store_commit", "--trials", "1",
         "--seed", "3", "--set", "iterations=2", "--set", "eval.enabled=false", "--set", "workflow.warmup_steps=0",
         "--json", str(out)],
        capture_output=True, text=True, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["types"]) == {"trainer_error", "store_commit"}
    for fault, row in result["types"].items():
        assert ISSUE_KEYS <= set(row), fault
        assert row["trials"] == 1 and row["hangs"] == 0, (fault, row)
        assert row["lost_rows"] == row["double_trained_rows"] == 0, (fault, row)
        assert row["resume_failures"] == row["stopped_uncleanly"] == 0, (fault, row)
        assert 0 <= row["max_seconds_to_detect"] <= result["detect_bound_s"], (fault, row)
    # A trainer error is retried within the run; a failed store commit stops it, and the resume finishes it.
    assert result["types"]["trainer_error"]["recovered_in_run"] == 1
    assert result["types"]["store_commit"]["stopped_cleanly"] == 1
    details = {trial["fault"]: trial for trial in result["trial_details"]}
    assert details["store_commit"]["resume_exit_code"] == 0 and "injected fault store_commit" in \
        details["store_commit"]["stop_detail"]
    assert details["trainer_error"]["detected_by"].endswith("retried after a trainer error")
    assert result["acceptance"]["passed"] and result["seed"] == 3 and result["calibration"]["hits"]["weight_sync"] > 0


def test_a_sigkill_trial_whose_run_ended_first_is_redrawn_within_that_run_then_given_up():
    plan = trials_lib.TrialPlan(trials_lib.SIGKILL, 3, kill_after_s=30.0)
    again = trials_lib.redraw_kill(plan, ran_s=20.0, seed=1)
    assert again.attempt == 1 and again.index == 3 and 0.0 <= again.kill_after_s <= 18.0
    assert again == trials_lib.redraw_kill(plan, ran_s=20.0, seed=1)  # seeded
    last = trials_lib.redraw_kill(again, ran_s=20.0, seed=1)
    assert last.attempt == trials_lib.MAX_KILL_ATTEMPTS - 1
    assert trials_lib.redraw_kill(last, ran_s=20.0, seed=1) is None


def test_a_fault_point_trial_whose_run_ended_first_is_redrawn_at_an_earlier_hit_then_given_up():
    plan = trials_lib.TrialPlan("store_commit", 2, after=9)
    again = trials_lib.redraw_hit(plan, seed=1)
    assert again.attempt == 1 and again.index == 2 and 0 <= again.after < 9 and again.fault == "store_commit"
    assert again == trials_lib.redraw_hit(plan, seed=1)  # seeded
    last = trials_lib.redraw_hit(dataclasses.replace(again, after=max(again.after, 1)), seed=1)
    assert last.attempt == trials_lib.MAX_KILL_ATTEMPTS - 1
    assert trials_lib.redraw_hit(last, seed=1) is None
    assert trials_lib.redraw_hit(trials_lib.TrialPlan("store_commit", 0, after=0), seed=1) is None  # never reached
