"""`flexmarl bench emulate`'s calibration: the default tiny workload run on this CPU for real, against the same
config emulated on this host's measured chip (`emulation/host_probe.py`). Agreement says the cost model and the
emulated devices reproduce what the real control plane over real engines and trainers does on this host;
disagreement says where the model is wrong, and by how much.

Per mode (serial, sync, flexmarl): configs/tiny.py as `flexmarl train` runs it, without the supervised
warm-up (not part of an iteration) and without per-iteration checkpoints (not part of the paper's E2E); a run's
E2E is the median of the *steady* iterations among `ITERATIONS` timed ones after `UNTIMED` untimed ones. The
real run compiles a program the first time it meets a shape (a training length bucket, a prefill batch size,
met again in later iterations: measured, 1-18 s in iterations 3 and 6 of 7), seconds that no cost model of a
step predicts. JAX reports every trace, lowering and backend compile (`jax.monitoring`, events under
`/jax/core/compile/`); an iteration is steady when they took under `STEADY_COMPILE_SHARE` of it (`_steady.py`).
With fewer than `MIN_STEADY` steady iterations the median of all is used and the JSON says so.
This host's speed drifts between windows of a few seconds (the probe's engine request measured 0.8-1.4 ms per
call between runs, a mode's real E2E 0.64-0.98 s between rounds of one run), so the calibration makes
`REPEATS` rounds of a probe followed by a real run of each mode: the measured E2E is the median of the rounds',
and the chip is the probes' medians (`median_probe`). Each round's E2E and every iteration's seconds and
compile seconds are in the JSON.
The emulated run, once per mode: the same config with `pipeline.emulate = "host:tiny"`, real time
(compression 1), one decode step per engine call (as the real engine), weight sync over the host's memory. The
host chip (`host_probe.probe_host`): achieved matmul FLOP/s, memory bandwidth, and as its per-call overhead
what a real engine call of the tiny model costs beyond its roofline when a real rollout loop makes it;
training at the MFU a real micro-batch reaches against that FLOP/s; and how the two cores are split between
engine calls and training calls while both have work (`_program_probe.probe_programs`). The probes run bare engine
instances and one trainer (no workflow, no store, no pipeline): what the calibration checks is whether the
emulated run composes them as the real one does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from typing import Any

from flexmarl_benchmarks._steady import compile_seconds, steady_median

logger = logging.getLogger(__name__)

MODES = ("serial", "sync", "flexmarl")
UNTIMED = 2  # the first iterations compile most of the real run's programs
ITERATIONS = 10  # timed; the statistic is the median of the steady ones
REPEATS = 5  # rounds of a probe and a real run of each mode; the statistics are their medians


def tiny_config(mode: str, *, seed: int, workdir: str, emulate: str = "", mfu: float = 1.0):
    """configs/tiny.py in `mode`, `UNTIMED` + `ITERATIONS` iterations, no warm-up; emulated on `emulate` when given,
    training at `mfu`."""
    from flexmarl_jax.config import RunConfig, apply_overrides
    from flexmarl_jax.configs import tiny

    config = tiny.get_config()
    # Every row trained: the emulated trainer charges every row, as the paper's system computes them, whatever
    # the rewards; the real trainer would leave out the rows of groups whose samples all got one reward
    # (train/rows_without_signal.py), as many as the real model's answers make.
    overrides: dict[str, object] = {"seed": seed, "workdir": workdir, "iterations": UNTIMED + ITERATIONS,
                                    "pipeline.mode": mode, "workflow.warmup_steps": 0, "store.backend": "memory",
                                    "train.skip_rows_without_signal": False}
    if emulate:
        overrides.update({"pipeline.emulate": emulate, "pipeline.emulate_compression": 1.0,
                          "pipeline.emulate_tokens_per_call": 1, "pipeline.emulate_mfu": mfu,
                          "pipeline.emulate_sync_link": "interconnect"})
    return RunConfig.from_config(apply_overrides(config, overrides))


def iteration_seconds(config) -> tuple[list[float], list[float]]:
    """(wall seconds, seconds JAX spent tracing, lowering and compiling) of each timed iteration of a run of
    `config` (after `UNTIMED` untimed ones)."""
    from flexmarl_jax.orchestrator.run import build_orchestrator

    built = build_orchestrator(config, resume=False)
    orchestrator = built.orchestrator
    orchestrator.on_update_applied = None  # no checkpoints: same in every mode, not part of an iteration's E2E
    orchestrator.set_horizon(config.iterations)
    seconds, compiles = [], []
    try:
        for iteration in range(config.iterations):
            compiled_before, started = compile_seconds(), time.perf_counter()
            orchestrator.run_iteration(iteration)
            if iteration >= UNTIMED:
                seconds.append(time.perf_counter() - started)
                compiles.append(compile_seconds() - compiled_before)
        return seconds, compiles
    finally:
        built.rollout.shutdown()
        built.store.close()


def median_probe(probes: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    """The (chip, program costs) of several probes as one: each figure's median, except that training's MFU is
    re-derived so that a micro-batch costs its median seconds at the median FLOP/s (an MFU pairs with the
    FLOP/s of its own probe)."""
    chips, programs = [chip for chip, _ in probes], [costs for _, costs in probes]

    def median_of(items: list[Any], name: str) -> float:
        return statistics.median(getattr(item, name) for item in items)

    chip = dataclasses.replace(chips[0], **{name: median_of(chips, name) for name in (
        "peak_bf16_flops", "hbm_bytes_per_s", "interconnect_bytes_per_s", "call_overhead_s")})
    costs = dataclasses.replace(programs[0], **{field.name: median_of(programs, field.name)
                                                for field in dataclasses.fields(programs[0])})
    achieved = statistics.median(c.train_mfu * p.peak_bf16_flops for c, p in zip(programs, chips, strict=True))
    return chip, dataclasses.replace(costs, train_mfu=min(1.0, achieved / chip.peak_bf16_flops))


def calibrate(*, seed: int, root: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """({mode: {measured_e2e_s, predicted_e2e_s, relative_error, ...}}, the host chip and program costs as
    measured): `REPEATS` rounds of a probe and a real run of each mode, then one emulated run of each mode on the
    probes' median chip (the module docstring says why)."""
    from flexmarl_jax.mesh.host_devices import fake_cpu_devices

    fake_cpu_devices(8)  # the tiny config's devices, before JAX starts (a no-op if it has)
    from flexmarl_benchmarks._program_probe import probe_programs
    from flexmarl_jax.emulation.chips import register_chip
    from flexmarl_jax.emulation.host_probe import HOST_CHIP, probe_host

    probes, real = [], {mode: [] for mode in MODES}
    for repeat in range(REPEATS):
        measured_chip = probe_host()
        probes.append((measured_chip, probe_programs(
            tiny_config("sync", seed=seed, workdir=os.path.join(root, f"probe-{repeat}")), measured_chip)))
        logger.info("probe %d: %s", repeat, probes[-1])
        for mode in MODES:
            real[mode].append(iteration_seconds(tiny_config(
                mode, seed=seed, workdir=os.path.join(root, f"real-{mode}-{repeat}"))))
    measured_chip, programs = median_probe(probes)
    chip = register_chip(dataclasses.replace(
        measured_chip, call_overhead_s=programs.decode_call_overhead_s,
        engine_slowdown_beside_training=programs.engine_slowdown_beside_training,
        training_slowdown_beside_engines=programs.training_slowdown_beside_engines))
    logger.info("host chip: %s; programs: %s", chip, programs)
    result = {}
    for mode in MODES:
        emulated, emulated_compiles = iteration_seconds(tiny_config(
            mode, seed=seed, workdir=os.path.join(root, f"emulated-{mode}"), emulate=f"{HOST_CHIP}:tiny",
            mfu=programs.train_mfu))
        rounds = [steady_median(seconds, compiles) for seconds, compiles in real[mode]]
        measured = statistics.median(e2e for e2e, _ in rounds)
        predicted, emulated_steady = steady_median(emulated, emulated_compiles)
        result[mode] = {"measured_e2e_s": measured, "predicted_e2e_s": predicted,
                        "relative_error": abs(predicted - measured) / measured,
                        "measured_rounds_e2e_s": [e2e for e2e, _ in rounds],
                        "measured_iterations_s": [seconds for seconds, _ in real[mode]],
                        "measured_compile_s": [compiles for _, compiles in real[mode]],
                        "measured_steady_iterations": [steady for _, steady in rounds],
                        "predicted_iterations_s": emulated, "predicted_compile_s": emulated_compiles,
                        "predicted_steady_iterations": emulated_steady}
        logger.info("calibration %s: %s", mode, result[mode])
    return result, {"chip": dataclasses.asdict(chip), "programs": dataclasses.asdict(programs),
                    "probes": [{"chip": dataclasses.asdict(c), "programs": dataclasses.asdict(p)} for c, p in probes]}
