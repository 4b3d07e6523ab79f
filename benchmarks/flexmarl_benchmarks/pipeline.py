"""`flexmarl bench pipeline`: one workload through every pipeline mode, side by side (the paper's Table).

The workload: the chain workflow (solver -> verifier -> corrector) on tiny models, as `flexmarl train` runs
it, with
- skewed agent load: solver and verifier serve every trajectory, the corrector only rejections; the
  verifier's verdict is drawn (seeded, `reject_rate`) because random-init policies never write one
  (`WorkloadBackend`), so the corrector serves ~30% of the trajectories in every mode;
- long-tailed response lengths: the generation backend is wrapped so that each call's `max_new_tokens` is
  drawn from a bounded Pareto distribution (most calls short, a few at the length cap). The draw is seeded by
  (seed, agent, query, turn) — not by the trajectory, so a mode that sends a query's samples as one grouped
  request and a mode that sends them one by one draw the same lengths. Random-init tiny models rarely emit
  EOS, so a call's length is ~ its `max_new_tokens`.

Each mode in `MODES` builds its own orchestrator from the same config and seed (fresh trainers, engines and
store) and runs the workload's warm-up iterations untimed (compilation; a persistent XLA cache shared by the
modes makes that cheap for every mode after the first of a device layout). Then `--iterations` timed
iterations on the same problems in every mode, interleaved across modes (round k runs iteration k of every
mode) so that the shared machine's changing load does not favour one mode. Per-iteration checkpoints are
off (same cost in every mode, not part of the paper's E2E). Only steady iterations count: a timed iteration
in which JAX compiled (a new length bucket or batch size) is left out, and `left_out` records which, their
seconds and their compile seconds (`_steady.py`). Per mode: E2E seconds per iteration (the steady iterations'
median; `e2e_s_mean` beside it), generated tokens/s, device utilization (busy device-seconds / (devices x
wall): the serial mode colocates rollout and training, so it holds half the devices of the disaggregated
modes), the time split (rollout / train / sync / other, where `train` is training not hidden behind rollout),
the seconds after the rollout's last call (`post_rollout_s`: what the asynchronous pipeline shrinks), decode
steps and instance-seconds per step, and the store calls (wall and CPU seconds per method).

`store_time_fraction`: the experience store is wrapped in a timing proxy (the orchestrator's only handle on
it); the fraction is (wall time during which at least one store call was working) / E2E over the timed
iterations of the `flexmarl` mode. A blocking claim's wait for rows is not store work: the proxy claims
without blocking and waits itself, woken by the writes that pass through it. The memory backend commits
to TensorStore on a background thread, outside the calls, so `store_cpu_fraction` (CPU seconds of the calls
plus those commits, / E2E) is reported next to it: the store's whole cost to the host, wherever it runs.

On a CPU host the fake devices share the same cores, so overlap between rollout and training is real in
the code paths but competes for the same cores (see docs/architecture.md): the ratios here are what this machine
gives, not what disaggregated hardware would.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from flexmarl_benchmarks._arguments import add_config_overrides, checked_subset, config_overrides
from flexmarl_benchmarks._output import write_json
from flexmarl_benchmarks._pacing import pace_steps
from flexmarl_benchmarks._pipeline_workload import (  # noqa: F401 - part of this benchmark's interface
    FULL,
    QUICK,
    Workload,
    WorkloadBackend,
    length_key,
    long_tail_length,
    seeded_uniform,
)
from flexmarl_benchmarks._steady import compile_seconds, is_steady, steady_indices
from flexmarl_benchmarks._store_timing import TimedStore
from flexmarl_jax.config.workflow_from_config import team_agents
from flexmarl_jax.mesh.host_devices import fake_cpu_devices

logger = logging.getLogger(__name__)

# Mode name -> config overrides (`--config.KEY=VALUE` strings). Add ablations here; the table, the JSON and
# the ratios pick them up.
MODES: dict[str, dict[str, str]] = {
    "serial": {"pipeline.mode": "serial"},
    "sync": {"pipeline.mode": "sync"},
    "flexmarl": {"pipeline.mode": "flexmarl"},
    "flexmarl_no_async": {"pipeline.mode": "flexmarl", "pipeline.async_micro_batches": "false"},
    "flexmarl_no_balancing": {"pipeline.mode": "flexmarl", "pipeline.balancing": "false"},
}
NO_BALANCING_MODE = "flexmarl_no_balancing"
BASELINE_MODE = "serial"
SYNC_MODE = "sync"
PROPOSED_MODE = "flexmarl"
GOALS = {"speedup_vs_serial": 3.0, "speedup_vs_sync": 1.1, "store_time_fraction": 0.03}  # issue 8's acceptance


# ------------------------------------------------------------------------------------ one mode


def bench_config(workload: Workload, overrides: Mapping[str, str], *, seed: int, workdir: str | None = None):
    """The embedded tiny config with the workload's sizes and one mode's overrides (`KEY=VALUE` strings,
    applied to the ConfigDict), as the checked `RunConfig`; `workdir` None keeps the config's."""
    from flexmarl_jax.config import RunConfig, apply_overrides, load_config

    config = load_config()
    apply_overrides(config, {
        "seed": str(seed),
        "iterations": str(workload.warmup_iterations + workload.iterations),
        "workflow.queries_per_iteration": str(workload.queries_per_iteration),
        "workflow.samples_per_query": str(workload.samples_per_query),
        "workflow.warmup_steps": "0",
        "train.micro_batch_size": str(workload.micro_batch_size),
        "rollout.max_response_length": str(workload.max_response_length),
        "store.backend": "memory",
    })
    apply_overrides(config, dict(overrides))
    if workdir is not None:
        config.workdir = workdir
    return RunConfig.from_config(config)


def resource_devices(agents) -> dict[str, tuple]:
    """Timeline resource -> the devices it runs on (`rollout/<instance>`, `train/<agent>`), from each agent's
    runtime (`orchestrator.agents.AgentRuntime`: its devices and its instances as built)."""
    mapping = {}
    for name, runtime in agents.items():
        if runtime.devices is None:  # emulated (pipeline.emulate): each resource on chips of its own
            mapping[f"train/{name}"] = tuple(f"train/{name}#{chip}" for chip in range(runtime.trainer.cost_model.chips))
            for instance in runtime.instances:
                chips = instance.engine.cost_model.chips
                mapping[f"rollout/{instance.name}"] = tuple(f"rollout/{instance.name}#{chip}" for chip in range(chips))
            continue
        mapping[f"train/{name}"] = tuple(d.id for d in runtime.devices.train_devices)
        for group, instance in zip(runtime.devices.rollout_groups, runtime.instances, strict=True):
            mapping[f"rollout/{instance.name}"] = tuple(d.id for d in group)
    return mapping


def decode_steps(rollout) -> dict[str, int]:
    """Instance name -> generate steps so far."""
    return {instance.name: instance.decode_steps for instance in rollout.instances}


def device_utilization(timeline, devices_of: Mapping[str, tuple], t0: float, t1: float) -> float:
    """Busy device-seconds / (devices x wall) over [t0, t1]; a device is busy while any of its resources is."""
    from flexmarl_jax.metrics import union_length

    spans: dict[int, list[tuple[float, float]]] = {}
    for devices in devices_of.values():
        for device in devices:
            spans.setdefault(device, [])
    for interval in timeline.intervals(include_open=True, overlapping=(t0, t1)):
        for device in devices_of.get(interval.resource, ()):
            spans[device].append((interval.start, interval.end))
    if not spans:
        return 0.0
    return sum(union_length(device_spans, t0, t1) for device_spans in spans.values()) / (len(spans) * (t1 - t0))


class ModeRun:
    """One mode's orchestrator (fresh trainers, engines and store), built, warmed up and timed step by step,
    so that `main` can interleave the modes' timed iterations."""

    def __init__(self, name: str, overrides: Mapping[str, str], workload: Workload, *, seed: int, root: str,
                 pace_s: float = 0.0):
        from flexmarl_jax.orchestrator.run import build_orchestrator

        self.name, self.overrides, self.workload = name, dict(overrides), workload
        self.config = bench_config(workload, overrides, seed=seed, workdir=os.path.join(root, name))
        import jax

        from flexmarl_jax.config import check_devices

        check_devices(self.config, jax.device_count())
        started = time.perf_counter()
        orchestrator, agents, self.raw_store, self.rollout, _ = build_orchestrator(self.config, resume=False)
        self.build_s = time.perf_counter() - started
        self.orchestrator, self.timeline = orchestrator, orchestrator.timeline
        self.timed_store = TimedStore(self.raw_store, clock=self.timeline.now)
        orchestrator.backend = WorkloadBackend(orchestrator.backend, workload, seed=seed,
                                               verdict_agent=team_agents(self.config.workflow)[1])
        orchestrator.store = self.timed_store
        # Per-iteration checkpoints cost the same in every mode and are not part of the paper's E2E time.
        orchestrator.on_update_applied = None
        orchestrator.set_horizon(self.config.iterations)
        self.devices_of = resource_devices(agents)
        if pace_s > 0:
            for instance in self.rollout.instances:
                pace_steps(instance, pace_s)
        self.iterations: list[dict[str, Any]] = []
        self.warmup_s = 0.0
        self._next_iteration = 0
        self._calls_before: dict = {}
        self._steps_before: dict = {}
        self._steps: dict[str, int] = {}
        self._closed = False

    def warm_up(self) -> None:
        started = time.perf_counter()
        for _ in range(self.workload.warmup_iterations):
            self.orchestrator.run_iteration(self._next_iteration)
            self._next_iteration += 1
        self.warmup_s = time.perf_counter() - started
        self._calls_before = self.timed_store.call_totals()
        self._steps_before = decode_steps(self.rollout)

    def run_timed_iteration(self) -> None:
        timeline, iteration = self.timeline, self._next_iteration
        store_cpu_before = self.timed_store.cpu_seconds()
        compiled_before = compile_seconds()
        t0 = timeline.now()
        record = self.orchestrator.run_iteration(iteration)
        t1 = timeline.now()
        compile_s = compile_seconds() - compiled_before
        self._next_iteration += 1
        self.iterations.append({
            "iteration": iteration,
            "start_s": t0,
            "e2e_s": t1 - t0,
            "compile_s": compile_s,  # JAX tracing, lowering and compiling inside it (_steady.py)
            "generated_tokens": record["generated_tokens"],
            "rollout_wall_s": record["rollout_wall_s"],
            # After the last rollout call returned: the training left over, the update and the weight sync.
            "post_rollout_s": max(0.0, (t1 - t0) - record["rollout_wall_s"]),
            "team_accuracy": record["team_accuracy"],
            "requests": {agent: stats["requests"] for agent, stats in record["agent"].items()},
            "split": timeline.time_split(t0, t1),
            "utilization": device_utilization(timeline, self.devices_of, t0, t1),
            "utilization_by_group": {k: v for k, v in timeline.utilization_report(t0, t1).items()
                                     if k != "resources"},
            "store_busy_s": self.timed_store.busy_seconds(t0, t1),
            "store_summed_s": self.timed_store.summed_seconds(t0, t1),
            "store_cpu_s": self.timed_store.cpu_seconds() - store_cpu_before,
            "instance_busy_s": sum(timeline.busy_seconds(resource, t0, t1) for resource in self.devices_of
                                   if resource.startswith("rollout/")),
        })

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._steps = {name: count - self._steps_before.get(name, 0)
                       for name, count in decode_steps(self.rollout).items()}
        self.rollout.shutdown()
        self.raw_store.close()

    def summary(self) -> dict[str, Any]:
        """The mode's numbers over its steady timed iterations (those that compiled left out, `_steady.py`): E2E
        their median, rates and shares over their sum (call after `close`)."""
        timed = self.iterations
        kept = steady_indices([it["e2e_s"] for it in timed], [it["compile_s"] for it in timed])
        iterations, n = [timed[i] for i in kept], len(kept)
        left_out = [it for i, it in enumerate(timed) if i not in kept]
        e2e = sum(it["e2e_s"] for it in iterations)
        tokens = sum(it["generated_tokens"] for it in iterations)
        mean = lambda key: sum(it[key] for it in iterations) / n  # noqa: E731
        groups = iterations[0]["utilization_by_group"].keys()
        steps = self._steps
        return {
            "e2e_s": statistics.median(it["e2e_s"] for it in iterations),
            "e2e_s_mean": e2e / n,
            "steady_iterations": sum(is_steady(it["e2e_s"], it["compile_s"]) for it in timed),
            # Timed iterations left out because they compiled: which, their seconds, and the compiles' share.
            "left_out": {"iterations": [it["iteration"] for it in left_out],
                         "wall_s": sum(it["e2e_s"] for it in left_out),
                         "compile_s": sum(it["compile_s"] for it in left_out)},
            "tokens_per_s": tokens / e2e,
            "utilization": sum(it["utilization"] * it["e2e_s"] for it in iterations) / e2e,
            "utilization_by_group": {g: sum(it["utilization_by_group"][g] * it["e2e_s"] for it in iterations) / e2e
                                     for g in groups},
            "time_split_s": {key: sum(it["split"][key] for it in iterations) / n for key in iterations[0]["split"]},
            "rollout_wall_s": mean("rollout_wall_s"),
            "post_rollout_s": mean("post_rollout_s"),
            "store_time_fraction": sum(it["store_busy_s"] for it in iterations) / e2e,
            # CPU of store work (calls and background commits) / E2E: what the store costs the host.
            "store_cpu_fraction": sum(it["store_cpu_s"] for it in iterations) / e2e,
            "store_calls_per_iteration": {
                method: dict(zip(("calls", "seconds", "cpu_seconds"),
                                 ((now - before) / n for now, before in
                                  zip(totals, self._calls_before.get(method, (0, 0.0, 0.0)), strict=True)),
                                 strict=True))
                for method, totals in self.timed_store.call_totals().items()},
            "generated_tokens_per_iteration": tokens / n,
            # On CPU the fake devices share the cores: concurrent instances make each of these steps slower.
            "decode_steps_per_iteration": sum(steps.values()) / n,
            "decode_steps_per_instance": {name: count / n for name, count in steps.items()},
            "instance_busy_s_per_decode_step": sum(it["instance_busy_s"] for it in iterations)
            / max(1, sum(steps.values())),
            "devices": len({d for devices in self.devices_of.values() for d in devices}),
            "warmup_s": self.warmup_s,
            "build_s": self.build_s,
            "iterations": [{**it, "counted": i in kept} for i, it in enumerate(timed)],  # every timed one
            "overrides": self.overrides,
        }


def run_modes(modes: Mapping[str, Mapping[str, str]], workload: Workload, *, seed: int,
              root: str, pace_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """Builds and warms up every mode, then times them in interleaved rounds: round k runs iteration k of
    every mode, starting one mode later each round, so that a change in the shared machine's load hits all
    modes alike rather than whichever mode happened to run then."""
    runs: dict[str, ModeRun] = {}
    try:
        for name, overrides in modes.items():
            started = time.perf_counter()
            runs[name] = ModeRun(name, overrides, workload, seed=seed, root=os.path.join(root, f"pace{pace_s}"),
                                 pace_s=pace_s)
            runs[name].warm_up()
            logger.info("mode %s ready in %.1f s (warm-up %.1f s)", name, time.perf_counter() - started,
                        runs[name].warmup_s)
        names = list(runs)
        for round_index in range(workload.iterations):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                runs[name].run_timed_iteration()
    finally:
        for run in runs.values():
            run.close()
    return {name: run.summary() for name, run in runs.items()}


# ------------------------------------------------------------------------------------ report


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def summarize(modes: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON object: per-mode numbers plus the headline ratios of the proposed mode."""
    result: dict[str, Any] = {"modes": {name: dict(numbers) for name, numbers in modes.items()}}
    for numbers in result["modes"].values():
        if BASELINE_MODE in modes:
            numbers["speedup_vs_serial"] = ratio(modes[BASELINE_MODE]["e2e_s"], numbers["e2e_s"])
    proposed = modes.get(PROPOSED_MODE)
    if proposed is not None:
        for key, baseline in (("speedup_vs_serial", BASELINE_MODE), ("speedup_vs_sync", SYNC_MODE)):
            if baseline in modes:
                result[key] = ratio(modes[baseline]["e2e_s"], proposed["e2e_s"])
        result["store_time_fraction"] = proposed["store_time_fraction"]
        result["store_cpu_fraction"] = proposed.get("store_cpu_fraction")
        unbalanced = modes.get(NO_BALANCING_MODE)
        if unbalanced is not None and "rollout_wall_s" in proposed and "rollout_wall_s" in unbalanced:
            # rollout time without balancing / with (issue 9)
            result["rollout_speedup_from_balancing"] = ratio(unbalanced["rollout_wall_s"], proposed["rollout_wall_s"])
    result["goals"] = dict(GOALS)
    met = {"speedup_vs_serial": lambda value, goal: value >= goal, "speedup_vs_sync": lambda value, goal: value > goal,
           "store_time_fraction": lambda value, goal: value < goal}
    result["goals_met"] = {key: met[key](result[key], goal) for key, goal in GOALS.items()
                           if result.get(key) is not None}
    return result


def print_table(result: Mapping[str, Any], workload: Workload, *, pace_ms: float = 0.0) -> None:
    from rich.console import Console
    from rich.table import Table

    clock = f"engine steps paced to >= {pace_ms:g} ms" if pace_ms else "raw CPU"
    table = Table(title=f"pipeline modes ({clock}): chain workflow, {workload.queries_per_iteration} queries x "
                        f"{workload.samples_per_query} samples, long-tailed lengths <= "
                        f"{workload.max_response_length} tokens, {workload.iterations} timed iteration(s)")
    for column in ("mode", "E2E s/iter", "vs serial", "tokens/s", "device util", "rollout s", "train s*",
                   "sync s", "other s", "post-rollout s", "store frac"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for name, numbers in result["modes"].items():
        split = numbers["time_split_s"]
        speedup = numbers.get("speedup_vs_serial")
        table.add_row(
            name, f"{numbers['e2e_s']:.2f}", "-" if speedup is None else f"{speedup:.2f}x",
            f"{numbers['tokens_per_s']:.1f}", f"{numbers['utilization']:.1%}",
            *(f"{split[key]:.2f}" for key in ("rollout_s", "train_s", "sync_s", "other_s")),
            f"{numbers['post_rollout_s']:.2f}", f"{numbers['store_time_fraction']:.3f}")
    console = Console(width=max(Console().width, 140))
    console.print(table)
    console.print("time split per iteration: rollout = some instance decoding; train* = training not hidden "
                  "behind rollout; other = neither (host work, store, thread hand-offs); post-rollout = E2E after "
                  "the last rollout call returned; store frac = share of E2E inside store calls")
    for key in ("speedup_vs_serial", "speedup_vs_sync", "store_time_fraction", "store_cpu_fraction",
                "rollout_speedup_from_balancing"):
        if result.get(key) is not None:
            console.print(f"{PROPOSED_MODE} {key}: {result[key]:.3f}")




@contextlib.contextmanager
def compilation_cache(path: str | None):
    """Persistent XLA compilation cache under `path` for the duration (unless one is configured already).

    Modes with the same device layout compile identical programs (the key includes the devices), so every
    mode after the first one loads them instead of compiling: the warm-ups shrink, the timed part is the same.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cache

    if path is None or jax.config.jax_compilation_cache_dir:
        yield
        return
    previous_min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", previous_min_time)
        cache.reset_cache()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flexmarl bench pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the result object here")
    parser.add_argument("--quick", action="store_true", help="a seconds-scale workload (tests)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {list(MODES)}")
    parser.add_argument("--iterations", type=int, default=None, help="timed iterations per mode")
    parser.add_argument("--queries", type=int, default=None, help="queries per iteration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="compile every mode from scratch (no persistent XLA cache shared between modes)")
    parser.add_argument("--instances-per-agent", type=int, default=None,
                        help="rollout instances per agent in every mode (more gives balancing something to move)")
    parser.add_argument("--pace-ms", type=float, default=10.0,
                        help="also run every mode with engine steps padded to this long (0: raw CPU only)")
    add_config_overrides(parser, "every mode", "rollout.decode_slots=4")
    parser.add_argument("--emulate", default=None, metavar="CHIP:MODEL",
                        help="emulated devices for every mode (pipeline.emulate, e.g. v5p:qwen2.5-14b): the cost "
                        "model's device time under the real control plane; no pacing (the emulation sets the pace)")
    args = parser.parse_args(argv)
    if args.emulate is not None:
        from flexmarl_jax.emulation.spec import parse_emulate

        try:
            parse_emulate(args.emulate)
        except ValueError as error:
            parser.error(f"--emulate: {error}")
        args.set.append(f"pipeline.emulate={args.emulate}")
        args.pace_ms = 0.0
    config_overrides(parser, args.set)
    checked_subset(parser, "--modes", args.modes, list(MODES), "mode")
    if args.iterations is not None and args.iterations < 1:
        parser.error(f"--iterations={args.iterations} must be >= 1")
    if args.pace_ms < 0:
        parser.error(f"--pace-ms={args.pace_ms} must be >= 0")
    if args.quick:
        args.pace_ms = 0.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = QUICK if args.quick else FULL
    if args.iterations is not None:
        workload = dataclasses.replace(workload, iterations=args.iterations)
    if args.queries is not None:
        workload = dataclasses.replace(workload, queries_per_iteration=args.queries)
    overrides = dict(item.split("=", 1) for item in args.set)
    if args.instances_per_agent is not None:
        overrides["rollout.instances_per_agent"] = str(args.instances_per_agent)
    from flexmarl_jax.config import devices_needed

    # The workload's config with the --set overrides, checked before JAX starts; the modes change only pipeline
    # knobs, and devices_needed counts the disaggregated layout, the most any mode binds.
    fake_cpu_devices(max(8, devices_needed(bench_config(workload, overrides, seed=args.seed))))
    started = time.perf_counter()
    with (tempfile.TemporaryDirectory(prefix="flexmarl-bench-pipeline-") as root,
          compilation_cache(None if args.no_compile_cache else os.path.join(root, "xla-cache"))):
        selected = {name: {**MODES[name], **overrides} for name in args.modes.split(",")}
        result = summarize(run_modes(selected, workload, seed=args.seed, root=root))
        if args.pace_ms > 0:
            # The same modes again, with every engine step padded as if each instance had its own accelerator
            # (see `pace_steps`): what the design gains on disaggregated hardware, measured with real engines,
            # store and trainers. The top-level numbers stay the raw CPU ones.
            paced = summarize(run_modes(selected, workload, seed=args.seed, root=root, pace_s=args.pace_ms / 1e3))
            result["paced"] = {"pace_ms": args.pace_ms, **paced}
    result["workload"] = dataclasses.asdict(workload)
    result["seed"] = args.seed
    result["bench_wall_s"] = time.perf_counter() - started
    print_table(result, workload)
    if "paced" in result:
        print_table(result["paced"], workload, pace_ms=args.pace_ms)
    write_json(args.json, result)
    return 0
