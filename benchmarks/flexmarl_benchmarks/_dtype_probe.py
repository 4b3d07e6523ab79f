"""How fast each side multiplies matrices in float32 and in bfloat16 on this host, in its own process.

    python -m flexmarl_benchmarks._dtype_probe {ours,torch} --rows R --inputs K --outputs N --threads T

`flexmarl bench realshape` compares bfloat16 only where both sides have bfloat16 kernels. Without them a
library falls back to a conversion path: torch 2.13 on an AVX2-only CPU runs a bfloat16 `linear` at about a
sixth of its float32 rate (and `@` at under 1 GFLOP/s), so a bfloat16 comparison there would time torch's
missing kernels, not the model code, and take hours. The probe times one projection of the model's shape
(`linear` in torch, a jitted `dot` in JAX), the operation that dominates both the rollout and the training
step, and prints {"float32": GFLOP/s, "bfloat16": GFLOP/s} as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from flexmarl_benchmarks import _side_process

MIN_SECONDS = 0.3  # time each dtype at least this long (and at least 3 calls)


def _rate(call, flops: float) -> float:
    call()  # compiles / warms caches
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < MIN_SECONDS:
        call()
        calls += 1
    return flops * calls / (time.perf_counter() - start) / 1e9


def torch_rates(rows: int, inputs: int, outputs: int) -> dict[str, float]:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rates = {}
    for name in ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        x = torch.randn(rows, inputs, dtype=dtype, device=device)
        w = torch.randn(outputs, inputs, dtype=dtype, device=device)

        def call(x=x, w=w):
            with torch.no_grad():
                torch.nn.functional.linear(x, w)
            if device.type == "cuda":
                torch.cuda.synchronize()

        rates[name] = _rate(call, 2.0 * rows * inputs * outputs)
    return rates


def jax_rates(rows: int, inputs: int, outputs: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    dot = jax.jit(lambda x, w: x @ w)
    rates = {}
    for name in ("float32", "bfloat16"):
        x = jnp.ones((rows, inputs), dtype=name)
        w = jnp.ones((inputs, outputs), dtype=name)
        rates[name] = _rate(lambda x=x, w=w: dot(x, w).block_until_ready(), 2.0 * rows * inputs * outputs)
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexmarl_benchmarks._dtype_probe")
    parser.add_argument("side", choices=("ours", "torch"))
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--inputs", type=int, required=True)
    parser.add_argument("--outputs", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args(argv)
    _side_process.pin_to_cores(args.threads)
    if args.side == "torch":
        import torch

        torch.set_num_threads(args.threads)
        rates = torch_rates(args.rows, args.inputs, args.outputs)
    else:
        rates = jax_rates(args.rows, args.inputs, args.outputs)
    print(json.dumps(rates), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
