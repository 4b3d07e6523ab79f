"""`flexmarl bench emulate`: the FlexMARL paper's comparisons on emulated chips (`pipeline.emulate`).

Each preset (`_emulate_presets.py`: MA, the paper's math-agent team with a 14B model on TPU v5p, and CA, the
coding-agent team with a 32B model) runs in every
mode of `Preset.modes` (serial, sync, flexmarl and the ablations without asynchrony, without balancing and with
static allocation, all on-policy as in the paper; then flexmarl_stale, our bounded-staleness extension, which
is reported beside them and never as the paper's system) through the real orchestrator, store, router, balancer
and dispatchers, with trainers,
engines and weight sync taking the cost model's time. Per mode: E2E seconds per iteration in *device*
seconds (wall x compression), generated tokens per device second, training-pool utilization (training
seconds / (slices x wall)), and the share of the emulated engines' busy time the host stalled them
(`host_stall_share`: above `MAX_HOST_OVERHEAD_SHARE`, this host's own overhead shows in the figures, and the
run says so in `host_overhead_within_bound`), with the decode steps an emulated engine advanced per call and
the wall seconds of one compressed step.

The headline figures of a preset, fractions as in the paper (1.03 = +103%):
  speedup_vs_serial / speedup_vs_sync      E2E of serial / sync over flexmarl's
  e2e_increase_without_async               E2E(no_async) / E2E(flexmarl) - 1
  throughput_loss_without_balancing        1 - tokens per second(no_balancing) / tokens per second(flexmarl)
  train_utilization                        flexmarl's training-pool utilization (static_allocation's beside it)
  stale_extension_speedup_vs_flexmarl      ours, not the paper's: E2E of flexmarl over flexmarl_stale's
  flexmarl_e2e_vs_lower_bound              flexmarl's E2E over its `lower_bound_s` (_lower_bound.py)
Per mode also: `lower_bound_s` (what no schedule of the workload beats, with its parts), `sync_s`, `swap_s`
and `balancer` (moves, queue_peak per agent, migration_s), in device seconds, and `train_tokens` (real and
padded).

First, unless `--no-calibration`: the default tiny workload run on this CPU for real against the same config
emulated on this host's measured chip (`_emulate_calibration.py`); `calibration` -> {mode: {measured_e2e_s,
predicted_e2e_s, relative_error, measured_rounds_e2e_s, ...}} for serial, sync and flexmarl (medians of
`_emulate_calibration.REPEATS` rounds), `calibration_host_chip` the chip as measured (the rounds' probes and
their medians).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from flexmarl_benchmarks._emulate_presets import PAPER, PRESETS, Preset
from flexmarl_benchmarks._lower_bound import CallRecorder, iteration_lower_bound
from flexmarl_benchmarks._output import write_json

logger = logging.getLogger(__name__)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def run_mode(preset: Preset, mode: str, overrides: Mapping[str, object], *, seed: int, root: str,
             changes: Mapping[str, object] | None = None, plots_dir: str | None = None,
             gantt_iterations: int | None = None) -> dict[str, Any]:
    """One mode of a preset: an untimed first iteration, then `preset.iterations` timed ones; with `plots_dir`,
    its Gantt chart (the last `gantt_iterations`) and load plots go to `plots_dir/<preset>/<mode>`."""
    from flexmarl_jax.config import RunConfig
    from flexmarl_jax.emulation.timescale import MAX_HOST_OVERHEAD_SHARE
    from flexmarl_jax.orchestrator.emulated_setup import Emulation
    from flexmarl_jax.orchestrator.run import build_orchestrator

    config = RunConfig.from_config(preset.config_dict(overrides, seed=seed, workdir=os.path.join(root, mode),
                                                      changes=changes))
    started = time.perf_counter()
    built = build_orchestrator(config, resume=False)
    orchestrator = built.orchestrator
    orchestrator.set_horizon(config.iterations)
    recorder = orchestrator.backend = CallRecorder(orchestrator.backend)
    emulation = Emulation.from_config(config)  # the run's cost models, for the lower bound
    trainers = {agent: runtime.trainer for agent, runtime in built.agents.items()}
    meshes = config.mesh.train_slices or len(trainers)
    timed = []
    try:
        orchestrator.run_iteration(0)
        recorder.take()
        for iteration in range(1, config.iterations):
            charged = {agent: len(trainer.charges) for agent, trainer in trainers.items()}
            t0 = orchestrator.timeline.now()
            record = orchestrator.run_iteration(iteration)
            wall = orchestrator.timeline.now() - t0
            micro_batch_s = {agent: [c.device_s for c in trainer.charges[charged[agent]:] if c.kind == "micro_batch"]
                             for agent, trainer in trainers.items()}
            bound = iteration_lower_bound(recorder.take(), orchestrator.workflow, rollout=emulation.rollout,
                                          train=emulation.train, sync_s=emulation.weight_sync_s(),
                                          micro_batch_s=micro_batch_s, meshes=meshes,
                                          on_policy=config.train.max_staleness == 0)
            timed.append({"wall_s": wall, "generated_tokens": record["generated_tokens"],
                          "rollout_wall_s": record["rollout_wall_s"], "sync_s": record["sync_s"],
                          "train_utilization": record["train_pool"]["utilization"], "bound": bound})
    finally:
        built.rollout.shutdown()
        built.store.close()
    if plots_dir is not None:
        from flexmarl_jax.metrics import plots

        plots.plot_all(config.workdir, orchestrator.timeline, os.path.join(plots_dir, preset.name, mode),
                       gantt_iterations=gantt_iterations)
    compression = config.pipeline.emulate_compression
    wall = sum(it["wall_s"] for it in timed)
    engines = [instance.engine for instance in built.rollout.instances if instance.engine.device.calls]
    busy = sum(engine.device.timescale.wall_s(engine.device.device_s) for engine in engines)
    stall_share = sum(engine.device.host_stall_s for engine in engines) / busy if busy else 0.0
    calls = sum(engine.generate_calls for engine in engines)
    steps = sum(engine.steps_advanced for engine in engines)
    router = built.rollout.backend.router
    charges = [charge for runtime in built.agents.values() for charge in runtime.trainer.charges]
    micro_batches = [charge for charge in charges if charge.kind == "micro_batch"]
    return {
        "e2e_s": wall / len(timed) * compression,  # device seconds per iteration
        # No schedule of the iterations' workloads beats this (_lower_bound.py): the mean over the timed ones
        "lower_bound_s": sum(it["bound"]["lower_bound_s"] for it in timed) / len(timed),
        "lower_bound_parts_s": {part: sum(it["bound"][part] for it in timed) / len(timed)
                                for part in ("critical_path_s", "tail_s", "first_group_s", "training_s")},
        "wall_s_per_iteration": wall / len(timed),
        "tokens_per_s": sum(it["generated_tokens"] for it in timed) / (wall * compression),
        "rollout_s": sum(it["rollout_wall_s"] for it in timed) / len(timed) * compression,
        # wall time the iteration spent on weight sync alone (nothing else busy), device seconds per iteration
        "sync_s": sum(it["sync_s"] for it in timed) / len(timed) * compression,
        # The inter-agent balancer over the whole run (every iteration, the untimed one too): instances moved,
        # the most requests each agent's queue held waiting at once (in every mode: no_balancing's queues are
        # what balancing would have relieved), and the device seconds moved instances spent between leaving one
        # agent and serving the next (draining, then loading the new agent's weights from a peer).
        # Trainer state moved between shared training slices and the host, summed over agents: device seconds
        # per iteration (a mean over every iteration, the untimed first one too; 0 on dedicated meshes).
        "swap_s": sum(charge.device_s for charge in charges if charge.kind == "swap") / config.iterations,
        # Tokens trained over the whole run: real (attended) and what the steps computed (rows x length, padded
        # to the micro-batch's longest row, or packed bins with `train.pack_rows`).
        "train_tokens": {"real": sum(charge.real_tokens for charge in micro_batches),
                         "padded": sum(charge.rows * charge.length for charge in micro_batches)},
        "balancer": {"moves": int(router.stats["migrations"]),
                     "queue_peak": {agent: int(peak) for agent, peak in router.queue_peaks.items()},
                     "migration_s": float(router.stats["migration_s"]) * compression},
        "train_utilization": sum(it["train_utilization"] * it["wall_s"] for it in timed) / wall,
        # The host's overhead against the emulated engines (every iteration, the untimed one too): the share of
        # their busy wall time they sat waiting for the host with work pending, and what a call lasted.
        "host_stall_share": stall_share,
        "host_overhead_within_bound": stall_share < MAX_HOST_OVERHEAD_SHARE,
        "generate_calls": calls,
        "decode_steps_per_call": steps / calls if calls else 0.0,
        "compressed_step_s": busy / steps if steps else 0.0,  # wall seconds of one emulated decode step
        "mode_wall_s": time.perf_counter() - started,
        "overrides": {key: value for key, value in overrides.items()},
    }


def headline(modes: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The paper's figures from the modes' numbers (None where a mode was not run)."""
    get = lambda mode, key: modes.get(mode, {}).get(key)  # noqa: E731
    proposed = get("flexmarl", "e2e_s")
    balanced = ratio(get("no_balancing", "tokens_per_s"), get("flexmarl", "tokens_per_s"))
    unasync = ratio(get("no_async", "e2e_s"), proposed)
    return {
        "speedup_vs_serial": ratio(get("serial", "e2e_s"), proposed),
        "speedup_vs_sync": ratio(get("sync", "e2e_s"), proposed),
        "e2e_increase_without_async": None if unasync is None else unasync - 1,
        "throughput_loss_without_balancing": None if balanced is None else 1 - balanced,
        "train_utilization": get("flexmarl", "train_utilization"),
        "train_utilization_static_allocation": get("static_allocation", "train_utilization"),
        "stale_extension_speedup_vs_flexmarl": ratio(proposed, get("flexmarl_stale", "e2e_s")),
        "flexmarl_e2e_vs_lower_bound": ratio(proposed, get("flexmarl", "lower_bound_s")),
        "host_overhead_within_bound": all(m["host_overhead_within_bound"] for m in modes.values()),
    }


def run_preset(preset: Preset, modes: list[str], *, seed: int, root: str, changes: Mapping[str, object],
               plots_dir: str | None = None, gantt_iterations: int | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    every = preset.modes()
    results = {}
    for mode in modes:
        results[mode] = run_mode(preset, mode, every[mode], seed=seed, root=os.path.join(root, preset.name),
                                 changes=changes, plots_dir=plots_dir, gantt_iterations=gantt_iterations)
        logger.info("%s %s: %s", preset.name, mode, results[mode])
    return {**headline(results), "wall_s": time.perf_counter() - started, "modes": results,
            "preset": {"name": preset.name, "iterations": preset.iterations, "overrides": dict(preset.overrides),
                       "changes": dict(changes)},
            "paper": PAPER.get(preset.name)}


def print_summary(result: Mapping[str, Any]) -> None:
    for mode, numbers in (result.get("calibration") or {}).items():
        print(f"calibration {mode:9s} measured {numbers['measured_e2e_s']:.3f} s/iter  predicted "
              f"{numbers['predicted_e2e_s']:.3f} s/iter  relative error {numbers['relative_error']:.1%}")
    for name, preset in result["presets"].items():
        print(f"preset {name} ({preset['wall_s']:.0f} s here); paper: {preset['paper']}")
        for mode, numbers in preset["modes"].items():
            balancer = numbers["balancer"]
            print(f"  {mode:18s} E2E {numbers['e2e_s']:8.1f} device-s/iter (bound {numbers['lower_bound_s']:.1f})  "
                  f"{numbers['tokens_per_s']:9.1f} tok/s  "
                  f"train util {numbers['train_utilization']:.1%}  host stall {numbers['host_stall_share']:.1%}  "
                  f"moves {balancer['moves']} (queue peak {max(balancer['queue_peak'].values(), default=0)}, "
                  f"{balancer['migration_s']:.1f} device-s)")
        for key in ("speedup_vs_serial", "speedup_vs_sync", "e2e_increase_without_async",
                    "throughput_loss_without_balancing", "train_utilization", "train_utilization_static_allocation",
                    "stale_extension_speedup_vs_flexmarl", "flexmarl_e2e_vs_lower_bound"):
            value = preset[key]
            print(f"  {key}: {'-' if value is None else f'{value:.3f}'}")
        within = preset["host_overhead_within_bound"]
        print(f"  host overhead within 10% of the compressed step in every mode: {within}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flexmarl bench emulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the result object here")
    parser.add_argument("--presets", default=",".join(PRESETS),
                        help=f"comma-separated subset of {list(PRESETS)}; empty: the calibration alone")
    parser.add_argument("--modes", default=None, help="comma-separated modes (default: all of Preset.modes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--emulate", default=None, metavar="CHIP:MODEL",
                        help="the chip and model every preset runs on (default: each preset's own)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every preset and mode, e.g. --set rollout.max_response_length=1024 "
                        "(repeatable; the JSON records it)")
    parser.add_argument("--plots", default=None, metavar="DIR",
                        help="write each mode's Gantt chart and load plots under DIR/<preset>/<mode>")
    parser.add_argument("--gantt-iterations", type=int, default=None, metavar="K",
                        help="the Gantt chart's window: the last K iterations (0: the whole run)")
    parser.add_argument("--no-calibration", action="store_true",
                        help="skip the calibration (the default tiny workload on this CPU against its cost model)")
    args = parser.parse_args(argv)
    if args.gantt_iterations is not None and args.gantt_iterations < 0:
        parser.error(f"--gantt-iterations={args.gantt_iterations} must be >= 0 (0: the whole run)")
    args.preset_names = [name for name in args.presets.split(",") if name]
    unknown = [name for name in args.preset_names if name not in PRESETS]
    if unknown:
        parser.error(f"--presets: unknown preset(s) {unknown}; choices: {', '.join(PRESETS)}")
    every_mode = list(next(iter(PRESETS.values())).modes())
    unknown = [mode for mode in (args.modes or "").split(",") if args.modes and mode not in every_mode]
    if unknown:
        parser.error(f"--modes: unknown mode(s) {unknown}; choices: {', '.join(every_mode)}")
    args.changes = {}
    for item in args.set:
        key, equals, value = item.partition("=")
        if not equals or not key:
            parser.error(f"--set {item!r}: expected KEY=VALUE with KEY a dotted config key, e.g. "
                         "rollout.max_response_length=1024")
        args.changes[key] = value
    if args.emulate is not None:
        from flexmarl_jax.emulation.spec import parse_emulate

        try:
            parse_emulate(args.emulate)
        except ValueError as error:
            parser.error(f"--emulate: {error}")
        args.changes["pipeline.emulate"] = args.emulate
    if args.changes:  # a key or value the config refuses: one line now, not after the first preset has run
        from flexmarl_jax.config import ConfigError, RunConfig

        for name in args.preset_names:
            preset = PRESETS[name]
            try:
                RunConfig.from_config(preset.config_dict(preset.modes()["flexmarl"], seed=args.seed, workdir="unused",
                                                         changes=args.changes))
            except ConfigError as error:
                parser.error(f"--set/--emulate on preset {name}: {error}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    result: dict[str, Any] = {"calibration": None, "presets": {}}
    with tempfile.TemporaryDirectory(prefix="flexmarl-bench-emulate-") as root:
        if not args.no_calibration:
            from flexmarl_benchmarks._emulate_calibration import calibrate

            result["calibration"], result["calibration_host_chip"] = calibrate(
                seed=args.seed, root=os.path.join(root, "calibration"))
        for name in args.preset_names:
            preset = PRESETS[name]
            modes = args.modes.split(",") if args.modes else list(preset.modes())
            result["presets"][name] = run_preset(preset, modes, seed=args.seed, root=root, changes=args.changes,
                                                 plots_dir=args.plots, gantt_iterations=args.gantt_iterations)
    result["bench_wall_s"] = time.perf_counter() - started
    print_summary(result)
    write_json(args.json, result)
    return 0
