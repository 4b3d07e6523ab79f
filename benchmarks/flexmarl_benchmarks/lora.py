"""`flexmarl bench lora`: N LoRA agents on one base against the same agents as full models, side by side.

For each N in `--agents` (default 3, 8, 15), with N adapters of rank `--rank` on every projection (B nonzero, as
after training), at a fixed decode batch of `--slots` sequences of `--new-tokens` tokens (EOS ignored):

  mixed_tokens_per_s      one engine whose table holds the N adapters, the batch's sequences spread over them
  base_tokens_per_s       the same engine code on the bare base, no adapters (the ceiling)
  separate_tokens_per_s   N full-model engines (each agent's merged weights), the batch split between them, each
                          stepping on its own thread, all sharing the same cores (N in `--separate`)
  train_step_s            one micro-batch (`--train-rows` x `--train-len`) accumulated and applied: an adapter's
                          trainer against a full fine-tune's, on one device
  sync                    one agent's weight sync staged through the StateStore onto the engine and swapped in
                          at the next step boundary: its adapter (into its spare row) against the whole model
  memory                  peak resident memory of a process holding the largest N's team (one engine, N LoRA
                          trainers on one base) against one holding one full-fine-tune agent, each process decoding
                          a batch and taking a training step per agent (`_lora_memory`; `--no-memory` skips it)

Timed windows hold steady iterations only: every engine and trainer is compiled and run once first, and the
compile seconds are reported apart. Each figure is the median of `--repeats`. The top level of the JSON carries
the issue's ratios: `mixed_vs_base_tokens_per_s` (N = 3, or the smallest N), `mixed15_vs_separate_engines_tokens_
per_s` (the largest N), `adapter_sync_speedup`, `adapter_sync_bytes_fraction` and `team15_peak_memory_vs_one_full_
agent` (the largest N's team; null with `--no-memory`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from flexmarl_benchmarks._output import write_json
from flexmarl_benchmarks._views import engine_config, lora_spec, optimizer_config, trainer_config
from flexmarl_jax.mesh.host_devices import without_fake_cpu_devices


def _default_model() -> str:
    """SmolLM2 where `flexmarl import-gguf` put it (docs/recipes.md), else the tiny preset."""
    path = os.path.join(os.environ.get("FLEXMARL_CHECKPOINTS", "checkpoints"), "SmolLM2-135M-Instruct")
    return path if os.path.isdir(path) else "tiny"


def _trained_adapters(model_config, spec, count: int, seed: int) -> list[dict]:
    """`count` adapters with B drawn small and nonzero (a new adapter, B = 0, would be the base exactly)."""
    import jax

    from flexmarl_jax.models.lora import init_adapters

    adapters = []
    for index in range(count):
        adapter = init_adapters(model_config, spec, seed=seed + index)
        key = jax.random.key(seed + 1000 + index)
        adapters.append({target: {"a": pair["a"], "b": 0.01 * jax.random.normal(jax.random.fold_in(key, i),
                                                                                   pair["b"].shape)}
                         for i, (target, pair) in enumerate(sorted(adapter.items()))})
    return adapters


def _requests(prompts, new_tokens: int, agents: list[str] | None = None):
    from flexmarl_jax.rollout.engine import SlotSampling
    from flexmarl_jax.rollout.loop import RolloutRequest

    return [RolloutRequest(prompt_ids=prompt, num_samples=1, sampling=SlotSampling(temperature=1.0, seed=index),
                           max_new_tokens=new_tokens, ignore_eos=True, agent=agents[index] if agents else "")
            for index, prompt in enumerate(prompts)]


def _loop_tokens_per_s(engine, params, prompts, rows, args) -> tuple[float, float]:
    """(median tokens/s over `repeats` runs of the whole batch, seconds of the untimed first run)."""
    from flexmarl_jax.rollout.loop import RolloutLoop

    started = time.perf_counter()
    engine.warm_up(params)
    RolloutLoop(engine, params).generate(_requests(prompts, args.new_tokens), rows)
    first = time.perf_counter() - started
    rates = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        RolloutLoop(engine, params).generate(_requests(prompts, args.new_tokens), rows)
        rates.append(len(prompts) * args.new_tokens / (time.perf_counter() - started))
    return statistics.median(rates), first


def _separate_tokens_per_s(model_config, graphdef, tokenizer, merged, prompts, args) -> tuple[float, float]:
    """N full-model instances, one per agent, the batch split between them, each on its own thread."""
    from flexmarl_jax.rollout.engine import FlexEngine
    from flexmarl_jax.rollout.instance import EngineInstance

    count = len(merged)
    shares = [prompts[index::count] for index in range(count)]
    config = engine_config(max_concurrent_decodes=max(len(share) for share in shares),
                           max_prefill_length=args.prompt_bucket, max_decode_length=args.new_tokens,
                           prefill_buckets=(args.prompt_bucket,), prefill_batch_sizes=(1, 4))
    engines = [FlexEngine(model_config, graphdef, config, tokenizer, params=params) for params in merged]
    instances = [EngineInstance(engine, params, name=f"agent{index}")
                 for index, (engine, params) in enumerate(zip(engines, merged, strict=True))]

    def run_all() -> float:
        threads = []
        for instance, share in zip(instances, shares, strict=True):
            for request in _requests(share, args.new_tokens):
                instance.submit(request)
            threads.append(threading.Thread(target=instance.run_until_idle, name=instance.name))
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return len(prompts) * args.new_tokens / (time.perf_counter() - started)

    started = time.perf_counter()
    for engine, params in zip(engines, merged, strict=True):
        engine.warm_up(params)
    run_all()
    first = time.perf_counter() - started
    return statistics.median(run_all() for _ in range(args.repeats)), first


def _train_step_s(model_config, initial, spec, args) -> tuple[float, float]:
    """(median seconds of one micro-batch accumulated and applied, seconds of the first, compiling one)."""
    import jax

    from flexmarl_jax.train.batch import build_micro_batch
    from flexmarl_jax.train.normalizers import IterationNormalizers
    from flexmarl_jax.train.trainer import AgentTrainer

    rows, response = args.train_rows, args.train_len // 2
    config = trainer_config(max_len=args.train_len + 1, micro_batch_size=rows, remat=True, lora=spec,
                            optimizer=optimizer_config(learning_rate=1e-5))
    trainer = AgentTrainer("agent", model_config, config, seed=0, initial=initial)
    batch = build_micro_batch(
        agent="agent", prompt_ids=[[3] * (args.train_len - response)] * rows, response_ids=[[4] * response] * rows,
        behaviour_logprobs=[[-1.0] * response] * rows, advantages=[1.0, -1.0] * (rows // 2) + [0.5] * (rows % 2),
        aggregation="token_mean", normalizers=IterationNormalizers.from_response_lengths([response] * rows,
                                                                                         norm_length=response),
        batch_size=rows, max_len=config.max_len)

    def step() -> float:
        started = time.perf_counter()
        trainer.accumulate(batch)
        trainer.apply()
        jax.block_until_ready(jax.tree.leaves(trainer.rollout_weights))
        return time.perf_counter() - started

    first = step()
    return statistics.median(step() for _ in range(args.repeats)), first


def _sync(instance, target, weights, version: int, agent: str | None) -> tuple[float, int]:
    """(seconds, bytes) of one weight sync onto `instance`: staged through a StateStore onto its devices (as a run
    does, orchestrator/weight_sync.py), then applied at its next step boundary."""
    import jax

    from flexmarl_jax.orchestrator.weight_sync import StoreWeightSync
    from flexmarl_jax.transfer import StateStore

    def push(name, staged, number):
        if agent is None:
            instance.update_params(staged, number)
        else:
            instance.update_agent_params(name, staged, number)

    sync = StoreWeightSync(StateStore(), push, target_for=lambda name: target)
    started = time.perf_counter()
    sync(agent or "agent", weights, version)
    instance.step()  # the step boundary that swaps it in
    seconds = time.perf_counter() - started
    return seconds, sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(weights))


def _sync_figures(model_config, graphdef, tokenizer, base, adapters, spec, args) -> dict:
    """Median seconds and bytes of an adapter sync (into a two-agent table's spare row) and a full sync."""
    import jax

    from flexmarl_jax.models.lora import AdaptedParams, AgentAdapter, adapter_table, merge_adapter
    from flexmarl_jax.rollout.engine import FlexEngine
    from flexmarl_jax.rollout.instance import EngineInstance

    config = engine_config(max_concurrent_decodes=4, max_prefill_length=args.prompt_bucket,
                           max_decode_length=args.new_tokens, prefill_buckets=(args.prompt_bucket,),
                           prefill_batch_sizes=(1,))
    rows = [adapters[0], adapters[0], adapters[1], adapters[1]]
    table = AdaptedParams(base, adapter_table(rows, [spec] * 4))
    grouped = EngineInstance(FlexEngine(model_config, graphdef, config, tokenizer, params=table), table,
                             adapter_agents=("a", "b"), name="group")
    merged = merge_adapter(base, adapters[0], spec)
    full = EngineInstance(FlexEngine(model_config, graphdef, config, tokenizer, params=merged), merged, name="full")
    host_adapters = [AgentAdapter(jax.tree.map(np.asarray, adapter), spec) for adapter in adapters[:2]]
    host_full = [jax.tree.map(np.asarray, merge_adapter(base, adapter, spec)) for adapter in adapters[:2]]
    target = jax.tree.leaves(merged)[0].sharding  # the engines' one device
    _sync(grouped, target, host_adapters[1], 1, "a")  # compiles the row write
    _sync(full, target, host_full[1], 1, None)
    adapter_runs = [_sync(grouped, target, host_adapters[k % 2], 2 + k, "a") for k in range(args.repeats)]
    full_runs = [_sync(full, target, host_full[k % 2], 2 + k, None) for k in range(args.repeats)]
    adapter_s, full_s = (statistics.median(s for s, _ in runs) for runs in (adapter_runs, full_runs))
    return {"adapter_s": adapter_s, "full_s": full_s, "adapter_bytes": adapter_runs[0][1],
            "full_bytes": full_runs[0][1], "speedup": full_s / adapter_s,
            "bytes_fraction": adapter_runs[0][1] / full_runs[0][1]}


def _peak_memory(args: argparse.Namespace, kind: str, agents: int) -> int:
    """Peak resident bytes of a process holding `kind` ("team" of `agents`, or "full": one agent), each in a
    process of its own (`_lora_memory`): a process's peak never goes down, so one process cannot measure both."""
    folder = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**without_fake_cpu_devices(os.environ),  # the side process fakes its own two devices
           "PYTHONPATH": os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))}
    spec = {"kind": kind, "model": args.model, "agents": agents, "rank": args.rank, "slots": args.slots,
            "new_tokens": args.new_tokens, "prompt_bucket": args.prompt_bucket}
    done = subprocess.run([sys.executable, "-m", "flexmarl_benchmarks._lora_memory", json.dumps(spec)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} memory process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return int(json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_bytes"])


def _memory_figures(args: argparse.Namespace) -> dict:
    team_agents = max(args.agents)
    team, full = _peak_memory(args, "team", team_agents), _peak_memory(args, "full", 1)
    return {"agents": team_agents, "team_peak_rss_bytes": team, "full_peak_rss_bytes": full,
            "team_vs_full": team / full}


def run(args: argparse.Namespace) -> dict:
    import jax

    from flexmarl_jax.models.functional import init_params
    from flexmarl_jax.models.lora import AdaptedParams, adapter_table, merge_adapter
    from flexmarl_jax.models.sources import resolve_model
    from flexmarl_jax.rollout.engine import FlexEngine

    source = resolve_model(args.model)
    model_config, tokenizer = source.model_config, source.tokenizer
    graphdef, base = source.initial_weights(dtype=np.float32) or init_params(model_config, seed=args.seed)
    spec = lora_spec(rank=args.rank, alpha=2.0 * args.rank)
    rng = np.random.default_rng(args.seed)
    prompts = [tuple(int(t) for t in rng.integers(3, min(model_config.vocab_size, 5000), size=int(n)))
               for n in rng.integers(args.prompt_bucket // 2, args.prompt_bucket + 1, size=args.slots)]
    config = engine_config(max_concurrent_decodes=args.slots, max_prefill_length=args.prompt_bucket,
                           max_decode_length=args.new_tokens, prefill_buckets=(args.prompt_bucket,),
                           prefill_batch_sizes=(1, 4))
    result = {"model": args.model, "slots": args.slots, "new_tokens": args.new_tokens, "rank": args.rank,
              "repeats": args.repeats, "agents": {}, "compile_s": {}}
    base_engine = FlexEngine(model_config, graphdef, config, tokenizer, params=base)
    base_rate, result["compile_s"]["base"] = _loop_tokens_per_s(base_engine, base, prompts, None, args)
    print(f"base: {base_rate:.1f} tokens/s", flush=True)
    for count in args.agents:
        adapters = _trained_adapters(model_config, spec, count, args.seed)
        table = AdaptedParams(base, adapter_table(adapters, [spec] * count))
        mixed_engine = FlexEngine(model_config, graphdef, config, tokenizer, params=table)
        rows = [index % count for index in range(len(prompts))]
        mixed_rate, compile_s = _loop_tokens_per_s(mixed_engine, table, prompts, rows, args)
        figures = {"mixed_tokens_per_s": mixed_rate, "base_tokens_per_s": base_rate,
                   "mixed_vs_base_tokens_per_s": mixed_rate / base_rate, "compile_s": compile_s}
        if count in args.separate:
            merged = [merge_adapter(base, adapter, spec) for adapter in adapters]
            separate_rate, figures["separate_compile_s"] = _separate_tokens_per_s(
                model_config, graphdef, tokenizer, merged, prompts, args)
            figures.update(separate_tokens_per_s=separate_rate,
                           mixed_vs_separate_tokens_per_s=mixed_rate / separate_rate)
            del merged
        result["agents"][str(count)] = figures
        print(f"N={count}: " + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()), flush=True)
        del mixed_engine, table
    lora_step, lora_first = _train_step_s(model_config, (graphdef, base), spec, args)
    full_step, full_first = _train_step_s(model_config, (graphdef, base), lora_spec(rank=0), args)
    result["train_step_s"] = {"adapter": lora_step, "full": full_step, "adapter_vs_full": lora_step / full_step,
                              "first_adapter": lora_first, "first_full": full_first}
    print(f"train step: adapter {lora_step:.2f} s, full {full_step:.2f} s", flush=True)
    result["sync"] = _sync_figures(model_config, graphdef, tokenizer, base,
                                   _trained_adapters(model_config, spec, 2, args.seed), spec, args)
    print("sync: " + ", ".join(f"{k} {v:.3g}" for k, v in result["sync"].items()), flush=True)
    if args.memory:
        result["memory"] = _memory_figures(args)
        print("memory: " + ", ".join(f"{k} {v:.4g}" for k, v in result["memory"].items()), flush=True)
    smallest, largest = str(min(args.agents)), str(max(args.agents))
    result.update(
        mixed_vs_base_tokens_per_s=result["agents"][str(3 if 3 in args.agents else min(args.agents))][
            "mixed_vs_base_tokens_per_s"],
        mixed15_vs_separate_engines_tokens_per_s=result["agents"][largest].get("mixed_vs_separate_tokens_per_s"),
        adapter_sync_speedup=result["sync"]["speedup"], adapter_sync_bytes_fraction=result["sync"]["bytes_fraction"],
        team15_peak_memory_vs_one_full_agent=result["memory"]["team_vs_full"] if args.memory else None,
        smallest_agents=int(smallest), largest_agents=int(largest),
        device=str(jax.devices()[0].platform))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flexmarl bench lora", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=_default_model(), help="checkpoint directory or preset (default: SmolLM2 "
                        "under $FLEXMARL_CHECKPOINTS when imported, else the tiny preset)")
    parser.add_argument("--agents", default="3,8,15", help="comma-separated team sizes N")
    parser.add_argument("--separate", default="3,15", help="the N that also run N separate full-model engines")
    parser.add_argument("--slots", type=int, default=64, help="decode batch (sequences in flight)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-bucket", type=int, default=32, help="prompt length (tokens, one bucket)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--train-rows", type=int, default=2)
    parser.add_argument("--train-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="leave out the peak-memory figure (two side processes, a minute or two each)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        args.agents = sorted({int(n) for n in args.agents.split(",")})
        args.separate = {int(n) for n in args.separate.split(",") if n}
    except ValueError:
        parser.error(f"--agents {args.agents!r} / --separate {args.separate!r}: comma-separated integers")
    if min(args.agents) < 1 or args.slots < max(args.agents):
        parser.error(f"--agents {args.agents} must be >= 1 and at most --slots {args.slots}")
    result = run(args)
    write_json(args.json, result)
    return 0
