"""`flexmarl bench learning`: does the team learn more per wall-clock second than one agent, and does the
asynchronous pipeline learn faster than the synchronous one? Held-out accuracy against RL wall-clock.

Three runs of one config (`--config SPEC` as `flexmarl train` takes it; the default task, configs/tiny.py,
when it is not given), one seed, each with the same RL wall-clock budget:
- `team_flexmarl`: the chain team (solver -> verifier -> corrector) in `flexmarl` mode (the default run);
- `team_sync`: the same team in `sync` mode (training starts after the whole rollout);
- `solver_alone`: the solver without verifier and corrector (a one-node DAG whose answer is the solver's).

Every run starts from its own fresh models with the config's warm-up (not counted in the budget: it is the same
supervised warm-up per agent in every run; its seconds are reported as `setup_s`). The budget clock then counts
the RL iterations only, from the end of the first one: the first iteration compiles the rollout and training
programs (15-20 s of a team's on this CPU, a third of a one-minute budget, and not learning), so its seconds are
reported apart (`first_iteration_s`) and its update is the only one the clock does not see, in every run alike.
An iteration that starts before the budget runs out is finished, so a run may end up to one iteration past the
budget (`rl_s` says by how much). The held-out eval (greedy `eval_team_accuracy` and
`eval_pass_at_k` on the config's eval problems, the same list in every run) runs at the start of RL, whenever
another `--eval-every-s` of RL time has passed, and at the end; its own time is not counted. Per-iteration
checkpoints are off (they cost a team three saves, a solver one, and are not learning).

Each run is a child process (fresh JAX, its own memory), one after another, so they never share the cores.

JSON keys:
  runs.<run>.curve                    [{iteration, rl_s, eval_team_accuracy, eval_pass_at_k}, ...] in RL time
  runs.<run>.eval_accuracy_at_budget  greedy held-out accuracy of the policy at the end of the budget
  eval_accuracy_at_budget             run -> the same figure
  team_vs_solver_alone                eval_accuracy_at_budget team_flexmarl / solver_alone (None if the latter is 0)
  flexmarl_vs_sync_at_budget          eval_accuracy_at_budget team_flexmarl / team_sync (None if the latter is 0)
  team_minus_solver_alone, flexmarl_minus_sync_at_budget   the same comparisons as differences (accuracy points)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

from flexmarl_benchmarks._arguments import add_config_overrides, checked_subset, config_overrides
from flexmarl_benchmarks._output import write_json

TEAM_FLEXMARL, TEAM_SYNC, SOLVER_ALONE = "team_flexmarl", "team_sync", "solver_alone"
RUNS = (TEAM_FLEXMARL, TEAM_SYNC, SOLVER_ALONE)
SOLVER = "solver"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flexmarl bench learning", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the result object here")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="the accuracy-against-wall-clock PNG (default: next to --json, or learning.png)")
    parser.add_argument("--budget-s", type=float, default=60.0, help="RL wall-clock seconds each run gets")
    parser.add_argument("--eval-every-s", type=float, default=10.0, help="evaluate after this much more RL time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {list(RUNS)}")
    parser.add_argument("--config", default=None, metavar="SPEC",
                        help="the config every run starts from: PATH[:VARIANTS] as flexmarl train takes it, e.g. "
                             "configs/smollm2_team.py:cpu (default: the embedded default, configs/tiny.py)")
    parser.add_argument("--smoke", action="store_true",
                        help="the config's smoke variant (configs/tiny.py's sizes: seconds-long runs for tests)")
    add_config_overrides(parser, "every run", "workflow.warmup_steps=50")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one run, write its result
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s={args.budget_s} must be > 0")
    if args.eval_every_s <= 0:
        parser.error(f"--eval-every-s={args.eval_every_s} must be > 0")
    config_overrides(parser, args.set)
    checked_subset(parser, "--runs", args.runs, list(RUNS), "run")
    return args


# ------------------------------------------------------------------------------------------ one run's config


def config_spec(spec: str | None, smoke: bool) -> str:
    """`--config` with the `smoke` variant added when `smoke` (every config built on configs/tiny.py has it)."""
    spec = spec or "flexmarl_jax.configs.tiny"
    if not smoke:
        return spec
    return f"{spec},smoke" if ":" in spec else f"{spec}:smoke"


def run_config(name: str, *, seed: int, workdir: str, smoke: bool = False,
               overrides: Mapping[str, str] | None = None, spec: str | None = None):
    """The checked `RunConfig` of run `name`: config `spec` (the embedded default when None; with `smoke`
    sizes), the run's changes, then `overrides` (`KEY=VALUE` strings)."""
    from flexmarl_jax.config import RunConfig, apply_overrides, load_config

    config = load_config(config_spec(spec, smoke))
    config.seed = seed
    config.workdir = workdir
    config.iterations = 1 << 20  # the budget ends a run, not an iteration count
    if name == TEAM_SYNC:
        config.pipeline.mode = "sync"
    elif name == SOLVER_ALONE:
        make_solver_alone(config)
    elif name != TEAM_FLEXMARL:
        raise ValueError(f"unknown run {name!r}; allowed: {', '.join(RUNS)}")
    apply_overrides(config, dict(overrides or {}))
    return RunConfig.from_config(config)


def make_solver_alone(config) -> None:
    """Turns a chain config into the solver alone: one DAG node played by the solver agent (same model,
    sampling and learning rate), whose answer is the final answer; its shaping term pays for the solver's own
    right answer with the weight chain's `solver_correct` has."""
    import ml_collections

    solver_weight = config.workflow.shaping_weights.solver_correct
    solver = config.agents[SOLVER]
    config.agents = ml_collections.ConfigDict({SOLVER: solver})
    workflow = config.workflow
    workflow.name = "dag"
    workflow.options = ml_collections.ConfigDict({"nodes": ({"agent": SOLVER},), "edges": (),
                                                  "answer_from": (SOLVER,)})
    workflow.roles = ml_collections.ConfigDict({SOLVER: SOLVER})
    workflow.shaping_weights = ml_collections.ConfigDict({"own_answer_correct": solver_weight})


# ------------------------------------------------------------------------------------------ one run (child)


def run_one(name: str, *, seed: int, budget_s: float, eval_every_s: float, smoke: bool,
            overrides: Mapping[str, str], workdir: str, spec: str | None = None) -> dict[str, Any]:
    """Builds run `name` (with its warm-up), runs RL iterations until `budget_s` of RL time has passed, with
    held-out evals as the module docstring says; returns the run's result."""
    from flexmarl_jax.config import devices_needed
    from flexmarl_jax.mesh.host_devices import fake_cpu_devices

    config = run_config(name, seed=seed, workdir=workdir, smoke=smoke, overrides=overrides, spec=spec)
    fake_cpu_devices(max(config.mesh.fake_cpu_devices, devices_needed(config)))
    import jax

    from flexmarl_jax.config import check_devices
    from flexmarl_jax.orchestrator.run import build_evaluator, build_orchestrator

    check_devices(config, jax.device_count())
    if not config.eval.enabled:
        raise ValueError("flexmarl bench learning needs eval.enabled=True: it reports held-out accuracy")
    started = time.monotonic()
    orchestrator, _agents, store, rollout, _ = build_orchestrator(config, resume=False)
    setup_s = time.monotonic() - started
    orchestrator.on_update_applied = None  # no per-iteration checkpoints (see the module docstring)
    evaluator = build_evaluator(config, orchestrator)
    curve: list[dict[str, Any]] = []
    eval_s = 0.0

    def evaluate(iteration: int, rl_s: float) -> None:
        nonlocal eval_s
        record = evaluator.evaluate(iteration, orchestrator.versions())
        eval_s += record["eval_wall_s"]
        curve.append({"iteration": iteration, "rl_s": rl_s, "eval_team_accuracy": record["eval_team_accuracy"],
                      "eval_pass_at_k": record["eval_pass_at_k"]})
        _progress(name, rl_s, budget_s, iteration, record["eval_team_accuracy"])

    rl_s, iteration, next_eval_s, accuracy, first_iteration_s = 0.0, 0, eval_every_s, [], 0.0
    try:
        evaluate(0, 0.0)
        while rl_s < budget_s:
            began = time.monotonic()
            record = orchestrator.run_iteration(iteration)
            took = time.monotonic() - began
            if iteration == 0:
                first_iteration_s = took  # compilation (see the module docstring)
            else:
                rl_s += took
            iteration += 1
            accuracy.append(record.get("team_accuracy"))
            if rl_s >= budget_s:
                break
            if rl_s >= next_eval_s:
                evaluate(iteration, rl_s)
                while next_eval_s <= rl_s:
                    next_eval_s += eval_every_s
        evaluate(iteration, rl_s)
    finally:
        rollout.shutdown()
        store.close()
    return {
        "agents": list(orchestrator.workflow.agents),
        "pipeline_mode": config.pipeline.mode,
        "iterations": iteration,
        "rl_s": rl_s,
        "setup_s": setup_s,
        "first_iteration_s": first_iteration_s,
        "eval_s": eval_s,
        "seconds_per_iteration": rl_s / max(1, iteration - 1),  # the first iteration is not on the clock
        "train_team_accuracy": [value for value in accuracy if value is not None],
        "curve": curve,
        "eval_accuracy_at_budget": curve[-1]["eval_team_accuracy"],
        "eval_pass_at_k_at_budget": curve[-1]["eval_pass_at_k"],
    }


def _progress(name: str, rl_s: float, budget_s: float, iteration: int, accuracy: float) -> None:
    """One line per eval on stderr: where the run is in its budget and what it has reached."""
    done = min(rl_s, budget_s)
    bar = "#" * int(20 * done / budget_s)
    print(f"{name:<14} [{bar:<20}] rl {done:5.0f}/{budget_s:.0f} s (eta {budget_s - done:4.0f} s) | iteration "
          f"{iteration:4d} | eval greedy {accuracy:.3f}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ the parent


def run_in_child(name: str, args: argparse.Namespace, root: str) -> dict[str, Any]:
    """Runs `name` in a child process (`--child`); returns its result."""
    out = os.path.join(root, f"{name}.json")
    command = [sys.executable, "-m", "flexmarl_benchmarks.learning", "--child", name, "--child-out", out,
               "--seed", str(args.seed), "--budget-s", str(args.budget_s), "--eval-every-s", str(args.eval_every_s)]
    command += ["--smoke"] if args.smoke else []
    command += ["--config", args.config] if args.config else []
    for item in args.set:
        command += ["--set", item]
    completed = subprocess.run(command, stdout=sys.stderr, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"flexmarl bench learning: run {name!r} failed (exit {completed.returncode}); see above")
    with open(out) as handle:
        return json.load(handle)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def summarize(runs: Mapping[str, dict[str, Any]], *, budget_s: float, seed: int) -> dict[str, Any]:
    """The result object (see the module docstring) from each run's result."""
    at_budget = {name: run["eval_accuracy_at_budget"] for name, run in runs.items()}

    def compare(first: str, second: str) -> tuple[float | None, float | None]:
        if first not in at_budget or second not in at_budget:
            return None, None
        return ratio(at_budget[first], at_budget[second]), at_budget[first] - at_budget[second]

    team_vs_solver, team_minus_solver = compare(TEAM_FLEXMARL, SOLVER_ALONE)
    flexmarl_vs_sync, flexmarl_minus_sync = compare(TEAM_FLEXMARL, TEAM_SYNC)
    return {
        "budget_s": budget_s,
        "seed": seed,
        "runs": dict(runs),
        "eval_accuracy_at_budget": at_budget,
        "team_vs_solver_alone": team_vs_solver,
        "flexmarl_vs_sync_at_budget": flexmarl_vs_sync,
        "team_minus_solver_alone": team_minus_solver,
        "flexmarl_minus_sync_at_budget": flexmarl_minus_sync,
    }


def print_table(result: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"held-out greedy accuracy after {result['budget_s']:.0f} s of RL (seed {result['seed']})")
    for column in ("run", "iterations", "s / iteration", "start", "at budget", "pass@k at budget", "setup s",
                   "1st iteration s"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for name, run in result["runs"].items():
        table.add_row(name, str(run["iterations"]), f"{run['seconds_per_iteration']:.2f}",
                      f"{run['curve'][0]['eval_team_accuracy']:.3f}", f"{run['eval_accuracy_at_budget']:.3f}",
                      _maybe(run['eval_pass_at_k_at_budget']), f"{run['setup_s']:.0f}",
                      f"{run['first_iteration_s']:.0f}")
    console = Console(width=max(120, Console().width))
    console.print(table)
    for key in ("team_vs_solver_alone", "flexmarl_vs_sync_at_budget"):
        value = result[key]
        console.print(f"{key}: {'n/a' if value is None else f'{value:.2f}'}")


def _maybe(value: float | None) -> str:
    """A table cell for a figure an eval may not have (eval.samples=0 has no pass@k)."""
    return "n/a" if value is None else f"{value:.3f}"


def plot(result: Mapping[str, Any], path: str) -> str:
    """Greedy held-out accuracy (solid) and pass@k (dotted, where the eval samples) against RL wall-clock, one
    colour per run."""
    from matplotlib import rc_context
    from matplotlib.figure import Figure

    from flexmarl_jax.metrics.plot_style import STYLE, agent_colors, save_figure

    colors = agent_colors(result["runs"])
    with rc_context(STYLE):
        figure = Figure(figsize=(8, 4.5), layout="constrained")
        axes = figure.subplots()
        for name, run in result["runs"].items():
            seconds = [point["rl_s"] for point in run["curve"]]
            axes.plot(seconds, [point["eval_team_accuracy"] for point in run["curve"]], marker="o",
                      color=colors[name], label=f"{name} (greedy)")
            if all(point["eval_pass_at_k"] is not None for point in run["curve"]):  # eval.samples=0 has none
                axes.plot(seconds, [point["eval_pass_at_k"] for point in run["curve"]], linestyle=":",
                          color=colors[name], label=f"{name} (pass@k)")
        axes.axvline(result["budget_s"], color="#737373", linewidth=1, linestyle="--")
        axes.set_xlabel("RL wall-clock (s; warm-up, the compiling first iteration and evals not counted)")
        axes.set_ylabel("held-out accuracy")
        axes.set_ylim(-0.02, 1.02)
        axes.set_title(f"Learning per wall-clock second (seed {result['seed']})")
        axes.legend(loc="lower right")
        return str(save_figure(figure, path))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = dict(item.split("=", 1) for item in args.set)
    if args.child:
        with tempfile.TemporaryDirectory(prefix=f"flexmarl-bench-learning-{args.child}-") as workdir:
            result = run_one(args.child, seed=args.seed, budget_s=args.budget_s, eval_every_s=args.eval_every_s,
                             smoke=args.smoke, overrides=overrides, workdir=workdir, spec=args.config)
        write_json(args.child_out, result)
        return 0
    names = args.runs.split(",")
    for name in names:  # bad overrides fail here, before any run starts
        run_config(name, seed=args.seed, workdir="unused", smoke=args.smoke, overrides=overrides, spec=args.config)
    with tempfile.TemporaryDirectory(prefix="flexmarl-bench-learning-") as root:
        runs = {name: run_in_child(name, args, root) for name in names}
    result = summarize(runs, budget_s=args.budget_s, seed=args.seed)
    print_table(result)
    plot_path = args.plot or (os.path.splitext(args.json)[0] + ".png" if args.json else "learning.png")
    result["plot"] = plot(result, plot_path)
    print(f"plot: {result['plot']}")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
