"""`flexmarl bench faults`: what a trial is (its seeded plan), how its outcome is classified, and the per-type summary.

Pure bookkeeping, no processes: `faults.py` runs the trials.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence

from flexmarl_jax import faults as fault_points

SIGKILL = "sigkill"
FAULT_TYPES = (*fault_points.FAULTS, SIGKILL)
INSTANCE_FAULTS = ("instance_crash", "instance_hang", "instance_slow")
# Points whose hit count in a run depends on timing (engine steps, group commits): a moment is drawn from the first
# 90% of a clean run's hits, so that a faulted run (which may reach the point less often) still gets there.
TIMING_DEPENDENT = (*INSTANCE_FAULTS, "store_commit")

RECOVERED, STOPPED, STOPPED_UNCLEANLY, HANG, NOT_FIRED = "recovered", "stopped", "stopped_uncleanly", "hang", \
    "not_fired"


@dataclasses.dataclass(frozen=True)
class TrialPlan:
    """One trial's fault, drawn from the bench's seed: `after` hits of its point pass, then it triggers `times`
    times (0: from then on) at `where` (None: anywhere). A sigkill trial kills the run `kill_after_s` seconds after
    it wrote its config.json instead."""

    fault: str
    index: int
    after: int = 0
    times: int = 1
    where: str | None = None
    kill_after_s: float | None = None
    attempt: int = 0  # a trial redrawn after its run ended before its moment came (`redraw_kill`, `redraw_hit`)


def plan_trials(types: Sequence[str], trials: int, seed: int, *, hits: Mapping[str, int],
                instance_hits: Mapping[str, int], kill_window_s: float) -> list[TrialPlan]:
    """`trials` plans per type, each at a random moment of a run: a hit of its fault point (`hits`: how often a
    clean run reaches each point) or, for sigkill, a time within the clean run's `run_seconds`. An instance fault
    hits one random instance among those that stepped in the clean run (`instance_hits`: its engine steps there;
    instances serve very unequal shares, a conditional agent's few)."""
    rng = random.Random(seed)
    stepping = sorted(name for name, steps in instance_hits.items() if steps > 0)
    plans = []
    for fault in types:
        for index in range(trials):
            if fault == SIGKILL:
                plans.append(TrialPlan(fault, index, kill_after_s=round(rng.uniform(0.0, kill_window_s), 3)))
                continue
            where = rng.choice(stepping) if fault in INSTANCE_FAULTS else None
            reached = hits[fault] if where is None else instance_hits[where]
            span = int(reached * 0.9) if fault in TIMING_DEPENDENT else int(reached)
            plans.append(TrialPlan(fault, index, after=rng.randrange(max(1, span)),
                                   times=0 if fault == "instance_slow" else 1, where=where))
    return plans


MAX_KILL_ATTEMPTS = 3  # draws of one trial's moment before it counts as not fired


def redraw_kill(plan: TrialPlan, ran_s: float, seed: int) -> TrialPlan | None:
    """The next draw of a sigkill trial whose run ended `ran_s` after its config.json, before the kill came (runs
    vary in length on a loaded host): a moment within that run's own length, seeded by the bench's seed, the
    trial and the attempt. None after `MAX_KILL_ATTEMPTS` draws."""
    if plan.attempt + 1 >= MAX_KILL_ATTEMPTS:
        return None
    rng = random.Random(f"{seed}:{plan.fault}:{plan.index}:{plan.attempt + 1}")
    return dataclasses.replace(plan, kill_after_s=round(rng.uniform(0.0, 0.9 * ran_s), 3), attempt=plan.attempt + 1)


def redraw_hit(plan: TrialPlan, seed: int) -> TrialPlan | None:
    """The next draw of a fault-point trial whose run ended before its hit `plan.after` came: how often a run
    reaches a point varies with timing (the store commits as rows arrive, so a loaded host commits fewer, larger
    batches than the clean run it was drawn from). An earlier hit, in [0, after), seeded like `redraw_kill`.
    None after `MAX_KILL_ATTEMPTS` draws, or when hit 0 was not reached (the run never reached the point)."""
    if plan.attempt + 1 >= MAX_KILL_ATTEMPTS or plan.after == 0:
        return None
    rng = random.Random(f"{seed}:{plan.fault}:{plan.index}:{plan.attempt + 1}")
    return dataclasses.replace(plan, after=rng.randrange(plan.after), attempt=plan.attempt + 1)


def redraw(plan: TrialPlan, ran_s: float | None, seed: int) -> TrialPlan | None:
    """The next draw of a trial whose run ended (`ran_s` after its config.json, when known) before its moment
    came: `redraw_kill` for sigkill, `redraw_hit` for a fault point; None when no draw is left."""
    if plan.fault != SIGKILL:
        return redraw_hit(plan, seed)
    return None if ran_s is None else redraw_kill(plan, ran_s, seed)


def first_detection(detections: Sequence[Sequence], fired_at: float) -> tuple[float, str] | None:
    """The first (time, what) at or after the fault triggered (a 50 ms grace: clocks read on other threads)."""
    after = [(float(at), what) for at, what in detections if float(at) >= fired_at - 0.05]
    return min(after) if after else None


@dataclasses.dataclass
class TrialResult:
    """What one trial came to; `outcome` is one of RECOVERED, STOPPED, STOPPED_UNCLEANLY, HANG, NOT_FIRED."""

    plan: TrialPlan
    outcome: str
    seconds_to_detect: float | None = None
    detected_by: str | None = None
    exit_code: int | None = None
    stop_detail: str | None = None
    fired_after_s: float | None = None  # from the start of the faulted run to the fault
    ran_s: float | None = None  # a sigkill run that ended before its kill: from its config.json to its exit
    resume_exit_code: int | None = None  # None: no resume was needed (the run reached its end)
    lost_rows: int = 0
    double_trained_rows: int = 0
    findings: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self.plan), **{k: v for k, v in dataclasses.asdict(self).items() if k != "plan"}}


def summarize(results: Sequence[TrialResult], types: Sequence[str], *, detect_bound_s: float) -> dict[str, dict]:
    """fault type -> the issue's keys (trials, recovered_in_run, stopped_cleanly, hangs, lost_rows,
    double_trained_rows, max_seconds_to_detect) plus what keeps them honest: trials whose fault never triggered
    (`not_fired`, not counted in `trials`), stops without a clear error (`stopped_uncleanly`), resumes that failed
    (`resume_failures`), detections later than `detect_bound_s` (`late_detections`)."""
    summary = {}
    for fault in types:
        mine = [r for r in results if r.plan.fault == fault]
        fired = [r for r in mine if r.outcome != NOT_FIRED]
        seconds = [r.seconds_to_detect for r in fired if r.seconds_to_detect is not None]
        summary[fault] = {
            "trials": len(fired),
            "recovered_in_run": sum(r.outcome == RECOVERED for r in fired),
            "stopped_cleanly": sum(r.outcome == STOPPED for r in fired),
            "hangs": sum(r.outcome == HANG for r in fired),
            "lost_rows": sum(r.lost_rows for r in fired),
            "double_trained_rows": sum(r.double_trained_rows for r in fired),
            "max_seconds_to_detect": max(seconds) if seconds else None,
            "stopped_uncleanly": sum(r.outcome == STOPPED_UNCLEANLY for r in fired),
            "resume_failures": sum(r.resume_exit_code not in (None, 0) for r in fired),
            "late_detections": sum(s > detect_bound_s for s in seconds),
            "not_fired": len(mine) - len(fired),
        }
    return summary


def acceptance(summary: Mapping[str, dict], trials: int) -> dict:
    """The issue's acceptance, per type and overall: at least `trials` trials, no hang, nothing lost or trained
    twice, every stop detected within the bound, every stop clean and every resume to the end."""
    per_type = {fault: (row["trials"] >= trials and row["hangs"] == 0 and row["lost_rows"] == 0
                        and row["double_trained_rows"] == 0 and row["late_detections"] == 0
                        and row["stopped_uncleanly"] == 0 and row["resume_failures"] == 0)
                for fault, row in summary.items()}
    return {"per_type": per_type, "passed": all(per_type.values())}
