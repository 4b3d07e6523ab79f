"""`flexmarl bench workflows`: dependency-driven vs stage-by-stage execution of the same multi-agent batch.

Scripted agents (no models) answer with set accuracies and long-tailed latencies: most calls take
`--base-ms`, a fraction `--tail-prob` take `--tail-ms`. Each call's latency is drawn from an RNG seeded by
its request id, so both modes see exactly the same latencies and produce identical experience; the only
difference is scheduling. Stage-by-stage waits for the batch's slowest call at every DAG level;
dependency-driven issues each call as soon as its own trajectory's inputs exist.

JSON keys:
  dependency_driven_speedup   total staged wall time / total dependency-driven wall time over all repeats
  agent_request_share         agent -> fraction of agent calls (one per completion = per store row)
  ideal_speedup               the same ratio from the scripted latencies alone (no scheduling overhead);
                              ideal_staged_s / ideal_dependency_s are its totals
  staged_s, dependency_s      per-repeat wall times
  load                        per-agent requests/calls/skipped/tokens, summed over dependency-driven batches
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

from flexmarl_benchmarks._output import write_json
from flexmarl_jax.workflows.builtin import build_workflow
from flexmarl_jax.workflows.executor import RunResult, WorkflowExecutor
from flexmarl_jax.workflows.oracles import PromptOracle, answer_policy, chain_policies
from flexmarl_jax.workflows.records import InMemorySink
from flexmarl_jax.workflows.scripted import RequestEvent, ScriptedAgent, ScriptedBackend, long_tail_latency
from flexmarl_jax.workflows.tasks import build_task


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flexmarl bench workflows", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the result object here")
    parser.add_argument("--workflow", default="chain", choices=["chain", "debate", "mixture"])
    parser.add_argument("--task", default="arithmetic", choices=["arithmetic", "countdown", "reverse"])
    parser.add_argument("--queries", type=int, default=16, help="queries per batch (configs/tiny.py: 16)")
    parser.add_argument("--samples", type=int, default=4, help="trajectories per query (the GRPO group size)")
    parser.add_argument("--repeats", type=int, default=5, help="batches per mode (fresh seeds)")
    parser.add_argument("--base-ms", type=float, default=2.0, help="typical call latency")
    parser.add_argument("--tail-ms", type=float, default=60.0, help="straggler call latency")
    parser.add_argument("--tail-prob", type=float, default=0.08, help="fraction of calls that straggle")
    parser.add_argument("--workers", type=int, default=256, help="scripted backend concurrency")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_backend(workflow, task, problems, args: argparse.Namespace, seed: int) -> ScriptedBackend:
    latency = long_tail_latency(args.base_ms / 1e3, args.tail_ms / 1e3, args.tail_prob)
    if args.workflow == "chain":
        policies = chain_policies(problems, task.verify)
    else:
        oracle = PromptOracle(problems)
        policies = {agent: answer_policy(oracle, 0.6) for agent in workflow.agents}
    agents = {agent: ScriptedAgent(policies[agent], latency) for agent in workflow.agents}
    return ScriptedBackend(agents, max_workers=args.workers, seed=seed)


def ideal_times(events: list[RequestEvent], workflow, result: RunResult) -> tuple[float, float]:
    """(staged, dependency-driven) makespans from pure call durations, with zero scheduling overhead."""
    duration = {event.request_id: event.finished_at - event.started_at for event in events}
    calls = {(call.input_id, call.trajectory_ids[0], call.node): call for call in result.timeline}
    per_level: dict[int, float] = {}
    finish: dict[tuple[str, int, str], float] = {}
    for trajectory in result.trajectories:
        for node in workflow.order:
            key = (trajectory.input_id, trajectory.trajectory_id, node)
            if key not in calls:
                continue
            agent, turn = workflow.nodes[node].agent, workflow.turn[node]
            took = duration[f"{agent}/{trajectory.input_id}_{turn}_{trajectory.trajectory_id}"]
            level = workflow.level[node]
            per_level[level] = max(per_level.get(level, 0.0), took)
            ready = max((finish[(key[0], key[1], u)] for u in workflow.upstream[node]), default=0.0)
            finish[key] = ready + took
    return sum(per_level.values()), max(finish.values())


def run(args: argparse.Namespace) -> dict:
    workflow = build_workflow(args.workflow)
    task = build_task(args.task)
    times = {"staged": [], "dependency": []}
    ideal = {"staged": 0.0, "dependency": 0.0}
    load: dict[str, dict[str, int]] = {agent: {} for agent in workflow.agents}
    accuracy = []
    for repeat in range(args.repeats):
        problems = task.generate(args.queries, seed=args.seed + repeat)
        with make_backend(workflow, task, problems, args, seed=args.seed + repeat) as backend:
            # Alternate which mode goes first so warm-up effects do not favour one side.
            modes = ("staged", "dependency") if repeat % 2 == 0 else ("dependency", "staged")
            for mode in modes:
                executor = WorkflowExecutor(
                    workflow, backend, task, samples_per_query=args.samples, mode=mode
                )
                result = executor.run(problems, InMemorySink())
                times[mode].append(result.wall_time_s)
                if mode == "dependency":
                    for agent, agent_load in result.load.items():
                        for key, value in dataclasses.asdict(agent_load).items():
                            load[agent][key] = load[agent].get(key, 0) + value
                    accuracy.append(result.accuracy)
                    # Events of this mode only: both modes issue identical request ids and latencies.
                    staged_ideal, dependency_ideal = ideal_times(backend.events, workflow, result)
                    ideal["staged"] += staged_ideal
                    ideal["dependency"] += dependency_ideal
    total_calls = sum(agent_load["calls"] for agent_load in load.values())
    return {
        "dependency_driven_speedup": sum(times["staged"]) / sum(times["dependency"]),
        "agent_request_share": {agent: load[agent]["calls"] / total_calls for agent in load},
        "ideal_speedup": ideal["staged"] / ideal["dependency"],
        "ideal_staged_s": ideal["staged"],
        "ideal_dependency_s": ideal["dependency"],
        "staged_s": times["staged"],
        "dependency_s": times["dependency"],
        "median_staged_s": statistics.median(times["staged"]),
        "median_dependency_s": statistics.median(times["dependency"]),
        "final_answer_accuracy": statistics.mean(accuracy),
        "load": load,
        "config": {key: value for key, value in vars(args).items() if key != "json"},
    }


def print_report(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title="workflows: dependency-driven vs stage-by-stage (same batches, same latencies)")
    for column in ("mode", "median wall s", "total wall s", "ideal total s", "speedup (staged / this)"):
        table.add_column(column, justify="right")
    staged_total, dependency_total = sum(result["staged_s"]), sum(result["dependency_s"])
    for mode, total in (("staged", staged_total), ("dependency", dependency_total)):
        table.add_row(
            mode,
            f"{result[f'median_{mode}_s']:.3f}",
            f"{total:.3f}",
            f"{result[f'ideal_{mode}_s']:.3f}",
            f"{staged_total / total:.2f}x",
        )
    table.add_row("ideal (latencies only)", "", "", "", f"{result['ideal_speedup']:.2f}x")
    console.print(table)
    agents = Table(title="per-agent load (all dependency-driven batches)")
    for column in ("agent", "requests", "calls", "skipped", "prompt tok", "completion tok", "call share"):
        agents.add_column(column, justify="right")
    for agent, load in result["load"].items():
        agents.add_row(
            agent,
            str(load["requests"]),
            str(load["calls"]),
            str(load["skipped"]),
            str(load["prompt_tokens"]),
            str(load["completion_tokens"]),
            f"{result['agent_request_share'][agent]:.1%}",
        )
    console.print(agents)
    console.print(
        f"dependency_driven_speedup = {result['dependency_driven_speedup']:.2f}  "
        f"(final-answer accuracy of the scripted agents {result['final_answer_accuracy']:.2f})"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for name in ("queries", "samples", "repeats", "workers"):
        if getattr(args, name) < 1:
            print(f"flexmarl bench workflows: --{name}={getattr(args, name)} must be >= 1", file=sys.stderr)
            return 2
    result = run(args)
    print_report(result)
    write_json(args.json, result)
    return 0
