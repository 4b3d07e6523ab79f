"""`flexmarl bench emulate`'s calibration: the default tiny workload run on this CPU for real, against the same
config emulated on this host's measured chip (`emulation/host_probe.py`). Agreement says the cost model and the
emulated devices reproduce what the real control plane over real engines and trainers does on this host;
disagreement says where the model is wrong, and by how much.

Per mode (serial, sync, flexmarl): configs/tiny.py as `flexmarl train` runs it, without the supervised
warm-up (not part of an iteration) and without per-iteration checkpoints (not part of the paper's E2E); E2E
is the median of `ITERATIONS` timed iterations after `UNTIMED` untimed ones: the real run compiles a program
the first time it meets a shape (a training length bucket, a prefill batch size), seconds that no cost model
of a step predicts and that the median leaves out (each iteration's seconds are in the JSON beside it).
The emulated run: the same config with
`pipeline.emulate = "host:tiny"`, real time (compression 1), one decode step per engine call (as the real
engine), weight sync over the host's memory. The host chip (`host_probe.probe_host`): achieved matmul FLOP/s,
memory bandwidth, and as its per-call overhead what a real decode step of the tiny model costs beyond its
roofline; training at the MFU a real micro-batch reaches against that FLOP/s (`host_probe.probe_programs`).
Both probes time the programs alone (no rollout loop, no store, no pipeline): what the calibration checks is
whether the emulated run composes them as the real one does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from typing import Any

logger = logging.getLogger(__name__)

MODES = ("serial", "sync", "flexmarl")
UNTIMED = 2  # the first iterations compile most of the real run's programs
ITERATIONS = 5  # timed; the statistic is their median, as a later iteration still compiles a shape seen first


def tiny_config(mode: str, *, seed: int, workdir: str, emulate: str = "", mfu: float = 1.0):
    """configs/tiny.py in `mode`, `UNTIMED` + `ITERATIONS` iterations, no warm-up; emulated on `emulate` when given,
    training at `mfu`."""
    from flexmarl_jax.config import RunConfig, apply_overrides
    from flexmarl_jax.configs import tiny

    config = tiny.get_config()
    overrides: dict[str, object] = {"seed": seed, "workdir": workdir, "iterations": UNTIMED + ITERATIONS,
                                    "pipeline.mode": mode, "workflow.warmup_steps": 0, "store.backend": "memory"}
    if emulate:
        overrides.update({"pipeline.emulate": emulate, "pipeline.emulate_compression": 1.0,
                          "pipeline.emulate_tokens_per_call": 1, "pipeline.emulate_mfu": mfu,
                          "pipeline.emulate_sync_link": "interconnect"})
    return RunConfig.from_config(apply_overrides(config, overrides))


def iteration_seconds(config) -> list[float]:
    """Wall seconds of each timed iteration of a run of `config` (after `UNTIMED` untimed ones)."""
    from flexmarl_jax.orchestrator.run import build_orchestrator

    built = build_orchestrator(config, resume=False)
    orchestrator = built.orchestrator
    orchestrator.on_update_applied = None  # no checkpoints: same in every mode, not part of an iteration's E2E
    orchestrator.set_horizon(config.iterations)
    seconds = []
    try:
        for iteration in range(config.iterations):
            started = time.perf_counter()
            orchestrator.run_iteration(iteration)
            if iteration >= UNTIMED:
                seconds.append(time.perf_counter() - started)
        return seconds
    finally:
        built.rollout.shutdown()
        built.store.close()


def calibrate(*, seed: int, root: str) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
    """({mode: {measured_e2e_s, predicted_e2e_s, relative_error}}, the host chip and program costs as measured)."""
    from flexmarl_jax.mesh.host_devices import fake_cpu_devices

    fake_cpu_devices(8)  # the tiny config's devices, before JAX starts (a no-op if it has)
    from flexmarl_jax.emulation.chips import register_chip
    from flexmarl_jax.emulation.host_probe import HOST_CHIP, probe_host, probe_programs

    measured_chip = probe_host()
    programs = probe_programs(tiny_config("sync", seed=seed, workdir=os.path.join(root, "probe")), measured_chip)
    chip = register_chip(dataclasses.replace(measured_chip, call_overhead_s=programs.decode_call_overhead_s))
    logger.info("host chip: %s; programs: %s", chip, programs)
    result = {}
    for mode in MODES:
        real = iteration_seconds(tiny_config(mode, seed=seed, workdir=os.path.join(root, f"real-{mode}")))
        emulated = iteration_seconds(tiny_config(mode, seed=seed, workdir=os.path.join(root, f"emulated-{mode}"),
                                                 emulate=f"{HOST_CHIP}:tiny", mfu=programs.train_mfu))
        measured, predicted = statistics.median(real), statistics.median(emulated)
        result[mode] = {"measured_e2e_s": measured, "predicted_e2e_s": predicted,
                        "relative_error": abs(predicted - measured) / measured,
                        "measured_iterations_s": real, "predicted_iterations_s": emulated}
        logger.info("calibration %s: %s", mode, result[mode])
    return result, {"chip": dataclasses.asdict(chip), "programs": dataclasses.asdict(programs)}
