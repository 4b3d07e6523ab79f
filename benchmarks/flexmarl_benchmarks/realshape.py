"""`flexmarl bench realshape`: our rollout and training step vs transformers/torch at Qwen2.5-0.5B's shape.

    flexmarl bench realshape --json realshape.json [--dtypes float32,bfloat16] [--threads 2] [--shape real]

A random-init model of Qwen2.5-0.5B's shape (494M parameters) is written once with our `save_pretrained`;
both sides load that directory (ours with `from_pretrained`, torch with `AutoModelForCausalLM`). Each side
runs in its own process, pinned to the same `--threads` cores (both sides' float32 Adam state do not fit in
24 GB together); the parent interleaves their repeats (ours, theirs, ours, theirs, ...) and reports medians.
Per dtype (float32, then bfloat16 where both sides have bfloat16 kernels: see "dtypes" below):

  rollout  tokens/s of `FlexEngine` through the in-process rollout loop vs transformers `generate`: the same
           16 prompts, temperature-1 sampling, exactly 64 new tokens each (EOS ignored on both sides)
           -> rollout_speedup_vs_hf (ours / theirs; > 1 means ours is faster)
  training one forward + backward + Adam step on 4 x 256 tokens: our `AgentTrainer` (accumulate + apply,
           parameters, accumulator and optimizer state donated) vs the same GRPO loss, backward and
           `torch.optim.Adam` step in torch -> train_speedup_vs_torch (their step time / ours)
  memory   peak_rss_gb of each side's process (and peak device memory on an accelerator)
  roofline on a known accelerator, each side's share of the device's peak FLOP/s and memory bandwidth
           (`roofline.py`); null on CPU

dtypes   without --dtypes, bfloat16 is compared only where each side's bfloat16 projection runs at least
           BF16_MIN_SPEED of its float32 rate (`_dtype_probe.py`, a few seconds per side); otherwise
           per_dtype.bfloat16 says why it was skipped, with the probed GFLOP/s, and the `_bf16` keys are null.
           An explicit --dtypes runs what it lists.

Top-level keys are the float32 figures; `_bf16` keys and `per_dtype` hold the rest. `--shape tiny` runs the
same code end to end on a toy model in seconds (the test uses it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from flexmarl_benchmarks._output import write_json
from flexmarl_benchmarks._side_process import SideProcess
from flexmarl_jax.emulation import roofline
from flexmarl_jax.mesh.host_devices import without_fake_cpu_devices
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.presets import get_preset

SHAPES: dict[str, ModelConfig] = {
    "real": get_preset("qwen2.5-0.5b"),
    # Same layout (GQA, QKV bias, tied embeddings), a few hundred thousand parameters: for the test.
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                        qkv_bias=True, max_position_embeddings=512),
}
DTYPES = ("float32", "bfloat16")
# A bfloat16 projection at under half the float32 rate means a conversion fallback, not bfloat16 kernels
# (native ones run at least as fast as float32: half the bytes). Measured here (AVX2 CPU, 2 threads, the
# 1024 x 896 x 4864 projection): torch linear 124 -> 19 GFLOP/s, XLA 139 -> 111.
BF16_MIN_SPEED = 0.5
DTYPE_SUFFIX = {"float32": "", "bfloat16": "_bf16"}
_BYTES_PER_VALUE = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Workload:
    """What both sides run; written to workload.json (+ train_batch.npz) for the workers."""

    prompts: list[list[int]]  # token ids of the rollout prompts (the rollout batch)
    new_tokens: int  # tokens generated per prompt
    train_rows: int  # training batch rows
    train_len: int  # training sequence length (every row full)
    seed: int


def make_workload(config: ModelConfig, args: argparse.Namespace) -> Workload:
    rng = np.random.default_rng(args.seed)
    shortest, longest = args.prompt_len
    lengths = rng.integers(shortest, longest + 1, size=args.batch)
    prompts = [rng.integers(3, config.vocab_size, size=int(n)).tolist() for n in lengths]
    return Workload(prompts=prompts, new_tokens=args.new_tokens, train_rows=args.train_rows,
                    train_len=args.train_len, seed=args.seed)


def write_train_batch(workload: Workload, vocab_size: int, path: str) -> None:
    """One full micro-batch [train_rows, train_len] built by our batch builder (GRPO, token-mean weights)."""
    from flexmarl_jax.train.batch import ARRAY_FIELDS, build_iteration

    rng = np.random.default_rng(workload.seed + 1)
    prompt_length = max(1, workload.train_len // 8)
    response_length = workload.train_len + 1 - prompt_length  # prompt + response - 1 == train_len inputs
    rows = workload.train_rows
    (batch,) = build_iteration(
        agent="bench", aggregation="token_mean", micro_batch_size=rows, max_len=workload.train_len,
        prompt_ids=[rng.integers(3, vocab_size, prompt_length).tolist() for _ in range(rows)],
        response_ids=[rng.integers(3, vocab_size, response_length).tolist() for _ in range(rows)],
        behaviour_logprobs=[(-np.log(vocab_size) + 0.1 * rng.normal(size=response_length)).tolist()
                            for _ in range(rows)],
        advantages=rng.normal(size=rows).tolist())
    np.savez(path, **{name: np.asarray(getattr(batch, name)) for name in ARRAY_FIELDS})


def _log(message: str) -> None:
    print(f"[realshape] {message}", file=sys.stderr, flush=True)


def _worker_env() -> dict[str, str]:
    """The workers see one real device: no fake CPU devices (tests set them), no up-front GPU preallocation
    (both sides share one accelerator; peak memory then means what was used)."""
    env = without_fake_cpu_devices(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _worker(side: str, checkpoint: str, workdir: str, dtype: str, args) -> SideProcess:
    module = {"ours": "flexmarl_benchmarks._realshape_ours", "torch": "flexmarl_benchmarks._realshape_torch"}[side]
    argv = [sys.executable, "-m", module, "serve", "--checkpoint", checkpoint, "--workload", workdir,
            "--dtype", dtype, "--threads", str(args.threads), "--f32-matmul", args.f32_matmul]
    return SideProcess(side, argv, env=_worker_env())


def measure_dtype(dtype: str, checkpoint: str, workdir: str, workload: Workload, config: ModelConfig, args) -> dict:
    """Both sides' rollout and training figures in `dtype`, repeats interleaved."""
    repeats = args.repeats
    with _worker("ours", checkpoint, workdir, dtype, args) as ours, \
            _worker("torch", checkpoint, workdir, dtype, args) as torch_side:
        info = {"ours": ours.call("info"), "torch": torch_side.call("info")}
        _log(f"{dtype}: ours on {info['ours']['device_kind']} (JetStream base class: "
             f"{info['ours']['jetstream_engine_base']}), torch on {info['torch']['device_kind']}, "
             f"{args.threads} threads each")

        # ---- rollout: warm-up (compiles ours), then ours, theirs, ours, theirs, ...
        _log(f"{dtype}: rollout warm-up")
        ours.call("rollout", new_tokens=min(2, workload.new_tokens))
        torch_side.call("rollout", new_tokens=min(2, workload.new_tokens))
        ours_rollouts, hf_rollouts = [], []
        for repeat in range(repeats):
            ours_rollouts.append(ours.call("rollout", new_tokens=workload.new_tokens))
            hf_rollouts.append(torch_side.call("rollout", new_tokens=workload.new_tokens))
            _log(f"{dtype}: rollout {repeat + 1}/{repeats}: ours {ours_rollouts[-1]['seconds']:.2f} s, "
                 f"transformers generate {hf_rollouts[-1]['seconds']:.2f} s")
        breakdown = ours.call("breakdown")
        rollout_memory = {"ours": ours.call("stats"), "torch": torch_side.call("stats")}

        # ---- training: one round per side at a time (only one side holds optimizer state at once)
        # Every round builds a fresh trainer / optimizer, so it starts with an untimed step (ours compiles its
        # new trainer's steps; torch allocates its Adam state); in the first bfloat16 round our second step
        # compiles again (optax's moments turn float32 after the first update, see _realshape_ours.train_round).
        # Both sides get the same count, and both hand freed memory back to the OS after each round.
        ours_steps, torch_steps, warm_up, rss_after = [], [], {"ours": [], "torch": []}, {"ours": [], "torch": []}
        for repeat in range(repeats):
            round_warm_up = 2 if dtype == "bfloat16" and repeat == 0 else 1
            for name, side, steps in (("ours", ours, ours_steps), ("torch", torch_side, torch_steps)):
                reply = side.call("train_round", steps=args.train_steps, warm_up=round_warm_up)
                steps.extend(reply["step_seconds"])
                warm_up[name].extend(reply["warm_up_seconds"])
                rss_after[name].append(reply["rss_gb_after"])
            _log(f"{dtype}: train round {repeat + 1}/{repeats}: ours {ours_steps[-1]:.2f} s/step, "
                 f"torch {torch_steps[-1]:.2f} s/step")
        memory = {"ours": ours.call("stats"), "torch": torch_side.call("stats")}

    tokens = ours_rollouts[0]["tokens"]
    ours_rollout_s = statistics.median(r["seconds"] for r in ours_rollouts)
    hf_rollout_s = statistics.median(r["seconds"] for r in hf_rollouts)
    ours_step_s, torch_step_s = statistics.median(ours_steps), statistics.median(torch_steps)
    figures = {
        "rollout_speedup_vs_hf": hf_rollout_s / ours_rollout_s,
        "train_speedup_vs_torch": torch_step_s / ours_step_s,
        "rollout_tokens_per_s": {"ours": tokens / ours_rollout_s, "hf": tokens / hf_rollout_s},
        "rollout_s": {"ours": ours_rollout_s, "hf": hf_rollout_s},
        "rollout_seconds": {"ours": [r["seconds"] for r in ours_rollouts], "hf": [r["seconds"] for r in hf_rollouts]},
        "train_step_s": {"ours": ours_step_s, "torch": torch_step_s},
        "train_step_seconds": {"ours": ours_steps, "torch": torch_steps},
        "train_tokens_per_s": {"ours": workload.train_rows * workload.train_len / ours_step_s,
                               "torch": workload.train_rows * workload.train_len / torch_step_s},
        "train_warm_up_s": warm_up,
        "rss_gb_after_train_round": rss_after,
        "peak_rss_gb": {side: memory[side]["peak_rss_gb"] for side in memory},
        "peak_rss_gb_rollout": {side: rollout_memory[side]["peak_rss_gb"] for side in rollout_memory},
        "peak_device_gb": {side: memory[side]["peak_device_gb"] for side in memory},
        "ours_rollout_breakdown_ms": breakdown,
        "ours_rollout_steps": ours_rollouts[0]["steps"],
        "info": info,
    }
    figures["roofline"] = roofline_shares(dtype, config, info, workload, figures)
    return figures


def roofline_shares(dtype: str, config: ModelConfig, info: dict, workload: Workload, figures: dict) -> dict:
    """Each side's share of its device's peak FLOP/s and bandwidth; None figures on CPU / unknown devices."""
    lengths = [len(p) for p in workload.prompts]
    params = info["ours"]["params"]
    rollout_flops = roofline.rollout_flops(config, lengths, workload.new_tokens)
    rollout_bytes = roofline.decode_bytes(config, params, _BYTES_PER_VALUE[dtype], lengths, workload.new_tokens)
    train_flops = roofline.train_step_flops(config, workload.train_rows, workload.train_len)
    out = {"model_flops_rollout": rollout_flops, "model_bytes_rollout": rollout_bytes,
           "model_flops_train_step": train_flops}
    for side, rollout_key in (("ours", "ours"), ("torch", "hf")):
        peaks = roofline.device_peaks(info[side]["device_kind"] if info[side]["platform"] != "cpu" else None)
        peak_flops = peaks.flops.get(dtype) if peaks else None
        rollout_s, step_s = figures["rollout_s"][rollout_key], figures["train_step_s"][side]
        out[side] = {
            "device": peaks.name if peaks else None,
            "rollout_flops_fraction": roofline.fraction(rollout_flops / rollout_s, peak_flops),
            "rollout_bandwidth_fraction": roofline.fraction(rollout_bytes / rollout_s,
                                                             peaks.bandwidth if peaks else None),
            "train_flops_fraction": roofline.fraction(train_flops / step_s, peak_flops),
        }
    return out


def probe_rates(side: str, config: ModelConfig, workload: Workload, threads: int) -> dict[str, float]:
    """GFLOP/s of one MLP up-projection ([train rows x len, hidden] x [hidden, intermediate], at most 256 rows)
    on `side`, per dtype, measured in a fresh process pinned like the worker."""
    rows = min(256, workload.train_rows * workload.train_len)
    argv = [sys.executable, "-m", "flexmarl_benchmarks._dtype_probe", side, "--rows", str(rows),
            "--inputs", str(config.hidden_size), "--outputs", str(config.intermediate_size), "--threads", str(threads)]
    done = subprocess.run(argv, check=True, capture_output=True, text=True, env=_worker_env())
    return json.loads(done.stdout.strip().splitlines()[-1])


def plan_dtypes(requested: tuple[str, ...], explicit: bool,
                rates: dict[str, dict[str, float]] | None) -> tuple[list[str], dict[str, dict]]:
    """The dtypes to measure and, for each one skipped, why. `rates` is side -> dtype -> GFLOP/s (the probe).

    float32 always runs. With an explicit --dtypes every listed dtype runs. Otherwise bfloat16 runs only if
    every side's bfloat16 rate is at least BF16_MIN_SPEED of its float32 rate."""
    if explicit or "bfloat16" not in requested:
        return list(requested), {}
    slow = {side: r["bfloat16"] / r["float32"] for side, r in rates.items()
            if r["bfloat16"] < BF16_MIN_SPEED * r["float32"]}
    if not slow:
        return list(requested), {}
    reason = "; ".join(f"{side}'s bfloat16 projection runs at {share:.2f}x its float32 rate "
                       f"({rates[side]['bfloat16']:.1f} vs {rates[side]['float32']:.1f} GFLOP/s)"
                       for side, share in sorted(slow.items()))
    skipped = {"bfloat16": {"skipped": f"no bfloat16 kernels on this host: {reason} (below {BF16_MIN_SPEED}); "
                                       "--dtypes float32,bfloat16 measures it anyway",
                            "matmul_gflops": rates}}
    return [d for d in requested if d != "bfloat16"], skipped


def run(args: argparse.Namespace) -> dict:
    config = SHAPES[args.shape]
    workload = make_workload(config, args)
    result: dict = {"shape": args.shape, "dtype": args.dtypes[0], "dtypes": list(args.dtypes),
                    "threads": args.threads,
                    "workload": {"batch": len(workload.prompts), "new_tokens": workload.new_tokens,
                                 "prompt_lengths": [len(p) for p in workload.prompts],
                                 "train_rows": workload.train_rows, "train_len": workload.train_len,
                                 "repeats": args.repeats, "train_steps_per_round": args.train_steps},
                    "host": {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()}}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flexmarl-realshape-") as workdir:
        with open(os.path.join(workdir, "workload.json"), "w") as handle:
            json.dump(dataclasses.asdict(workload), handle)
        write_train_batch(workload, config.vocab_size, os.path.join(workdir, "train_batch.npz"))
        config_json = os.path.join(workdir, "shape.json")
        with open(config_json, "w") as handle:
            json.dump(config.to_hf_config(), handle)
        checkpoint = os.path.join(workdir, "checkpoint")
        _log(f"writing a random-init {args.shape} checkpoint (Qwen2.5-0.5B shape)" if args.shape == "real"
             else f"writing a random-init {args.shape} checkpoint")
        subprocess.run([sys.executable, "-m", "flexmarl_benchmarks._realshape_ours", "write", checkpoint,
                        "--config-json", config_json, "--seed", str(args.seed)], check=True, env=_worker_env())
        rates = None
        if not args.dtypes_explicit and "bfloat16" in args.dtypes:
            _log("probing each side's bfloat16 and float32 matmul rates")
            rates = {side: probe_rates(side, config, workload, args.threads) for side in ("ours", "torch")}
            result["matmul_gflops"] = rates
        dtypes, per_dtype = plan_dtypes(args.dtypes, args.dtypes_explicit, rates)
        for dtype, why in per_dtype.items():
            _log(f"{dtype} not measured: {why['skipped']}")
        for dtype in dtypes:
            try:
                per_dtype[dtype] = measure_dtype(dtype, checkpoint, workdir, workload, config, args)
            except RuntimeError as error:
                if dtype == "float32":
                    raise
                _log(f"{dtype} not measured: {error}")  # a side that cannot run it is reported, not fatal
                per_dtype[dtype] = {"error": str(error).splitlines()[0]}
    result["per_dtype"] = {dtype: per_dtype[dtype] for dtype in args.dtypes}
    for dtype, figures in per_dtype.items():
        suffix = DTYPE_SUFFIX[dtype]
        for key in ("rollout_speedup_vs_hf", "train_speedup_vs_torch", "rollout_tokens_per_s", "train_step_s",
                    "peak_rss_gb", "roofline"):
            result[key + suffix] = figures.get(key)
    first = per_dtype[args.dtypes[0]]
    result["params"] = first["info"]["ours"]["params"]
    result["params_torch"] = first["info"]["torch"]["params"]
    result["device"] = {side: first["info"][side]["device_kind"] for side in ("ours", "torch")}
    result["host"]["load_average_at_end"] = os.getloadavg()
    result["seconds"] = time.perf_counter() - started
    return result


def print_summary(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    workload = result["workload"]
    table = Table(title=f"realshape ({result['shape']}, {result['params'] / 1e6:.1f}M params, "
                        f"{result['threads']} threads per side, medians of {workload['repeats']})")
    for column in ("dtype", "measure", "ours", "torch / transformers", "ours is x faster"):
        table.add_column(column, justify="left" if column in ("dtype", "measure") else "right")
    for dtype, figures in result["per_dtype"].items():
        if "error" in figures or "skipped" in figures:
            table.add_row(dtype, "not measured (below)", "", "", "")
            continue
        tokens, step = figures["rollout_tokens_per_s"], figures["train_step_s"]
        table.add_row(dtype, f"rollout tokens/s (batch {workload['batch']} x {workload['new_tokens']} new)",
                      f"{tokens['ours']:,.1f}", f"{tokens['hf']:,.1f}", f"{figures['rollout_speedup_vs_hf']:.2f}")
        table.add_row(dtype, f"train step s ({workload['train_rows']} x {workload['train_len']} tokens, Adam)",
                      f"{step['ours']:.3f}", f"{step['torch']:.3f}", f"{figures['train_speedup_vs_torch']:.2f}")
        rss = figures["peak_rss_gb"]
        table.add_row(dtype, "peak RSS GB", f"{rss['ours']:.2f}", f"{rss['torch']:.2f}", "")
        roof = figures["roofline"]
        if roof["ours"]["device"] is not None:
            for key in ("rollout_bandwidth_fraction", "rollout_flops_fraction", "train_flops_fraction"):
                values = [roof[side][key] for side in ("ours", "torch")]
                table.add_row(dtype, f"{key} ({roof['ours']['device']})",
                              *[f"{v:.3f}" if v is not None else "-" for v in values], "")
    console = Console()
    console.print(table)
    for dtype, figures in result["per_dtype"].items():
        if "error" in figures or "skipped" in figures:
            console.print(f"{dtype} not measured: {figures.get('error') or figures['skipped']}")
    breakdown = result["per_dtype"][result["dtype"]].get("ours_rollout_breakdown_ms", {})
    if breakdown:
        console.print(f"ours, {result['dtype']}: batched prefill {breakdown['prefill_ms']:.1f} ms, one generate "
                      f"step over {workload['batch']} slots {breakdown['generate_step_ms']:.1f} ms; host load "
                      f"average {result['host']['load_average_at_start'][0]:.2f} at start, "
                      f"{result['host']['load_average_at_end'][0]:.2f} at end; {result['seconds']:.0f} s in all")


def _prompt_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    low, high = int(low), int(high or low)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"--prompt-len={text!r} must be MIN:MAX with 1 <= MIN <= MAX")
    return low, high


def _dtypes(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names or any(name not in DTYPES for name in names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--dtypes={text!r}: a comma list of distinct names from {DTYPES}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flexmarl bench realshape", description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the result object here")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="real",
                        help="real = Qwen2.5-0.5B's shape; tiny = a toy model for tests")
    parser.add_argument("--dtypes", type=_dtypes, default=None, help="comma list, all measured; the first fills "
                        "the top-level keys (default: float32, and bfloat16 where both sides have its kernels)")
    parser.add_argument("--threads", type=int, default=min(2, len(os.sched_getaffinity(0))),
                        help="cores (and threads) per side, the same for both (default 2)")
    parser.add_argument("--batch", type=int, default=16, help="rollout prompts, all decoded together")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--prompt-len", type=_prompt_range, default=(24, 32), help="prompt tokens MIN:MAX")
    parser.add_argument("--train-rows", type=int, default=4)
    parser.add_argument("--train-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rollout repeats and train rounds")
    parser.add_argument("--train-steps", type=int, default=1, help="timed steps per train round")
    parser.add_argument("--f32-matmul", choices=("highest", "tensorfloat32"), default="highest",
                        help="float32 matmul precision on accelerators, both sides (highest = no TF32)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.dtypes_explicit = args.dtypes is not None
    args.dtypes = args.dtypes or DTYPES
    for name in ("threads", "batch", "new_tokens", "train_rows", "repeats", "train_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.train_len < 2:
        parser.error(f"--train-len={args.train_len} must be >= 2")
    result = run(args)
    print_summary(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
