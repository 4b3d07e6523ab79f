"""What a device could do at best, and what share of it a measured rollout or training step used.

`PEAKS` lists published dense peaks (no sparsity) per device family, matched against JAX's `device_kind`
(or torch's CUDA device name) by substring, first match wins. Model FLOPs and bytes come from the model's
shape alone (`ModelConfig`), so both sides of a comparison are measured against the same work:

* FLOPs per token (forward) = 2 x (every matmul weight, LM head included) + 4 x layers x heads x head_dim
  x (keys attended); a training step is 3 x forward (backward = 2 x forward), causal attention counted
  at its useful half.
* bytes per decode step = every weight once + the KV cache rows the batch attends to.

Pure Python; CPUs (and devices not listed) give None.
"""

from __future__ import annotations

import dataclasses

from flexmarl_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class DevicePeaks:
    """Dense peak FLOP/s per compute dtype (None where no figure is published) and memory bandwidth."""

    name: str
    flops: dict[str, float | None]  # "float32" / "bfloat16" -> FLOP/s
    bandwidth: float  # bytes/s


# (substring of the device kind, peaks); more specific names first. GPU "float32" is the non-tensor-core FP32
# peak: both sides of the bench run float32 matmuls at full precision (no TF32).
PEAKS: tuple[tuple[str, DevicePeaks], ...] = (
    ("H200", DevicePeaks("NVIDIA H200", {"bfloat16": 989e12, "float32": 67e12}, 4.8e12)),
    ("H100 PCIe", DevicePeaks("NVIDIA H100 PCIe", {"bfloat16": 756e12, "float32": 51e12}, 2.0e12)),
    ("H100", DevicePeaks("NVIDIA H100 SXM", {"bfloat16": 989e12, "float32": 67e12}, 3.35e12)),
    ("A100-SXM4-40GB", DevicePeaks("NVIDIA A100 40GB", {"bfloat16": 312e12, "float32": 19.5e12}, 1.555e12)),
    ("A100", DevicePeaks("NVIDIA A100 80GB", {"bfloat16": 312e12, "float32": 19.5e12}, 2.039e12)),
    ("L4", DevicePeaks("NVIDIA L4", {"bfloat16": 121e12, "float32": 30.3e12}, 300e9)),
    # TPUs publish bf16 MXU peaks only; float32 matmuls take several bf16 passes.
    ("TPU v6 lite", DevicePeaks("TPU v6e", {"bfloat16": 918e12, "float32": None}, 1.64e12)),
    ("TPU v5 lite", DevicePeaks("TPU v5e", {"bfloat16": 197e12, "float32": None}, 819e9)),
    ("TPU v5", DevicePeaks("TPU v5p", {"bfloat16": 459e12, "float32": None}, 2.765e12)),
    ("TPU v4", DevicePeaks("TPU v4", {"bfloat16": 275e12, "float32": None}, 1.228e12)),
)


def device_peaks(device_kind: str | None) -> DevicePeaks | None:
    """Peaks of the device whose kind contains a table entry; None for CPUs and unknown devices."""
    if not device_kind:
        return None
    return next((peaks for key, peaks in PEAKS if key.lower() in device_kind.lower()), None)


def matmul_weights(config: ModelConfig) -> int:
    """Weights that take part in a matmul per token: attention, MLP and the LM head (not norms or biases)."""
    e, d, h, k, m = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads, config.intermediate_size
    per_layer = e * (h + 2 * k) * d + h * d * e + 3 * e * m
    return config.num_layers * per_layer + e * config.vocab_size


def forward_flops_per_token(config: ModelConfig, keys_attended: float) -> float:
    """FLOPs of one token's forward pass that attends to `keys_attended` positions."""
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * keys_attended
    return 2 * matmul_weights(config) + attention


def train_step_flops(config: ModelConfig, rows: int, length: int) -> float:
    """Forward + backward FLOPs of a [rows, length] training step (causal: token t attends to t + 1 keys)."""
    mean_keys = (length + 1) / 2
    return 3 * rows * length * forward_flops_per_token(config, mean_keys)


def rollout_flops(config: ModelConfig, prompt_lengths: list[int], new_tokens: int) -> float:
    """Prefill of every prompt plus `new_tokens` decode steps per prompt."""
    total = 0.0
    for length in prompt_lengths:
        total += length * forward_flops_per_token(config, (length + 1) / 2)
        total += new_tokens * forward_flops_per_token(config, length + (new_tokens + 1) / 2)
    return total


def decode_bytes(config: ModelConfig, param_count: int, bytes_per_value: int, prompt_lengths: list[int],
                 new_tokens: int) -> float:
    """Bytes a rollout must move at least: all weights once per decode step, plus each step's KV rows."""
    kv_per_position = 2 * config.num_layers * config.num_kv_heads * config.head_dim * bytes_per_value
    mean_context = sum(length + (new_tokens + 1) / 2 for length in prompt_lengths)
    return new_tokens * (param_count * bytes_per_value + kv_per_position * mean_context)


def fraction(achieved: float, peak: float | None) -> float | None:
    return None if peak is None or peak <= 0 else achieved / peak
