"""Training-pool utilization measured through the real JointOrchestrator (part of `flexmarl bench swap`).

The skewed chain workload (solver -> verifier -> corrector, the corrector runs only for rejected answers)
with scripted long-tailed rollouts and real tiny-model trainers, run twice with the same seeds: static
binding (one training slice per agent) and on-demand (S shared slices, `mesh.train_slices`). Utilization
per run = seconds the trainers spent computing (gradient micro-batches and updates, blocked until done)
/ (slices x wall seconds), over the iterations after a first, compiling one. On fake CPU devices all
slices share the same cores, so this is the orchestrator's accounting of real step times, not a measure
of parallel hardware.
"""

from __future__ import annotations

CHAIN = ("solver", "verifier", "corrector")


def _build(num_slices: int, args):
    import jax

    from flexmarl_jax.config import RolloutConfig, RunConfig, TrainConfig, WorkflowConfig
    from flexmarl_jax.mesh.meshes import make_mesh
    from flexmarl_jax.metrics import Timeline
    from flexmarl_jax.models.tokenizer import CharTokenizer
    from flexmarl_jax.orchestrator.agents import agent_layout, build_agent_runtimes, pool_training
    from flexmarl_jax.orchestrator.pipeline import JointOrchestrator
    from flexmarl_jax.orchestrator.run import pipeline_settings
    from flexmarl_jax.store import ExperienceStore
    from flexmarl_jax.train.algorithms import loss_config_for
    from flexmarl_jax.workflows import ArithmeticTask, ScriptedAgent, ScriptedBackend, build_workflow
    from flexmarl_jax.workflows.oracles import chain_policies
    from flexmarl_jax.workflows.scripted import long_tail_latency

    # The chain team (configs/tiny.py's agents); trainers pad to 26 + 6 = 32 tokens.
    config = RunConfig(
        seed=args.seed, rollout=RolloutConfig(max_prompt_length=26, max_response_length=6),
        workflow=WorkflowConfig(queries_per_iteration=args.orchestrator_queries, samples_per_query=4),
        train=TrainConfig(learning_rate=1e-3, micro_batch_size=args.orchestrator_micro_batch))
    meshes = [make_mesh(jax.devices()[i:i + 1], fsdp=1) for i in range(len(CHAIN))]
    # Built without engines (the scripted backend below answers for the agents), each on its own mesh.
    runtimes = build_agent_runtimes(config, agent_layout(config), train_meshes=dict(zip(CHAIN, meshes, strict=True)))
    timeline = Timeline()
    training, runtimes = pool_training(runtimes, meshes[:num_slices], clock=timeline.now)
    task = ArithmeticTask(max_digits=1, operators="+")
    problems = [p for seed in range(500) for p in task.generate(args.orchestrator_queries, seed=seed)]
    policies = chain_policies(problems, task.verify, solver_accuracy=0.5, verifier_accuracy=0.8,
                              corrector_accuracy=0.6)
    latency = long_tail_latency(args.orchestrator_latency_s, 10 * args.orchestrator_latency_s, 0.15)
    tokenizer = CharTokenizer()
    backend = ScriptedBackend({agent: ScriptedAgent(policies[agent], latency) for agent in CHAIN}, seed=args.seed,
                              encode=lambda text: tokenizer.encode(text, add_bos=False))
    loss = loss_config_for(config.train.algorithm)
    orchestrator = JointOrchestrator(
        pipeline_settings(config), agents=runtimes, training=training,
        store=ExperienceStore.open(None, agents=CHAIN, backend="memory"),
        workflow=build_workflow("chain", agents=CHAIN), task=task, backend=backend,
        sync_weights=lambda agent, params, version: backend.set_policy_version(agent, version),
        aggregation=loss.aggregation, estimator=loss.advantage_estimator, timeline=timeline)
    return orchestrator, backend


def run_binding(num_slices: int, args) -> dict:
    """Runs 1 + --orchestrator-iterations iterations; sums the train-pool records of all but the first."""
    orchestrator, backend = _build(num_slices, args)
    records = []
    try:
        for iteration in range(1 + args.orchestrator_iterations):
            records.append(orchestrator.run_iteration(iteration))
    finally:
        backend.shutdown()
    timed = records[1:]
    wall = sum(r["e2e_s"] for r in timed)
    busy = sum(r["train_pool"]["busy_s"] for r in timed)
    slices = timed[-1]["train_pool"]["slices"]
    result = {"slices": slices, "wall_s": wall, "compute_s": busy, "utilization": busy / (slices * wall),
              "micro_batches": {a: sum(r["agent"][a]["micro_batches"] for r in timed) for a in CHAIN}}
    if num_slices:
        pool = timed[-1]["train_pool"]
        result["held_utilization"] = sum(r["train_pool"]["held"] * r["e2e_s"] for r in timed) / wall
        result.update({key: pool[key] for key in ("activations", "reused", "swapped_in", "swapped_out",
                                                  "swap_in_s", "swap_out_s")})
    return result


def measure_orchestrator_utilization(args) -> dict:
    static = run_binding(0, args)
    on_demand = run_binding(args.pool_slices, args)
    return {
        "orchestrator_utilization_on_demand": on_demand["utilization"],
        "orchestrator_utilization_static": static["utilization"],
        "orchestrator_utilization": {
            "method": "JointOrchestrator, scripted long-tailed chain rollouts, real tiny-model trainers; "
                      "compute seconds / (slices x wall), first (compiling) iteration excluded",
            "queries_per_iteration": args.orchestrator_queries, "samples_per_query": 4,
            "micro_batch": args.orchestrator_micro_batch, "iterations": args.orchestrator_iterations,
            "static": static, "on_demand": on_demand},
    }


def add_arguments(parser) -> None:
    parser.add_argument("--orchestrator-iterations", type=int, default=3,
                        help="timed orchestrator iterations per binding (0 skips the orchestrator run)")
    parser.add_argument("--orchestrator-queries", type=int, default=8, help="queries per orchestrator iteration")
    parser.add_argument("--orchestrator-micro-batch", type=int, default=8, help="orchestrator micro-batch size")
    parser.add_argument("--orchestrator-latency-s", type=float, default=0.02,
                        help="median scripted latency of one agent call (the tail is 10x)")


def add_table(console, result: dict) -> None:
    from rich.table import Table

    runs = result["orchestrator_utilization"]
    table = Table(title="training-pool utilization through the real orchestrator (skewed chain)")
    for header in ("binding", "slices", "utilization", "held", "wall s", "compute s", "swaps in"):
        table.add_column(header, justify="right")
    for name in ("static", "on_demand"):
        row = runs[name]
        held = f"{row['held_utilization']:.1%}" if "held_utilization" in row else "100% (bound)"
        table.add_row(name, str(row["slices"]), f"{row['utilization']:.1%}", held, f"{row['wall_s']:.2f}",
                      f"{row['compute_s']:.2f}", str(row.get("swapped_in", 0)))
    console.print(table)
    ratio = result["orchestrator_utilization_on_demand"] / max(result["orchestrator_utilization_static"], 1e-12)
    console.print(f"orchestrator: on-demand / static utilization: {ratio:.2f}x")
