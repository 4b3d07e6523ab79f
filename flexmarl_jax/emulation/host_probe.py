"""This host as an emulated chip: what one of its XLA devices achieves, measured by a short probe.

The calibration (`bench/_emulate_calibration.py`) compares a real run on this CPU with an emulated run of the
same config on this "chip": the cost model then has to predict what this host does, which checks its formulas
and the emulated control plane against something measured. Three numbers, each from a few hundred
milliseconds of timing on XLA device 0, best of several repeats (the host is shared; the best run is the
least disturbed one):

* `call_overhead_s`: a jitted call that does nothing (a scalar in, the same out), dispatch to result;
* `peak_bf16_flops` (a misnomer here: the model runs in float32 on CPU): achieved FLOP/s of a float32 matmul
  of the shape a tiny model's training step multiplies, [rows, hidden] x [hidden, 3 x hidden], less the call
  overhead;
* `hbm_bytes_per_s`: bytes read plus written per second by an elementwise op over a 64 MiB array.

The chip is named `HOST_CHIP` ("host") and is registered for this process only (`chips.register_chip`). It is
`one_device`: a run's fake XLA devices are the same two cores, so its emulated engines queue their calls on one
timeline and its trainers on another (`chips.Chip.one_device` says why two), and `probe_programs` measures how
much each slows the other when both have work (the calibration carries both factors into the chip).
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp

from flexmarl_jax.emulation.chips import Chip

HOST_CHIP = "host"
_REPEATS = 5


def _best_seconds_per_call(function, argument, calls: int) -> float:
    """Fastest mean seconds per call over `_REPEATS` timed batches of `calls` calls (after one warm-up)."""
    jax.block_until_ready(function(argument))
    best = float("inf")
    for _ in range(_REPEATS):
        started = time.perf_counter()
        for _ in range(calls):
            result = function(argument)
        jax.block_until_ready(result)
        best = min(best, (time.perf_counter() - started) / calls)
    return best


def probe_host(*, matmul_rows: int = 1280, hidden: int = 64, bandwidth_bytes: int = 64 << 20) -> Chip:
    """This host's XLA device 0 as a `Chip` (see the module docstring); memory = the machine's RAM."""
    device = jax.devices()[0]
    scalar = jax.device_put(jnp.zeros((), jnp.float32), device)
    overhead = _best_seconds_per_call(jax.jit(lambda x: x + 1), scalar, calls=200)

    left = jax.device_put(jnp.ones((matmul_rows, hidden), jnp.float32), device)
    right = jax.device_put(jnp.ones((hidden, 3 * hidden), jnp.float32), device)
    matmul = jax.jit(lambda a: a @ right)
    per_matmul = _best_seconds_per_call(matmul, left, calls=50)
    flops = 2 * matmul_rows * hidden * 3 * hidden / max(per_matmul - overhead, 1e-9)

    values = jax.device_put(jnp.ones((bandwidth_bytes // 4,), jnp.float32), device)
    per_pass = _best_seconds_per_call(jax.jit(lambda x: x * 2.0), values, calls=5)
    bandwidth = 2 * bandwidth_bytes / max(per_pass - overhead, 1e-9)  # read once, written once

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Chip(name=HOST_CHIP, title=f"this host's XLA device 0 ({device.device_kind}), measured",
                peak_bf16_flops=flops, hbm_bytes_per_s=bandwidth, hbm_bytes=float(memory),
                interconnect="host", interconnect_bytes_per_s=bandwidth, source="measured by emulation/host_probe.py",
                call_overhead_s=overhead, one_device=True)


@dataclasses.dataclass(frozen=True)
class ProgramCosts:
    """What this host's real programs of a run's model cost beyond the roofline of `chip`.

    decode_call_overhead_s: what one engine call costs beyond its roofline when the real rollout loop makes it:
      a request of every slot through a real `EngineInstance` over a `FlexEngine` (one prefill, then one decode
      step per token), less the calls' roofline times, per call. Measured in the loop rather than on a bare
      `generate`, because on this host the loop's own work per call (reading each step's tokens back, sampling
      bookkeeping, inserting the prefix into the slots) runs on the same two cores as the programs, so it adds
      to each call instead of hiding behind it as it would behind an accelerator; a tiny model's call is
      dominated by this and by the program's many small ops, not by FLOPs or bytes.
    decode_step_s: that request's seconds per engine call.
    train_mfu: a real training micro-batch's FLOPs over (its measured seconds x the chip's achieved FLOP/s):
      the share of the probe's matmul rate a whole forward + backward reaches.
    engine_slowdown_beside_training: the median seconds of such a request on each of the run's engines at once
      (one thread each, every engine on its own XLA device) while a thread trains micro-batches back to back on
      another device, over their median seconds alone: what a run's training takes from its rollout loops when
      they share this host's cores (`Chip.engine_slowdown_beside_training`). All the run's engines, not one:
      one engine's loop leaves a core free for training, the run's several do not (measured on the default
      workload: beside 1 engine, both slowed about 1.5x; beside the run's 3, the engines 1.1-1.7x, training
      2.1-2.6x over 16 probes).
    training_slowdown_beside_engines: a micro-batch's median seconds while the engines make such requests back
      to back, over its median seconds alone.
    The two factors the chip gets are these, scaled to conserve the host's work (`work_conserving`); the
    probe's own ratios are kept in `measured_engine_slowdown` and `measured_training_slowdown`.
    """

    decode_call_overhead_s: float
    train_mfu: float
    decode_step_s: float
    train_micro_batch_s: float
    engine_slowdown_beside_training: float = 1.0
    training_slowdown_beside_engines: float = 1.0
    measured_engine_slowdown: float = 1.0
    measured_training_slowdown: float = 1.0


def work_conserving(engine_slowdown: float, training_slowdown: float) -> tuple[float, float]:
    """The two slowdown factors scaled alike so that, while both sides have work, their rates (1 / factor, each
    side's share of what it does alone) sum to at most one: two programs sharing this host's cores get no more
    done together than either alone. Factors whose rates already sum to one or less are returned as they are.

    Why: the probe's two loops leave the cores idle in their gaps (each request's threads started and joined,
    the engines that finish first waiting for the last, each micro-batch's read-back), so side by side they
    reach more than the host's whole throughput (measured on the default workload: rates summing to 1.01-1.32
    over 16 probes; beside one engine, 1.33). The real run fills those gaps with its control plane: its
    asynchronous rollout phase grew by as much as the training it moved beside it (0.085-0.12 s longer for
    0.09 s of training), and over sixteen real runs of both modes side by side its E2E averaged 0.97x the
    synchronous mode's. The probe's factors still say how the cores are split between the two sides; the
    scaling keeps that split.
    """
    rates = 1.0 / engine_slowdown + 1.0 / training_slowdown
    scale = max(1.0, rates)
    return engine_slowdown * scale, training_slowdown * scale
