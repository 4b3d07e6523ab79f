"""Trainer benchmark: exactness and cost of micro-batch accumulation, throughput, toy GRPO learning.

    flexmarl bench train --json out.json

Measured side by side in one process on the same data and initial weights:
  * microbatch_grad_rel_err: max over k in {2, 4, 8} of ||g_k - g_full|| / ||g_full||, where g_k is
    the gradient accumulated over k micro-batches of an iteration with an uneven sample count (the
    last micro-batch is partly padding) and the k3 KL on, and g_full the one-micro-batch gradient.
  * params_rel_err: parameters after one iteration (k=4 vs full batch).
  * accumulation_overhead_ratio: median time of (4 x accumulate + apply) / (1 x accumulate + apply)
    for the same global batch, runs interleaved.
  * tokens_per_s: real (non-padding) tokens of the global batch per second of the k=4 iteration.
  * grpo_*: single-agent GRPO on the toy repeat-the-char task, mean reward of the first and last
    iterations for each seed.
  * packed_vs_padded_tokens_per_s: real tokens/s of an iteration with `train.pack_rows` (train/packing.py)
    against the same iteration padded, on long-tailed responses (log-normal around `--packing-median` tokens,
    capped at `--packing-max-len`), runs interleaved, medians; with the packed gradient's relative error against
    the padded one and both batches' padding fractions (under `packing`).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np

from flexmarl_benchmarks._output import write_json
from flexmarl_benchmarks._views import optimizer_config, trainer_config

logger = logging.getLogger(__name__)


def _rows(num_samples: int, max_len: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts, responses = [], []
    for _ in range(num_samples):
        prompt_len = int(rng.integers(2, max_len // 4 + 1))
        response_len = int(rng.integers(max_len // 4, max_len + 1 - prompt_len + 1))
        prompts.append(rng.integers(3, 100, size=prompt_len).tolist())
        responses.append(rng.integers(3, 100, size=response_len).tolist())
    return dict(prompt_ids=prompts, response_ids=responses,
                behaviour_logprobs=[(-4.6 + 0.1 * rng.normal(size=len(r))).tolist() for r in responses],
                advantages=rng.normal(size=num_samples).tolist())


def _long_tailed_rows(num_samples: int, max_len: int, median: int, seed: int) -> dict:
    """Rows whose response lengths are log-normal around `median` (sigma 1, as RL responses' long tail), capped so
    prompt + response fit `max_len`; prompts of 8-32 tokens."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 100, size=int(rng.integers(8, 33))).tolist() for _ in range(num_samples)]
    sizes = np.clip(np.round(median * np.exp(rng.normal(size=num_samples))), 1, None).astype(int)
    responses = [rng.integers(3, 100, size=int(min(n, max_len + 1 - len(p)))).tolist()
                 for n, p in zip(sizes, prompts, strict=True)]
    return dict(prompt_ids=prompts, response_ids=responses,
                behaviour_logprobs=[(-4.6 + 0.1 * rng.normal(size=len(r))).tolist() for r in responses],
                advantages=rng.normal(size=num_samples).tolist())


def _packing(args, model_config, mesh, initial, loss, optimizer) -> dict:
    """Packed against padded training of one long-tailed iteration, side by side (see the module docstring)."""
    from flexmarl_jax.train.batch import build_iteration
    from flexmarl_jax.train.packing import pack_micro_batch, padding_fraction
    from flexmarl_jax.train.trainer import AgentTrainer

    micro, max_len = args.packing_micro_batch, args.packing_max_len
    rows = _long_tailed_rows(args.batch, max_len, args.packing_median, seed=3)
    batches = build_iteration(agent="bench", aggregation=loss.aggregation, micro_batch_size=micro, max_len=max_len,
                              **rows)
    trainers = {pack: AgentTrainer("bench", model_config, trainer_config(
        micro_batch_size=micro, max_len=max_len, loss=loss, optimizer=optimizer, pack_rows=pack), mesh=mesh,
        initial=initial) for pack in (False, True)}
    for batch in batches:  # the gradients of the same weights, before any update
        for trainer in trainers.values():
            trainer.accumulate(batch)
    grad_rel_err = _rel_err(trainers[True].accumulated_gradients(), trainers[False].accumulated_gradients())
    compile_s = {}
    for pack, trainer in trainers.items():
        started = time.perf_counter()
        trainer.apply()
        _iteration(trainer, batches)  # every shape compiled (first pass above), so this one is steady too
        compile_s["packed" if pack else "padded"] = time.perf_counter() - started
    times = {False: [], True: []}
    for _ in range(args.repeats):
        for pack, trainer in trainers.items():
            started = time.perf_counter()
            _iteration(trainer, batches)
            times[pack].append(time.perf_counter() - started)
    real = int(sum(np.asarray(b.attention_mask).sum() for b in batches))
    padded_s, packed_s = statistics.median(times[False]), statistics.median(times[True])
    packed = [pack_micro_batch(b, trainers[True]._bin_counts()) for b in batches]
    return {"micro_batch_size": micro, "max_len": max_len, "median_response": args.packing_median,
            "real_tokens": real, "padded_rows": sum(b.shape[0] for b in batches),
            "padded_positions": sum(b.shape[0] * b.shape[1] for b in batches),
            "packed_rows": sum(b.shape[0] for b in packed),
            "packed_positions": sum(b.shape[0] * b.shape[1] for b in packed),
            "padded_padding_fraction": float(np.mean([padding_fraction(b) for b in batches])),
            "packed_padding_fraction": float(np.mean([padding_fraction(b) for b in packed])),
            "padded_iteration_s": padded_s, "packed_iteration_s": packed_s,
            "padded_tokens_per_s": real / padded_s, "packed_tokens_per_s": real / packed_s,
            "grad_rel_err": grad_rel_err, "untimed_s": compile_s}


def _rel_err(a, b) -> float:
    import jax

    a = [np.asarray(x, np.float64) for x in jax.device_get(jax.tree.leaves(a))]
    b = [np.asarray(y, np.float64) for y in jax.device_get(jax.tree.leaves(b))]
    num = sum(float(np.sum((x - y) ** 2)) for x, y in zip(a, b, strict=True))
    return (num / sum(float(np.sum(y**2)) for y in b)) ** 0.5


def _iteration(trainer, batches) -> dict:
    for batch in batches:
        trainer.accumulate(batch)
    return trainer.apply()


def run(args) -> dict:
    import jax

    from flexmarl_jax.mesh.meshes import make_mesh
    from flexmarl_jax.models import functional
    from flexmarl_jax.models.presets import get_preset
    from flexmarl_jax.train.algorithms import loss_config_for
    from flexmarl_jax.train.batch import build_iteration
    from flexmarl_jax.train.toy import run_grpo
    from flexmarl_jax.train.trainer import AgentTrainer

    model_config = get_preset(args.model)
    devices = jax.devices()[: args.fsdp * args.tp]
    mesh = make_mesh(devices, fsdp=args.fsdp, tp=args.tp)
    initial = functional.init_params(model_config, seed=0, mesh=mesh)
    loss = loss_config_for("grpo", aggregation="token_mean", kl_coef=0.05)
    optimizer = optimizer_config(name="adam", learning_rate=1e-3, eps=1e-6, max_grad_norm=None)
    batch_size = args.batch

    def trainer(micro: int) -> AgentTrainer:
        config = trainer_config(micro_batch_size=micro, max_len=args.max_len, loss=loss, optimizer=optimizer)
        return AgentTrainer("bench", model_config, config, mesh=mesh, initial=initial)

    def batches(rows, micro):
        return build_iteration(agent="bench", aggregation=loss.aggregation, micro_batch_size=micro,
                               max_len=args.max_len, **rows)

    results: dict = {"model": args.model, "mesh": {"fsdp": args.fsdp, "tp": args.tp},
                     "global_batch": batch_size, "max_len": args.max_len, "backend": jax.default_backend()}

    # --- exactness: uneven sample count (last micro-batch partly padding), KL on
    uneven = _rows(batch_size - 3, args.max_len, seed=1)
    full = trainer(batch_size)
    for batch in batches(uneven, batch_size):
        full.accumulate(batch)
    reference = full.accumulated_gradients()
    errors = {}
    trainers = {1: full}
    for k in (2, 4, 8):
        t = trainers[k] = trainer(batch_size // k)
        for batch in batches(uneven, batch_size // k):
            t.accumulate(batch)
        errors[k] = _rel_err(t.accumulated_gradients(), reference)
    full.apply()
    trainers[4].apply()
    results["grad_rel_err_by_k"] = {str(k): v for k, v in errors.items()}
    results["microbatch_grad_rel_err"] = max(errors.values())
    results["params_rel_err"] = _rel_err(trainers[4].params, full.params)

    # --- cost: k=4 vs one full-batch step, same global batch, interleaved
    rows = _rows(batch_size, args.max_len, seed=2)
    full_batches, micro_batches = batches(rows, batch_size), batches(rows, batch_size // 4)
    real_tokens = int(sum(np.asarray(b.attention_mask).sum() for b in full_batches))
    for _ in range(2):  # warm-up (compiles are already done above)
        _iteration(trainers[1], full_batches)
        _iteration(trainers[4], micro_batches)
    full_times, micro_times = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        _iteration(trainers[1], full_batches)
        full_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        _iteration(trainers[4], micro_batches)
        micro_times.append(time.perf_counter() - start)
    full_s, micro_s = statistics.median(full_times), statistics.median(micro_times)
    results["full_batch_step_s"] = full_s
    results["k4_step_s"] = micro_s
    results["accumulation_overhead_ratio"] = micro_s / full_s
    results["tokens_per_iteration"] = real_tokens
    results["tokens_per_s"] = real_tokens / micro_s
    results["full_batch_tokens_per_s"] = real_tokens / full_s

    # --- learning: single-agent GRPO on the toy task
    if args.grpo_iterations > 0:
        per_seed = {}
        for seed in range(args.grpo_seeds):
            grpo_config = trainer_config(micro_batch_size=16, max_len=10, loss=loss_config_for("grpo"),
                                         optimizer=optimizer_config(learning_rate=args.grpo_lr))
            grpo_trainer = AgentTrainer("solver", get_preset("tiny"), grpo_config, seed=seed)
            rewards = run_grpo(grpo_trainer, iterations=args.grpo_iterations, prompts_per_iteration=8,
                               group_size=8, seed=seed)
            per_seed[str(seed)] = {"before": float(np.mean(rewards[:3])), "after": float(np.mean(rewards[-3:])),
                                   "rewards": rewards}
        results["grpo"] = per_seed
        results["grpo_reward_before"] = float(np.mean([s["before"] for s in per_seed.values()]))
        results["grpo_reward_after"] = float(np.mean([s["after"] for s in per_seed.values()]))

    # --- packing: long-tailed rows, packed against padded
    if args.packing_max_len > 0:
        packing = results["packing"] = _packing(args, model_config, mesh, initial, loss, optimizer)
        results["packed_vs_padded_tokens_per_s"] = packing["packed_tokens_per_s"] / packing["padded_tokens_per_s"]
    return results


def _print(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"trainer bench ({results['model']}, mesh {results['mesh']}, "
                        f"global batch {results['global_batch']} x {results['max_len']})")
    for column in ("measure", "value", "compared with", "ratio"):
        table.add_column(column)
    for k, err in results["grad_rel_err_by_k"].items():
        table.add_row(f"grad rel err, k={k} vs full", f"{err:.2e}", "threshold 1e-5", f"{err / 1e-5:.3f}")
    table.add_row("params rel err after 1 iteration (k=4)", f"{results['params_rel_err']:.2e}",
                  "threshold 1e-6", f"{results['params_rel_err'] / 1e-6:.3f}")
    table.add_row("k=4 iteration (s)", f"{results['k4_step_s']:.4f}",
                  f"full-batch {results['full_batch_step_s']:.4f} s",
                  f"{results['accumulation_overhead_ratio']:.3f}x")
    table.add_row("tokens/s (k=4)", f"{results['tokens_per_s']:.0f}",
                  f"full-batch {results['full_batch_tokens_per_s']:.0f}",
                  f"{results['tokens_per_s'] / results['full_batch_tokens_per_s']:.3f}x")
    if "packing" in results:
        packing = results["packing"]
        table.add_row(f"tokens/s packed ({packing['packed_positions']} positions)",
                      f"{packing['packed_tokens_per_s']:.0f}",
                      f"padded {packing['padded_tokens_per_s']:.0f} ({packing['padded_positions']} positions)",
                      f"{results['packed_vs_padded_tokens_per_s']:.2f}x")
        table.add_row("grad rel err, packed vs padded", f"{packing['grad_rel_err']:.2e}", "threshold 1e-5",
                      f"{packing['grad_rel_err'] / 1e-5:.3f}")
    for seed, r in results.get("grpo", {}).items():
        table.add_row(f"GRPO toy mean reward, seed {seed}", f"{r['after']:.3f} (last 3 it.)",
                      f"{r['before']:.3f} (first 3 it.)", f"{r['after'] / max(r['before'], 1e-9):.1f}x")
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flexmarl bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results as a JSON object to this path")
    parser.add_argument("--model", default="tiny", help="model preset")
    parser.add_argument("--batch", type=int, default=64, help="global batch (samples); divisible by 8")
    parser.add_argument("--max-len", type=int, default=64, help="static sequence length")
    parser.add_argument("--fsdp", type=int, default=1, help="fsdp size of the training mesh")
    parser.add_argument("--tp", type=int, default=1, help="tp size of the training mesh")
    parser.add_argument("--repeats", type=int, default=9, help="timed repetitions of each variant")
    parser.add_argument("--grpo-iterations", type=int, default=40, help="toy GRPO iterations (0 skips)")
    parser.add_argument("--grpo-seeds", type=int, default=3, help="toy GRPO seeds")
    parser.add_argument("--grpo-lr", type=float, default=3e-3, help="toy GRPO learning rate")
    parser.add_argument("--packing-max-len", type=int, default=512,
                        help="longest sequence of the packing comparison (0 skips it)")
    parser.add_argument("--packing-median", type=int, default=32, help="median response length of its rows")
    parser.add_argument("--packing-micro-batch", type=int, default=16, help="its micro-batch (rows)")
    args = parser.parse_args(argv)
    if args.batch % 8:
        parser.error(f"--batch={args.batch} must be divisible by 8 (k up to 8 micro-batches)")
    results = run(args)
    _print(results)
    write_json(args.json, results)
    return 0
