"""`flexmarl bench faults`: every fault at random moments of a run; does the run recover or stop cleanly in bounded
time, and does the resumed workdir train every sample exactly once?

The run is the `faults` variant of the smoke config (configs/tiny.py: a file store, two engine instances per
agent, request timeouts on, short stall limits). Each trial:

1. **Fault.** Runs the config with one fault armed at a random moment (seeded: a random hit of its injection point
   among those a clean run reaches, at a random instance for the instance faults; `sigkill`: SIGKILL at a random
   time of the run). Most trials run in one long-lived worker process (`_fault_worker.py`), so they share one JAX
   start and the XLA cache; a sigkill trial is its own `flexmarl train` process. A run that ends before its
   moment (runs vary in length and in how often they reach a point on a loaded host) is run again at an
   earlier moment, up to three draws (`redraw_kill`, `redraw_hit`); only then it counts as `not_fired`.
2. **Classify.** `recovered` (the run reached its last iteration), `stopped` (it ended non-zero on its own with
   a stop in its journal, `stops.jsonl`, and one clear line: `RunStopped`, or the watchdog's exit 3), `hang` (no
   exit within `run.stall_timeout_s` + 30 s of the fault: the bench kills it). Seconds to detect: from the fault
   triggering to the first time the run noticed (an instance taken out of routing or failed, a request timed
   out, an iteration retried, the run stopping: `faults.detected`); for sigkill, to the process being gone.
3. **Resume** (unless the run reached its end): the workdir again, no fault, in the worker, to the last iteration.
4. **Audit** the store (`orchestrator/run_audit.py`): per agent and policy version, rows lost (produced for the
   applied attempt of an iteration, never trained) and rows trained twice.

Before the trials, one clean run counts how often each fault point is reached (the range of moments) and fills
the XLA cache; then one clean `flexmarl train` process on that warm cache times the sigkill window (from its
config.json to its exit). An instance_hang's step stays hung until its run
ends (shutdown gives up on it after 30 s), as a device call that never returns would.

JSON keys: `types.<type>` with the issue's `trials`, `recovered_in_run`, `stopped_cleanly`, `hangs`, `lost_rows`,
`double_trained_rows`, `max_seconds_to_detect`, plus `stopped_uncleanly`, `resume_failures`, `late_detections`
(detections later than `detect_bound_s`) and `not_fired` (trials whose moment came after the run had ended in
every draw; not in `trials`); `trial_details` (every trial: its plan, outcome, timings, exit codes, findings);
`acceptance`; `calibration`; `seed`, `trials_per_type`, `stall_timeout_s`, `detect_bound_s`, `bench_wall_s`;
`complete` (False in the copy written after each trial, so a bench stopped early leaves what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from flexmarl_benchmarks import _fault_trials as trials_lib
from flexmarl_benchmarks._fault_trials import (
    HANG,
    NOT_FIRED,
    RECOVERED,
    SIGKILL,
    STOPPED,
    STOPPED_UNCLEANLY,
    TrialPlan,
    TrialResult,
)
from flexmarl_benchmarks._output import write_json
from flexmarl_jax.mesh.host_devices import without_fake_cpu_devices

CONFIG_VARIANT = "faults"
DETECT_MARGIN_S = 30.0  # the bound: a stop is detected within run.stall_timeout_s + this
POLL_S = 0.1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flexmarl bench faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the result object here")
    parser.add_argument("--trials", type=int, default=10, help="trials per fault type (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="draws every trial's moment")
    parser.add_argument("--types", default=",".join(trials_lib.FAULT_TYPES),
                        help=f"comma-separated subset of {list(trials_lib.FAULT_TYPES)}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every run, e.g. --set iterations=2 (repeatable)")
    parser.add_argument("--workdirs", metavar="DIR", default=None,
                        help="keep every trial's workdir and the worker logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error(f"--trials={args.trials} must be >= 1")
    unknown = [name for name in args.types.split(",") if name not in trials_lib.FAULT_TYPES]
    if unknown:
        parser.error(f"--types: unknown fault type(s) {unknown}; known: {', '.join(trials_lib.FAULT_TYPES)}")
    bad = [item for item in args.set if "=" not in item]
    if bad:
        parser.error(f"--set {bad[0]!r}: expected KEY=VALUE")
    return args


def config_spec() -> str:
    """The packaged configs/tiny.py with the faults variant (an absolute path: the bench may run anywhere)."""
    import flexmarl_jax.configs

    return os.path.join(os.path.dirname(flexmarl_jax.configs.__file__), "tiny.py") + ":" + CONFIG_VARIANT


def bench_config(overrides: Mapping[str, str]):
    """The checked `RunConfig` every trial runs (its workdir set per trial)."""
    from flexmarl_jax.config import RunConfig, apply_overrides, load_config

    return RunConfig.from_config(apply_overrides(load_config(config_spec()), dict(overrides)))


def child_environment(cache_dir: str) -> dict[str, str]:
    """The environment of the worker and the sigkill runs: one XLA cache; devices faked from the config."""
    # each child fakes the config's device count itself
    env = dict(without_fake_cpu_devices(os.environ), TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("FLEXMARL_FAULTS", None)
    if "JAX_COMPILATION_CACHE_DIR" not in env:
        env.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


class Worker:
    """The long-lived process that runs trials in-process (`_fault_worker.py`); started again after it died or
    was killed. Its output goes to a log file."""

    def __init__(self, overrides: Mapping[str, str], env: dict[str, str], log_dir: str):
        self.overrides, self.env, self.log_dir = dict(overrides), env, log_dir
        self.process: subprocess.Popen | None = None
        self.started = 0

    def submit(self, command: dict) -> None:
        if self.process is None or self.process.poll() is not None:
            self.started += 1
            log = open(os.path.join(self.log_dir, f"worker-{self.started}.log"), "w")
            spec = json.dumps({"config": config_spec(), "overrides": self.overrides})
            self.process = subprocess.Popen([sys.executable, "-m", "flexmarl_benchmarks._fault_worker", spec],
                                            stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True,
                                            env=self.env)
            log.close()
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


def _read_json(path: str):
    try:
        with open(path) as handle:
            return json.load(handle)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _stops(workdir: str) -> list[dict]:
    from flexmarl_jax.orchestrator.journal import RunJournal

    return RunJournal(workdir).stops() if os.path.isdir(workdir) else []


def run_in_worker(worker: Worker, command: dict, *, bound_s: float, fired_bound_s: float | None) -> dict:
    """Runs `command` in the worker and waits for its result, killing the worker when the run overstays:
    `fired_bound_s` after its fault triggered, or `bound_s` after the start. Returns the worker's result, or
    {"exit_code": the worker's exit code, "died": True} when it exited (the watchdog), or {"hang": True}."""
    out = command["out"]
    for stale in (out, out + ".fired"):
        if os.path.exists(stale):
            os.remove(stale)
    worker.submit(command)
    started = time.time()
    while True:
        result = _read_json(out)
        if result is not None:
            return result
        code = worker.exit_code()
        if code is not None:
            fired = _read_json(out + ".fired")
            return {"exit_code": code, "died": True, "fired_at": fired and fired["fired_at"], "started_at": started,
                    "ended_at": time.time(), "detections": [], "error": None, "unexpected": False}
        fired = _read_json(out + ".fired")
        deadline = started + bound_s if fired is None or fired_bound_s is None else fired["fired_at"] + fired_bound_s
        if time.time() > deadline:
            worker.kill()
            return {"hang": True, "fired_at": fired and fired["fired_at"], "started_at": started,
                    "ended_at": time.time()}
        time.sleep(POLL_S)


def calibrate(worker: Worker, root: str) -> dict:
    """One clean run in the worker, every fault point counted: the hits per point and the run's seconds."""
    workdir, out = os.path.join(root, "calibration"), os.path.join(root, "calibration.json")
    result = run_in_worker(worker, {"workdir": workdir, "out": out, "count_hits": True}, bound_s=3600,
                           fired_bound_s=None)
    if result.get("exit_code") != 0:
        raise RuntimeError(f"the clean calibration run failed ({result}); see the worker log in {root}")
    shutil.rmtree(workdir, ignore_errors=True)
    return {"hits": result["hits"], "instance_steps": result["hits_at"]["instance_crash"],
            "run_seconds": result["ended_at"] - result["started_at"]}


def run_faulted(plan: TrialPlan, workdir: str, out: str, worker: Worker, env: dict[str, str],
                set_args: Sequence[str], *, stall_timeout_s: float, run_bound_s: float) -> TrialResult:
    """Step 1 and 2 of a trial (module docstring): the faulted run and its outcome."""
    stops_before = len(_stops(workdir))
    if plan.fault == SIGKILL:
        return _sigkill_run(plan, workdir, env, set_args, run_bound_s=run_bound_s)
    command = {"workdir": workdir, "out": out, "fault": plan.fault, "after": plan.after, "times": plan.times,
               "where": plan.where}
    result = run_in_worker(worker, command, bound_s=run_bound_s, fired_bound_s=stall_timeout_s + DETECT_MARGIN_S)
    fired_at = result.get("fired_at")
    trial = TrialResult(plan, NOT_FIRED, exit_code=result.get("exit_code"), stop_detail=result.get("error"))
    if fired_at is not None:
        trial.fired_after_s = round(fired_at - result["started_at"], 3)
    if result.get("hang"):
        trial.outcome = HANG
        return trial
    if fired_at is None:  # the run ended before its moment came; not a trial of the fault
        return trial
    stops = _stops(workdir)[stops_before:]
    detections = list(result["detections"]) + [(stop["time"], f"the run stops ({stop['reason']})") for stop in stops]
    first = trials_lib.first_detection(detections, fired_at)
    if first is not None:
        trial.seconds_to_detect, trial.detected_by = round(first[0] - fired_at, 3), first[1]
    if result["exit_code"] == 0:
        trial.outcome = RECOVERED
    elif stops and not result.get("unexpected"):
        trial.outcome = STOPPED
        trial.stop_detail = trial.stop_detail or stops[-1]["detail"]
    else:
        trial.outcome = STOPPED_UNCLEANLY
    return trial


def _train_process(workdir: str, env: dict[str, str], set_args: Sequence[str]) -> subprocess.Popen:
    overrides = [f"--config.{item}" for item in set_args]
    return subprocess.Popen([sys.executable, "-m", "flexmarl_jax.cli.main", "train", f"--config={config_spec()}",
                             *overrides, f"--workdir={workdir}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)


def _wait_for_config(process: subprocess.Popen, workdir: str, bound_s: float) -> bool:
    """Waits until the run wrote its config.json (True), or ended or ran past `bound_s` without (False)."""
    started, config_file = time.time(), os.path.join(workdir, "config.json")
    while not os.path.exists(config_file) and process.poll() is None and time.time() < started + bound_s:
        time.sleep(0.02)
    return process.poll() is None and os.path.exists(config_file)


def measure_kill_window(root: str, env: dict[str, str], set_args: Sequence[str], *, run_bound_s: float) -> float:
    """Seconds from a clean `flexmarl train` process writing its config.json to its exit, on the warm XLA cache
    the calibration left: the span a sigkill trial's kill is drawn from. Not the calibration run's length, which
    compiles every program and runs in the worker: kills drawn from that landed after most runs had ended."""
    workdir = os.path.join(root, "kill-window")
    process = _train_process(workdir, env, set_args)
    try:
        if not _wait_for_config(process, workdir, run_bound_s):
            raise RuntimeError(f"the clean run that times the sigkill window wrote no config.json (exit "
                               f"{process.poll()}); see {workdir}")
        written = time.time()
        code = process.wait(timeout=run_bound_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if code != 0:
        raise RuntimeError(f"the clean run that times the sigkill window failed (exit {code}); see {workdir}")
    shutil.rmtree(workdir, ignore_errors=True)
    return time.time() - written


def _sigkill_run(plan: TrialPlan, workdir: str, env: dict[str, str], set_args: Sequence[str], *,
                 run_bound_s: float) -> TrialResult:
    """A `flexmarl train` process, SIGKILLed `plan.kill_after_s` after it wrote its config.json."""
    process = _train_process(workdir, env, set_args)
    trial = TrialResult(plan, NOT_FIRED)
    started = time.time()
    _wait_for_config(process, workdir, run_bound_s)
    if process.poll() is None and os.path.exists(os.path.join(workdir, "config.json")):
        written = time.time()
        kill_at = written + plan.kill_after_s
        while process.poll() is None and time.time() < kill_at:
            time.sleep(0.01)
        if process.poll() is None:
            killed = time.time()
            process.send_signal(signal.SIGKILL)
            process.wait()
            trial.outcome, trial.exit_code = STOPPED, process.returncode
            trial.fired_after_s, trial.seconds_to_detect = round(killed - started, 3), round(time.time() - killed, 3)
            trial.detected_by = "the process is gone"
            return trial
        trial.ran_s = round(time.time() - written, 3)
    if process.poll() is None:  # never wrote its config in the bound: the run itself hung
        process.kill()
        process.wait()
        trial.outcome = HANG
    trial.exit_code = process.returncode
    return trial


def resume_and_audit(trial: TrialResult, workdir: str, out: str, worker: Worker, *, run_bound_s: float,
                     iterations: int, expected_rows: Mapping[str, int | None]) -> None:
    """Steps 3 and 4 of a trial: resume the workdir to its end (unless the run got there) and audit its store."""
    from flexmarl_jax.orchestrator.run_audit import audit_workdir

    if trial.outcome != RECOVERED:
        result = run_in_worker(worker, {"workdir": workdir, "out": out}, bound_s=run_bound_s, fired_bound_s=None)
        trial.resume_exit_code = -1 if result.get("hang") else result.get("exit_code")
        if result.get("error"):
            trial.findings.append(f"resume: {result['error']}")
    if not os.path.isdir(os.path.join(workdir, "store")):
        trial.findings.append("no store was written (the run was stopped before it opened one)")
        return
    audit = audit_workdir(workdir, iterations=iterations, expected_rows=expected_rows)
    trial.lost_rows, trial.double_trained_rows = audit.lost_rows, audit.double_trained_rows
    trial.findings.extend(audit.findings)


def run_bench(args: argparse.Namespace) -> dict:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from flexmarl_jax.config.workflow_from_config import workflow_from_config
    from flexmarl_jax.orchestrator.run_audit import rows_per_iteration

    overrides = dict(item.split("=", 1) for item in args.set)
    config = bench_config(overrides)
    types = args.types.split(",")
    started = time.perf_counter()
    root = args.workdirs or tempfile.mkdtemp(prefix="flexmarl-bench-faults-")
    os.makedirs(root, exist_ok=True)
    env = child_environment(os.path.join(root, "xla-cache"))
    worker = Worker(overrides, env, root)
    stall_timeout_s = config.run.stall_timeout_s
    samples = config.workflow.queries_per_iteration * config.workflow.samples_per_query
    expected_rows = rows_per_iteration(workflow_from_config(config.workflow), samples)
    results: list[TrialResult] = []
    try:
        print(f"flexmarl bench faults: a clean calibration run (counts the fault points; fills the XLA cache); "
              f"logs in {root}", file=sys.stderr, flush=True)
        calibration = calibrate(worker, root)
        # A run (faulted or resumed) that has not ended this long after it started, its fault not yet triggered,
        # is hung whatever its fault: three clean runs' time plus the stall bound.
        run_bound_s = 3 * calibration["run_seconds"] + stall_timeout_s + DETECT_MARGIN_S
        if SIGKILL in types:
            calibration["kill_window_s"] = round(measure_kill_window(root, env, args.set, run_bound_s=run_bound_s), 3)
        plans = trials_lib.plan_trials(types, args.trials, args.seed, hits=calibration["hits"],
                                       instance_hits=calibration["instance_steps"],
                                       kill_window_s=calibration.get("kill_window_s", 0.0))
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("ETA"), TimeRemainingColumn())
        with Progress(*columns, transient=False) as progress:
            total = len(plans)
            task = progress.add_task("trials", total=total)
            queue = list(plans)
            while queue:
                plan = queue.pop(0)
                progress.update(task, description=f"{plan.fault} #{plan.index}")
                name = f"{plan.fault}-{plan.index}" + (f"-{plan.attempt}" if plan.attempt else "")
                workdir = os.path.join(root, name)
                out = workdir + ".json"
                trial = run_faulted(plan, workdir, out, worker, env, args.set, stall_timeout_s=stall_timeout_s,
                                    run_bound_s=run_bound_s)
                redrawn = trials_lib.redraw(plan, trial.ran_s, args.seed) if trial.outcome == NOT_FIRED else None
                if redrawn is not None:  # the run ended before its moment: the same trial again, at an earlier one
                    queue.insert(0, redrawn)
                    total += 1
                    progress.update(task, total=total)
                if trial.outcome != NOT_FIRED:
                    resume_and_audit(trial, workdir, workdir + "-resume.json", worker, run_bound_s=run_bound_s,
                                     iterations=config.iterations, expected_rows=expected_rows)
                results.append(trial)
                # The figures so far, so that a bench stopped early still leaves its finished trials.
                write_json(args.json, result_object(results, calibration, args, types, stall_timeout_s=stall_timeout_s,
                                                    workers_started=worker.started,
                                                    wall_s=time.perf_counter() - started, complete=False))
                if not args.workdirs:
                    shutil.rmtree(workdir, ignore_errors=True)
                progress.advance(task)
    except BaseException:  # an interrupted bench does not wait for the worker's run to end
        worker.kill()
        raise
    finally:
        worker.close()
        if not args.workdirs:
            shutil.rmtree(root, ignore_errors=True)
    return result_object(results, calibration, args, types, stall_timeout_s=stall_timeout_s,
                         workers_started=worker.started, wall_s=time.perf_counter() - started, complete=True)


def result_object(results: Sequence[TrialResult], calibration: dict, args: argparse.Namespace, types: Sequence[str],
                  *, stall_timeout_s: float, workers_started: int, wall_s: float, complete: bool) -> dict:
    """The JSON object (module docstring); `complete` is False while trials are still to come."""
    detect_bound_s = stall_timeout_s + DETECT_MARGIN_S
    summary = trials_lib.summarize(results, types, detect_bound_s=detect_bound_s)
    return {
        "types": summary,
        "acceptance": trials_lib.acceptance(summary, args.trials),
        "complete": complete,
        "trial_details": [trial.as_dict() for trial in results],
        "calibration": calibration,
        "config": f"configs/tiny.py:{CONFIG_VARIANT}" + "".join(f" --config.{item}" for item in args.set),
        "seed": args.seed,
        "trials_per_type": args.trials,
        "stall_timeout_s": stall_timeout_s,
        "detect_bound_s": detect_bound_s,
        "workers_started": workers_started,
        "bench_wall_s": wall_s,
    }


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    keys = ("trials", "recovered_in_run", "stopped_cleanly", "hangs", "lost_rows", "double_trained_rows",
            "max_seconds_to_detect", "stopped_uncleanly", "resume_failures", "not_fired")
    table = Table(title=f"bench faults: {result['config']}, seed {result['seed']}, "
                        f"{result['bench_wall_s'] / 60:.1f} min", title_justify="left")
    table.add_column("fault")
    for key in keys:
        table.add_column(key.replace("_", " "), justify="right")
    for fault, row in result["types"].items():
        seconds = row["max_seconds_to_detect"]
        table.add_row(fault, *(str(row[key]) if key != "max_seconds_to_detect" else
                               ("-" if seconds is None else f"{seconds:.1f}") for key in keys))
    console = Console(width=max(Console().width, 160))
    console.print(table)
    verdict = "passed" if result["acceptance"]["passed"] else "FAILED"
    console.print(f"acceptance ({result['trials_per_type']} trials per type; no hang, nothing lost or trained twice, "
                  f"every stop detected within {result['detect_bound_s']:g} s): {verdict}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run_bench(args)
    print_table(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
