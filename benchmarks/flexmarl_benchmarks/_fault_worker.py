"""The in-process side of `flexmarl bench faults`: one process that runs many `flexmarl train` runs in turn.

Started by the bench (`python -m flexmarl_benchmarks._fault_worker CONFIG_JSON`), it fakes the config's devices,
starts JAX once, then reads one command per line on stdin (JSON) and runs it with `run_training` in this process,
so a trial pays for building a run, not for starting Python and JAX, and programs come from the shared XLA cache:

  {"workdir": W, "out": PATH, "fault": NAME | null, "after": n, "times": k, "where": TARGET | null,
   "count_hits": bool}

`fault` arms that fault for the run (`faults.arm`); `count_hits` arms every fault point so that it never triggers,
to count how often each is reached (the bench's clean calibration run). When the fault first triggers, the worker
writes `PATH.fired` ({"fired_at"}), so the bench can bound the run from that moment; when the run ends it writes
PATH: {"exit_code", "error", "unexpected", "started_at", "ended_at", "fired_at", "detections", "hits", "hits_at"
(per target)}. Times are
`time.time()`, comparable across the bench's processes. A run the watchdog ends exits this process (code 3,
`watchdog.EXIT_STALLED`) before PATH is written; the bench reads the stop from the workdir's journal.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time

from flexmarl_jax.orchestrator.journal import write_json_atomically

NEVER = 1 << 62  # `after` for a fault point that is only counted


def _report_fired(name: str, path: str, done: threading.Event) -> None:
    """Writes `path` once fault `name` has triggered (polled: the fault point itself stays a dict check)."""
    from flexmarl_jax import faults

    while not done.wait(0.02):
        at = faults.fired_at(name)
        if at is not None:
            write_json_atomically(path, {"fired_at": at})
            return


def run_command(config, command: dict) -> dict:
    """Runs one `run_training` as `command` says (module docstring); returns what PATH gets."""
    from flexmarl_jax import faults
    from flexmarl_jax.orchestrator.run import RunStopped, run_training

    faults.disarm()
    name = command.get("fault")
    if command.get("count_hits"):
        for point in faults.FAULTS:
            faults.arm(point, after=NEVER)
    elif name:
        faults.arm(name, after=command["after"], times=command["times"], where=command.get("where"))
    done = threading.Event()
    reporter = None
    if name:
        reporter = threading.Thread(target=_report_fired, args=(name, command["out"] + ".fired", done),
                                    name="fault-reporter", daemon=True)
        reporter.start()
    result = {"exit_code": None, "error": None, "unexpected": False, "started_at": time.time()}
    try:
        result["exit_code"] = run_training(dataclasses.replace(config, workdir=command["workdir"]))
    except RunStopped as error:
        result["exit_code"], result["error"] = 1, str(error)
    except Exception as error:  # noqa: BLE001 - a traceback instead of a clear stop: the bench counts it
        result["exit_code"], result["error"], result["unexpected"] = 1, f"{type(error).__name__}: {error}", True
    result["ended_at"] = time.time()
    done.set()
    if reporter is not None:
        reporter.join()
    result["fired_at"] = faults.fired_at(name) if name else None
    result["detections"] = faults.detections()
    result["hits"] = {point: faults.hits(point) for point in faults.FAULTS} if command.get("count_hits") else {}
    result["hits_at"] = {point: faults.hit_targets(point) for point in faults.FAULTS} if command.get("count_hits") \
        else {}
    faults.disarm()  # also releases an instance_hang step, so its thread ends
    return result


def main(argv: list[str]) -> int:
    from flexmarl_jax.config import RunConfig, apply_overrides, check_devices, load_config

    spec = json.loads(argv[0])
    config = load_config(spec["config"])
    apply_overrides(config, spec["overrides"])
    config = RunConfig.from_config(config)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from flexmarl_jax.mesh.host_devices import fake_cpu_devices

    fake_cpu_devices(config.mesh.fake_cpu_devices)
    import jax

    check_devices(config, jax.device_count())
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        write_json_atomically(command["out"], run_command(config, command))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
