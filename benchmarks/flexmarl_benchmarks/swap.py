"""`flexmarl bench swap`: packed vs per-leaf transfer, swap latency vs model size, pool utilization.

Three measurements, one run:

1. packed_vs_per_leaf_ratio: a Qwen2-structured model with >= 200 leaves (the "tiny" preset stretched to
   24 layers: 290 leaves, FSDP-sharded on a 4-device slice) moved by two StateStores, one packed and
   one leaf by leaf: swap-out (device -> host, memory freed), swap-in (host -> the slice) and weight
   sync (slice -> another slice, device to device). Packed and per-leaf cycles alternate; the ratio is
   the median over --repeats of per-leaf cycle seconds / packed cycle seconds; per-move ratios of
   medians are reported too.
2. swap: swap-out / swap-in seconds (packed, host tier) for Qwen2-structured parameter trees from tiny up
   to --max-params (default: Qwen2.5-0.5B shapes in bf16); zero-filled arrays, since data movement is what
   is measured. Storage-tier (Orbax) swaps for models up to --storage-max-params.
3. utilization_on_demand / utilization_static: training-pool utilization on the skewed chain workload
   (solver -> verifier -> corrector; the corrector sees ~30% of the queries). This is ACCOUNTING OVER
   MEASURED STEP TIMES, not a parallel run (fake CPU devices share the same cores): a discrete-event
   simulation where micro-batches arrive as long-tailed rollouts finish, each micro-batch costs the
   measured gradient-step time of the tiny model on a slice, each swap the measured swap time of its
   trainer state (params + Adam moments), and slices are leased through the real `TrainingSlicePool`.
   Static binding = one slice per agent; on-demand = --pool-slices shared slices (fewer than agents).
   Utilization = compute seconds / (slices x wall seconds).
4. orchestrator_utilization_on_demand / _static: the same comparison through the real JointOrchestrator
   (mesh.train_slices shared slices vs one per agent; see bench/_swap_orchestrated.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import statistics
import tempfile
import time
from collections import deque

from flexmarl_benchmarks import _swap_orchestrated
from flexmarl_benchmarks._output import write_json
from flexmarl_jax.mesh.host_devices import fake_cpu_devices

AGENT_SHARES = {"solver": 1.0, "verifier": 1.0, "corrector": 0.3}  # fraction of trajectories per agent
CHAIN = ("solver", "verifier", "corrector")




# ------------------------------------------------------------------------------------ models


def swap_sizes(max_params: float):
    """(label, ModelConfig, dtype name) from tiny to the largest preset under ``max_params``."""
    from flexmarl_jax.models.presets import get_preset

    tiny = get_preset("tiny")
    candidates = [
        ("tiny", tiny, "float32"),
        ("tiny-24L", dataclasses.replace(tiny, num_layers=24), "float32"),
        ("qwen-like-25M", dataclasses.replace(tiny, vocab_size=32000, hidden_size=256, intermediate_size=1024,
                                              num_layers=12, num_heads=4, num_kv_heads=2, head_dim=64),
         "float32"),
        ("qwen-like-150M", dataclasses.replace(tiny, vocab_size=32000, hidden_size=768,
                                               intermediate_size=2048, num_layers=14, num_heads=12,
                                               num_kv_heads=2, head_dim=64), "bfloat16"),
        ("qwen2.5-0.5b", get_preset("qwen2.5-0.5b"), "bfloat16"),
        ("qwen2.5-1.5b", get_preset("qwen2.5-1.5b"), "bfloat16"),
    ]
    chosen = []
    for label, config, dtype in candidates:
        params = config.num_params()
        if params <= max_params:
            chosen.append((label, config, dtype, params))
    return chosen


def zero_params(config, mesh, dtype: str):
    """A Qwen2-structured nnx.State of zeros, created sharded on ``mesh`` (FSDP by the model's rules)."""
    import jax
    import jax.numpy as jnp

    from flexmarl_jax.models import functional

    _, abstract = functional.abstract_model(config, dtype=jnp.dtype(dtype))
    shardings = functional.param_shardings(abstract, mesh)
    return jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract),
                   out_shardings=shardings)()


def slice_meshes(devices_per_slice: int, count: int):
    import jax

    from flexmarl_jax.mesh.meshes import make_mesh

    devices = jax.devices()
    if len(devices) < devices_per_slice * count:
        raise SystemExit(f"need {devices_per_slice * count} devices, JAX sees {len(devices)}")
    return [make_mesh(devices[i * devices_per_slice:(i + 1) * devices_per_slice], fsdp=devices_per_slice)
            for i in range(count)]


def _block(tree) -> None:
    import jax

    jax.block_until_ready([x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)])


# ------------------------------------------------------------------------ 1. packed vs per-leaf


def one_cycle(store, mesh_a, mesh_b) -> dict[str, float]:
    """Seconds of swap-out (a -> host, memory freed), swap-in (host -> a) and weight sync (a -> b copy)."""
    import jax

    start = time.perf_counter()
    store.evict("agent", "host")
    swap_out = time.perf_counter() - start
    start = time.perf_counter()
    _block(store.get("agent", mesh_a, move=True))
    swap_in = time.perf_counter() - start
    start = time.perf_counter()
    synced = store.get("agent", mesh_b)
    _block(synced)
    sync = time.perf_counter() - start
    for leaf in jax.tree.leaves(synced):
        leaf.delete()
    return {"swap_out": swap_out, "swap_in": swap_in, "sync": sync}


def measure_packing(repeats: int) -> dict:
    """Packed and per-leaf cycles interleaved (so load from other processes hits both alike).

    The headline ratio is the median over repeats of (per-leaf cycle seconds / packed cycle seconds),
    a cycle being swap-out + swap-in + weight sync; per-move medians are reported alongside.
    """
    import jax

    from flexmarl_jax.models.presets import get_preset
    from flexmarl_jax.transfer import StateStore

    config = dataclasses.replace(get_preset("tiny"), num_layers=24)
    mesh_a, mesh_b = slice_meshes(4, 2)
    stores = {"packed": StateStore(packed=True), "per_leaf": StateStore(packed=False)}
    for store in stores.values():
        store.set("agent", zero_params(config, mesh_a, "float32"))
    leaves = len(jax.tree.leaves(stores["packed"].get("agent")))
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in stores}
    for repeat in range(repeats + 1):  # the first cycle compiles; it is not counted
        order = list(stores) if repeat % 2 else list(reversed(stores))
        for name in order:
            cycle = one_cycle(stores[name], mesh_a, mesh_b)
            if repeat:
                samples[name].append(cycle)
    medians = {name: {move: statistics.median(c[move] for c in cycles) for move in cycles[0]}
               for name, cycles in samples.items()}
    packed, per_leaf = medians["packed"], medians["per_leaf"]
    # Each repeat runs a packed and a per-leaf cycle back to back, so their ratio sees the same machine
    # load; the median of these paired ratios is robust to load from other processes drifting.
    paired = [sum(slow.values()) / sum(fast.values())
              for slow, fast in zip(samples["per_leaf"], samples["packed"], strict=True)]
    return {
        "packed_vs_per_leaf_ratio": statistics.median(paired),
        "packed_vs_per_leaf_ratio_of_medians": sum(per_leaf.values()) / sum(packed.values()),
        "packed_vs_per_leaf_paired_ratios": paired,
        "packing_model": {"config": "tiny preset, 24 layers", "leaves": leaves,
                          "params": config.num_params(), "slice_devices": 4},
        "packed_s": packed,
        "per_leaf_s": per_leaf,
        "packed_vs_per_leaf": {name: per_leaf[name] / packed[name] for name in packed},
    }


# ------------------------------------------------------------------------------ 2. swap vs size


def measure_swaps(max_params: float, storage_max_params: float, repeats: int) -> dict:
    from flexmarl_jax.transfer import StateStore

    mesh_a, mesh_b = slice_meshes(4, 2)
    host_rows, storage_rows = [], []
    with tempfile.TemporaryDirectory() as storage_root:
        for label, config, dtype, params_count in swap_sizes(max_params):
            tiers = ["host"] + (["storage"] if params_count <= storage_max_params else [])
            for tier in tiers:
                store = StateStore(storage_root=storage_root)
                store.set("agent", zero_params(config, mesh_a, dtype))
                outs, ins = [], []
                # Alternate slices so a swap-in never finds the state in place; the first two cycles
                # compile the pack/unpack programs for each slice and are not counted.
                for repeat in range(repeats + 2):
                    start = time.perf_counter()
                    store.evict("agent", tier)
                    swap_out = time.perf_counter() - start
                    start = time.perf_counter()
                    _block(store.get("agent", mesh_b if repeat % 2 == 0 else mesh_a, move=True))
                    swap_in = time.perf_counter() - start
                    if repeat >= 2:
                        outs.append(swap_out)
                        ins.append(swap_in)
                row = {"model": label, "params": params_count, "dtype": dtype, "bytes": store.nbytes("agent"),
                       "swap_out_s": statistics.median(outs), "swap_in_s": statistics.median(ins)}
                store.delete("agent")
                (host_rows if tier == "host" else storage_rows).append(row)
    return {"swap": host_rows, "swap_storage": storage_rows}


# ------------------------------------------------------------------------------ 3. utilization


def measure_step_costs(micro_batch: int, seq_len: int, repeats: int) -> dict[str, float]:
    """Measured seconds of a gradient micro-batch, an Adam apply and a trainer-state swap (tiny model)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from flexmarl_jax.models import functional
    from flexmarl_jax.models.presets import get_preset
    from flexmarl_jax.transfer import StateStore

    config = get_preset("tiny")
    mesh_a, mesh_b = slice_meshes(2, 2)
    graphdef, params = functional.init_params(config, seed=0, mesh=mesh_a)
    optimizer = optax.adam(1e-4)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (micro_batch, seq_len)),
                         jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), tokens.shape)
    mask = jnp.ones(tokens.shape, bool)

    def loss(p):
        logits = functional.forward(graphdef, p, tokens, positions, mask)
        return -jnp.mean(functional.token_logprobs(logits[:, :-1], tokens[:, 1:]))

    grad_step = jax.jit(jax.grad(loss))
    apply_step = jax.jit(lambda p, g, s: optimizer.update(g, s, p))
    opt_state = optimizer.init(params)

    def timed(fn) -> float:
        _block(fn())
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            _block(fn())
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    grads = grad_step(params)
    micro_batch_s = timed(lambda: grad_step(params))
    apply_s = timed(lambda: apply_step(params, grads, opt_state))
    store = StateStore()
    store.set("trainer", {"params": params, "opt_state": opt_state, "accum": grads})
    outs, ins = [], []
    for repeat in range(repeats + 2):  # two uncounted cycles compile for both slices
        start = time.perf_counter()
        store.evict("trainer", "host")
        outs.append(time.perf_counter() - start)
        start = time.perf_counter()
        _block(store.get("trainer", mesh_b if repeat % 2 == 0 else mesh_a, move=True))
        ins.append(time.perf_counter() - start)
    return {"micro_batch_s": micro_batch_s, "apply_s": apply_s,
            "swap_out_s": statistics.median(outs[2:]), "swap_in_s": statistics.median(ins[2:])}


def micro_batch_arrivals(rng, queries: int, trajectories: int, micro_batch: int, stage_median_s: float):
    """Per agent, sorted arrival offsets of its micro-batches in one iteration (long-tailed rollouts).

    Every trajectory runs solver -> verifier -> (corrector with probability AGENT_SHARES["corrector"]);
    each stage takes a lognormal time (median ``stage_median_s``, sigma 1: a long tail). An agent's
    micro-batch arrives when its ``micro_batch``-th sample since the last one completes; a final partial
    micro-batch arrives with the agent's last sample.
    """
    import numpy as np

    done: dict[str, list[float]] = {agent: [] for agent in CHAIN}
    for _ in range(queries * trajectories):
        clock = 0.0
        for agent in CHAIN:
            if rng.random() >= AGENT_SHARES[agent]:
                break
            clock += float(rng.lognormal(np.log(stage_median_s), 1.0))
            done[agent].append(clock)
    arrivals = {}
    for agent, times in done.items():
        times.sort()
        arrivals[agent] = [times[min(i + micro_batch, len(times)) - 1]
                           for i in range(0, len(times), micro_batch)]
    return arrivals


def simulate(binding: dict, clock: list[float], costs: dict, iterations: list[dict]) -> dict:
    """Discrete-event run of the training side over ``iterations`` (micro-batch arrival offsets per agent).

    binding: agent -> TrainingSlicePool (one shared pool = on-demand; one pool per agent = static). Each
    pool's clock must read ``clock[0]``. Returns wall, compute and swap seconds and the slice count.
    """
    pools = list({id(pool): pool for pool in binding.values()}.values())
    parked: dict[tuple[int, int], str] = {}  # (pool id, slice) -> agent whose state sits there
    where: dict[str, tuple[int, int] | None] = {agent: None for agent in CHAIN}
    compute_s = swap_s = 0.0
    swaps = 0
    now = 0.0
    for arrivals in iterations:
        start = now
        events: list = []
        sequence = 0
        for agent, offsets in arrivals.items():
            for offset in offsets:
                heapq.heappush(events, (start + offset, sequence, "arrive", agent))
                sequence += 1
        pending: deque = deque()
        running: set[str] = set()
        left = sum(len(offsets) for offsets in arrivals.values())
        applying = False
        while events:
            now, _, kind, agent = heapq.heappop(events)
            clock[0] = now
            if kind == "arrive":
                pending.append((agent, "micro_batch"))
            else:
                running.discard(agent)
                binding[agent].release(agent)
                if kind == "micro_batch":
                    left -= 1
                if left == 0 and not applying:  # every micro-batch consumed: all agents apply together
                    applying = True
                    pending.extend((a, "apply") for a in CHAIN)
            for item in list(pending):  # first come first served, one slice per agent at a time
                agent_name, work = item
                if agent_name in running:
                    continue
                lease = binding[agent_name].try_acquire(agent_name)
                if lease is None:
                    continue
                pending.remove(item)
                running.add(agent_name)
                spot = (id(binding[agent_name]), lease.slice.index)
                swap = 0.0
                if where[agent_name] != spot:
                    resident = parked.get(spot)
                    if resident is not None:
                        swap += costs["swap_out_s"]
                        where[resident] = None
                    if where[agent_name] is not None:
                        parked.pop(where[agent_name], None)
                    swap += costs["swap_in_s"]
                    swaps += 1
                    parked[spot] = agent_name
                    where[agent_name] = spot
                cost = costs["micro_batch_s"] if work == "micro_batch" else costs["apply_s"]
                compute_s += cost
                swap_s += swap
                heapq.heappush(events, (now + swap + cost, sequence, work, agent_name))
                sequence += 1
    slices = sum(pool.num_slices for pool in pools)
    held = sum(sum(pool.busy_seconds(0.0, now)) for pool in pools)
    return {"wall_s": now, "compute_s": compute_s, "swap_s": swap_s, "swaps": swaps, "slices": slices,
            "utilization": compute_s / (slices * now), "held_utilization": held / (slices * now)}


def measure_utilization(args) -> dict:
    import numpy as np

    from flexmarl_jax.train.slice_pool import TrainingSlicePool

    costs = measure_step_costs(args.micro_batch, args.seq_len, args.repeats)
    stage_median_s = args.rollout_ratio * costs["micro_batch_s"]
    rng = np.random.default_rng(args.seed)
    iterations = [micro_batch_arrivals(rng, args.queries, args.trajectories, args.micro_batch, stage_median_s)
                  for _ in range(args.iterations)]
    meshes = slice_meshes(1, len(CHAIN))
    clock = [0.0]
    shared = TrainingSlicePool(meshes[:args.pool_slices], clock=lambda: clock[0])
    on_demand = simulate({agent: shared for agent in CHAIN}, clock, costs, iterations)
    clock[0] = 0.0
    static_binding = {agent: TrainingSlicePool([mesh], clock=lambda: clock[0])
                      for agent, mesh in zip(CHAIN, meshes, strict=True)}
    static = simulate(static_binding, clock, costs, iterations)
    micro_batches = {agent: sum(len(it[agent]) for it in iterations) for agent in CHAIN}
    return {
        "utilization_on_demand": on_demand["utilization"],
        "utilization_static": static["utilization"],
        "utilization_method": "accounting over measured step times "
                              "(discrete-event simulation, not a parallel run)",
        "measured_costs_s": costs,
        "workload": {"chain": list(CHAIN), "shares": AGENT_SHARES, "queries_per_iteration": args.queries,
                     "trajectories_per_query": args.trajectories, "micro_batch": args.micro_batch,
                     "iterations": args.iterations, "stage_median_s": stage_median_s,
                     "rollout_ratio": args.rollout_ratio, "micro_batches": micro_batches},
        "on_demand": on_demand,
        "static": static,
    }


# ---------------------------------------------------------------------------------------- main


def print_tables(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 110))
    packing = Table(title=f"packed vs per-leaf ({result['packing_model']['leaves']} leaves, "
                          f"{result['packing_model']['params']:,} params, 4-device slice)")
    for header in ("move", "per-leaf ms", "packed ms", "per-leaf / packed"):
        packing.add_column(header, justify="right")
    for name in ("swap_out", "swap_in", "sync"):
        packing.add_row(name, f"{result['per_leaf_s'][name] * 1e3:.1f}",
                        f"{result['packed_s'][name] * 1e3:.1f}", f"{result['packed_vs_per_leaf'][name]:.1f}x")
    packing.add_row("cycle", f"{sum(result['per_leaf_s'].values()) * 1e3:.1f}",
                    f"{sum(result['packed_s'].values()) * 1e3:.1f}",
                    f"{result['packed_vs_per_leaf_ratio_of_medians']:.1f}x")
    packing.add_row("cycle, median of paired ratios", "", "", f"{result['packed_vs_per_leaf_ratio']:.1f}x")
    console.print(packing)
    swaps = Table(title="swap latency vs model size (packed; host tier, then Orbax storage tier)")
    for header in ("tier", "model", "params", "dtype", "MB", "swap-out s", "swap-in s", "GB/s in"):
        swaps.add_column(header, justify="right")
    for tier, rows in (("host", result["swap"]), ("storage", result["swap_storage"])):
        for row in rows:
            swaps.add_row(tier, row["model"], f"{row['params']:,}", row["dtype"],
                          f"{row['bytes'] / 2**20:.0f}",
                          f"{row['swap_out_s']:.3f}", f"{row['swap_in_s']:.3f}",
                          f"{row['bytes'] / 2**30 / row['swap_in_s']:.2f}")
    console.print(swaps)
    utilization = Table(title="training-pool utilization, skewed chain (accounting over measured step times)")
    for header in ("binding", "slices", "utilization", "held", "wall s", "compute s", "swaps", "swap s"):
        utilization.add_column(header, justify="right")
    for name in ("static", "on_demand"):
        row = result[name]
        utilization.add_row(name, str(row["slices"]), f"{row['utilization']:.1%}",
                            f"{row['held_utilization']:.1%}",
                            f"{row['wall_s']:.2f}", f"{row['compute_s']:.2f}", str(row["swaps"]),
                            f"{row['swap_s']:.2f}")
    console.print(utilization)
    console.print(f"on-demand / static utilization: "
                  f"{result['utilization_on_demand'] / result['utilization_static']:.2f}x")
    if "orchestrator_utilization" in result:
        _swap_orchestrated.add_table(console, result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flexmarl bench swap", description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the result object here")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices (if JAX is not initialised)")
    parser.add_argument("--repeats", type=int, default=15, help="timed repetitions per measurement (median)")
    parser.add_argument("--max-params", type=float, default=6e8, help="largest model in the swap sweep")
    parser.add_argument("--storage-max-params", type=float, default=2e8,
                        help="largest model also swapped through Orbax storage")
    parser.add_argument("--queries", type=int, default=64, help="queries per iteration")
    parser.add_argument("--trajectories", type=int, default=4, help="trajectories per query")
    parser.add_argument("--micro-batch", type=int, default=16, help="samples per micro-batch")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sample in the measured step")
    parser.add_argument("--iterations", type=int, default=3, help="simulated iterations")
    parser.add_argument("--pool-slices", type=int, default=2, help="shared slices for on-demand binding")
    parser.add_argument("--rollout-ratio", type=float, default=10.0,
                        help="median rollout stage time / measured micro-batch step time")
    parser.add_argument("--seed", type=int, default=0)
    _swap_orchestrated.add_arguments(parser)
    args = parser.parse_args(argv)
    if not 1 <= args.pool_slices <= len(CHAIN):
        parser.error(f"--pool-slices={args.pool_slices} must be in 1..{len(CHAIN)} "
                     f"(agents: {', '.join(CHAIN)})")
    fake_cpu_devices(args.devices)

    started = time.perf_counter()
    result = measure_packing(args.repeats)
    result.update(measure_swaps(args.max_params, args.storage_max_params, max(1, args.repeats // 5)))
    result.update(measure_utilization(args))
    if args.orchestrator_iterations > 0:
        result.update(_swap_orchestrated.measure_orchestrator_utilization(args))
    result["seconds"] = time.perf_counter() - started
    print_tables(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
