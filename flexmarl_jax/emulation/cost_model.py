"""How long a model's rollout and training work takes on an accelerator: the emulated devices' clock.

`CostModel(model, chip, chips=n)` is one model replica spread over `n` chips of one kind (tensor parallel
when n > 1). Every method returns *device* seconds; the host's own time per call is `host_overhead_s`, kept
apart because an emulated run spends it for real (and a compressed clock does not shrink it).

The formulas, each written once below, and what they assume:

* FLOPs: `forward_flops_per_token` and `matmul_weights` from `emulation/roofline.py` (2 x every matmul weight,
  LM head included, plus 4 x layers x heads x head_dim per key attended; norms, rotary and softmax are not
  counted). A training step is 3 x forward (backward = 2 x forward), causal attention at its useful half.
* Roofline: a prefill or decode step takes the larger of its FLOPs at the chips' bf16 peak and its bytes at
  their HBM bandwidth (compute and memory traffic overlap perfectly; no kernel reaches more than peak, and
  real ones reach less — the emulation models an ideal engine, on purpose the same for every mode).
* Bytes of a step: every matmul weight once (bf16 by default), plus the KV cache the step reads (decode) or
  writes (prefill); activations stay on chip.
* Training runs at a model-FLOPs utilisation `mfu` in (0, 1] (the share of peak a real training step reaches;
  it stands for everything the roofline leaves out), plus adding the micro-batch's gradient into the fp32
  accumulator (read + write: 8 bytes per parameter at HBM bandwidth).
* Optimizer apply (Adam, fp32 master weights): reads the fp32 parameter, gradient sum, first and second
  moments and writes parameter and both moments (7 x 4 bytes), then writes the bf16 copy the forward pass
  uses (2 bytes): 30 bytes per parameter at HBM bandwidth; its ~10 FLOPs per parameter are negligible.
* Tensor-parallel collectives (n > 1, Megatron layout): two all-reduces of the step's activations
  (tokens x hidden x 2 bytes) per layer in the forward pass, two more in the backward pass; each a ring
  all-reduce moving 2 (n - 1) / n of the buffer through one direction of each chip's interconnect, plus a
  fixed `collective_latency_s`; not overlapped with compute.
* Work is split evenly over the `n` chips (FLOPs, weights, KV cache and optimizer state are all sharded).
* A transfer of N bytes over a `Link` takes its latency plus N / bandwidth; a weight sync sends each chip's
  shard over its own link in parallel.
* Every device call (prefill, decode step, training micro-batch, apply) adds the chip's `call_overhead_s`
  (0 for the spec-sheet chips; measured for this host's chip, see chips.py).

Pure Python; no JAX.
"""

from __future__ import annotations

import dataclasses
import math

from flexmarl_jax.emulation.chips import Chip, Link
from flexmarl_jax.emulation.roofline import forward_flops_per_token, matmul_weights, train_step_flops
from flexmarl_jax.emulation.rules import mfu_problem
from flexmarl_jax.emulation.spec import parse_emulate
from flexmarl_jax.models.config import ModelConfig

BF16_BYTES = 2
GRADIENT_ACCUMULATE_BYTES_PER_PARAM = 8  # fp32 accumulator read + write per micro-batch
ADAM_BYTES_PER_PARAM = 7 * 4 + BF16_BYTES  # see the module docstring
# What a trainer's state moves between a training slice and the host (a stated assumption, as our trainer
# keeps it): fp32 weights, Adam's two fp32 moments and the fp32 gradient accumulator.
TRAIN_STATE_BYTES_PER_PARAM = 4 * 4
DEFAULT_COLLECTIVE_LATENCY_S = 10e-6  # an assumption, not a spec-sheet figure: small all-reduces take ~10 us


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Device time of one model replica on `chips` chips of kind `chip` (see the module docstring).

    mfu: model-FLOPs utilisation of a training step, in (0, 1] (a run's is `pipeline.emulate_mfu`; keyword only).
    weight_bytes / kv_bytes / activation_bytes: bytes per weight, KV-cache value and activation (bf16: 2).
    collective_latency_s: fixed cost of one all-reduce, on top of its bytes.
    host_overhead_s: the host's own seconds per engine or trainer call (measured; not device time).
    """

    model: ModelConfig
    chip: Chip
    chips: int = 1
    mfu: float = dataclasses.field(kw_only=True)
    weight_bytes: int = BF16_BYTES
    kv_bytes: int = BF16_BYTES
    activation_bytes: int = BF16_BYTES
    collective_latency_s: float = DEFAULT_COLLECTIVE_LATENCY_S
    host_overhead_s: float = 0.0

    def __post_init__(self):
        if not isinstance(self.chips, int) or isinstance(self.chips, bool) or self.chips < 1:
            raise ValueError(f"chips={self.chips!r} must be a positive int (chips one model replica spans)")
        problem = mfu_problem(self.mfu)
        if problem:
            raise ValueError(f"mfu={self.mfu!r} {problem}")
        for name in ("collective_latency_s", "host_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")

    # ------------------------------------------------------------------ sizes

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one position holds: keys and values of every layer's KV heads."""
        m = self.model
        return 2 * m.num_layers * m.num_kv_heads * m.head_dim * self.kv_bytes

    def weights_bytes(self) -> int:
        """Bytes of every parameter at `weight_bytes` each: what a weight sync moves."""
        return self.model.num_params() * self.weight_bytes

    def decode_slots_that_fit(self, context: int) -> int:
        """Sequences of `context` positions whose KV cache fits in the chips' HBM beside the weights (0 when the
        weights alone do not fit): the most decode slots an engine instance can hold at that context."""
        free = self.chips * self.chip.hbm_bytes - self.weights_bytes()
        return max(0, int(free // (self.kv_bytes_per_token() * context)))

    def min_chips(self, kv_tokens: int = 0) -> int:
        """Chips whose HBM holds the weights plus `kv_tokens` positions of KV cache."""
        needed = self.weights_bytes() + kv_tokens * self.kv_bytes_per_token()
        return max(1, math.ceil(needed / self.chip.hbm_bytes))

    # ------------------------------------------------------------------ the roofline

    def _roofline_s(self, flops: float, bytes_moved: float) -> float:
        """The larger of compute time at peak and memory time at full bandwidth, work split over the chips, plus
        the chip's fixed cost of a call."""
        compute = flops / (self.chips * self.chip.peak_bf16_flops)
        memory = bytes_moved / (self.chips * self.chip.hbm_bytes_per_s)
        return max(compute, memory) + self.chip.call_overhead_s

    # ------------------------------------------------------------------ rollout

    def prefill_s(self, batch: int, tokens: int) -> float:
        """A prefill of `batch` prompts of `tokens` tokens each (causal: token t attends to t + 1 keys)."""
        positions = batch * tokens
        flops = positions * forward_flops_per_token(self.model, (tokens + 1) / 2)
        bytes_moved = matmul_weights(self.model) * self.weight_bytes + positions * self.kv_bytes_per_token()
        return self._roofline_s(flops, bytes_moved) + self.tensor_parallel_s(positions, passes=1)

    def decode_step_s(self, batch: int, context: float) -> float:
        """One decode step of `batch` slots, each attending to `context` positions."""
        flops = batch * forward_flops_per_token(self.model, context)
        bytes_moved = (matmul_weights(self.model) * self.weight_bytes
                       + batch * context * self.kv_bytes_per_token())
        return self._roofline_s(flops, bytes_moved) + self.tensor_parallel_s(batch, passes=1)

    def decode_steps_s(self, batch: int, context: float, steps: int) -> float:
        """`steps` consecutive decode steps of the same `batch` slots, the first at `context`, each one position
        further: exactly the sum of those single steps (what an engine advancing several tokens per call owes)."""
        return sum(self.decode_step_s(batch, context + step) for step in range(steps))

    # ------------------------------------------------------------------ training

    def train_micro_batch_s(self, rows: int, length: int) -> float:
        """Forward + backward of a [rows, length] micro-batch at `mfu`, plus accumulating its gradient."""
        flops = train_step_flops(self.model, rows, length)
        accumulate = self.model.num_params() * GRADIENT_ACCUMULATE_BYTES_PER_PARAM
        compute = flops / (self.chips * self.chip.peak_bf16_flops * self.mfu)
        memory = accumulate / (self.chips * self.chip.hbm_bytes_per_s)
        return compute + memory + self.tensor_parallel_s(rows * length, passes=2) + self.chip.call_overhead_s

    def optimizer_apply_s(self) -> float:
        """One Adam update of every parameter (memory-bound)."""
        memory = self.model.num_params() * ADAM_BYTES_PER_PARAM / (self.chips * self.chip.hbm_bytes_per_s)
        return memory + self.chip.call_overhead_s

    # ------------------------------------------------------------------ communication

    def tensor_parallel_s(self, tokens: int, passes: int) -> float:
        """All-reduces of a step over `tokens` positions: 2 per layer per pass (forward = 1, training = 2)."""
        n = self.chips
        if n == 1:
            return 0.0
        count = 2 * self.model.num_layers * passes
        buffer = tokens * self.model.hidden_size * self.activation_bytes
        one = 2 * (n - 1) / n * buffer / self.chip.interconnect_one_way_bytes_per_s + self.collective_latency_s
        return count * one

    def train_state_bytes(self) -> int:
        """Bytes of a trainer's state (weights, optimizer moments, gradient accumulator): what a swap moves."""
        return self.model.num_params() * TRAIN_STATE_BYTES_PER_PARAM

    def state_move_s(self, link: Link) -> float:
        """Moving a trainer's state to or from this mesh over `link`, one shard per chip in parallel."""
        return transfer_s(self.train_state_bytes(), link, self.chips)

    def weight_sync_s(self, link: Link, parallel_links: int | None = None) -> float:
        """Sending the whole model over `link`, one shard per chip in parallel (default: `chips` links)."""
        return transfer_s(self.weights_bytes(), link, parallel_links or self.chips)


def transfer_s(nbytes: float, link: Link, parallel_links: int = 1) -> float:
    """`nbytes` over `parallel_links` copies of `link` at once, each carrying an equal share."""
    if nbytes < 0 or parallel_links < 1:
        raise ValueError(f"transfer of nbytes={nbytes} over parallel_links={parallel_links}: need nbytes >= 0 "
                         "and parallel_links >= 1")
    return link.latency_s + nbytes / (parallel_links * link.bytes_per_s)


def instance_cost_model(emulate: str, chips: int) -> CostModel:
    """One engine instance of `chips` chips of `emulate`'s CHIP:MODEL (its memory figures; no training)."""
    device = parse_emulate(emulate)
    return CostModel(device.model, device.chip, chips=chips, mfu=1.0)


def decode_slots_problem(emulate: str, decode_slots: int, context: int, chips: int) -> str | None:
    """An emulated engine instance (`chips` chips of `emulate`'s CHIP:MODEL) holds `decode_slots` sequences of
    `context` positions: their KV cache must fit in its HBM beside the weights, as a real engine's memory check
    requires (config/memory.py)."""
    gb = 1e9  # as the chips' spec sheets print it (emulation/chips.py)
    device = parse_emulate(emulate)
    model = instance_cost_model(emulate, chips)
    fit = model.decode_slots_that_fit(context)
    if decode_slots <= fit:
        return None
    need = decode_slots * context * model.kv_bytes_per_token()
    room = chips * device.chip.hbm_bytes - model.weights_bytes()
    return (f"needs {need / gb:.0f} GB of KV cache at the maximum context ({context} positions) on an engine "
            f"instance of {chips} {device.chip.name} chip(s) ({chips * device.chip.hbm_bytes / gb:.0f} GB of HBM, "
            f"{model.weights_bytes() / gb:.1f} GB of it {device.model_name}'s weights), which has room for "
            f"{max(room, 0) / gb:.0f} GB: at most {fit} slots fit; lower it or raise "
            "mesh.rollout_devices_per_instance")
