"""`flexmarl bench parity`: numerical parity of our decoder with transformers, cache, export, sharding, bf16.

Builds tiny random Qwen2 (QKV bias, tied embeddings), Llama (untied, Llama-3 rope scaling, GQA) and
Qwen3 (q/k norm, head_dim != hidden/heads) models with transformers (torch, CPU), saves them with
`save_pretrained`, and measures max abs logit differences on a right-padded batch (real positions only):

  qwen2_max_abs_diff / llama_max_abs_diff   ours (from_pretrained) vs transformers (also qwen3_...)
  decode_max_abs_diff       prefill + 32 decode steps vs full forward, 3 prompts of different lengths
  roundtrip_max_abs_diff    our save_pretrained -> transformers loads -> vs our logits
  sharded_max_abs_diff      (fsdp=4, tp=2) mesh on 8 devices vs unsharded
  bf16_max_abs_diff         bf16 parameters (fp32 logits) vs fp32

The helpers are importable; tests/models use them with their own thresholds.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from flexmarl_benchmarks._output import write_json
from flexmarl_jax.mesh.host_devices import fake_cpu_devices

THRESHOLDS = {
    "qwen2_max_abs_diff": 1e-4,
    "llama_max_abs_diff": 1e-4,
    "qwen3_max_abs_diff": 1e-4,
    "decode_max_abs_diff": 1e-4,
    "roundtrip_max_abs_diff": 1e-4,
    "sharded_max_abs_diff": 1e-5,
    "bf16_max_abs_diff": None,  # reported, no bound
}
PADDED_LENGTHS = (5, 11, 16)

_TINY_SHAPES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def build_hf_checkpoint(kind: str, directory: str, *, seed: int = 0) -> str:
    """Random tiny transformers model of `kind` ("qwen2" | "llama") saved with `save_pretrained`.

    All weights are re-drawn (biases and norm scales too, which transformers initialises to 0/1)
    so that every parameter influences the logits.
    """
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    default_rope = {"rope_type": "default", "rope_theta": 10000.0}
    if kind == "qwen2":
        config = Qwen2Config(
            vocab_size=96, tie_word_embeddings=True, rope_parameters=default_rope, **_TINY_SHAPES
        )
        model = Qwen2ForCausalLM(config)
    elif kind == "llama":
        llama3_rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        config = LlamaConfig(
            vocab_size=112, tie_word_embeddings=False, rope_parameters=llama3_rope, **_TINY_SHAPES
        )
        model = LlamaForCausalLM(config)
    elif kind == "qwen3":
        config = Qwen3Config(
            vocab_size=80, tie_word_embeddings=True, head_dim=24, rope_parameters=default_rope, **_TINY_SHAPES
        )
        model = Qwen3ForCausalLM(config)
    else:
        raise ValueError(f"kind={kind!r}; allowed: 'qwen2', 'llama', 'qwen3'")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
            else:
                param.copy_(0.05 * torch.randn_like(param))
    model.save_pretrained(directory)
    return directory


def padded_batch(vocab_size: int, lengths=PADDED_LENGTHS, *, seed: int = 0):
    """Right-padded batch: tokens/positions [B, T] int32, mask [B, T] bool, T = max(lengths)."""
    rng = np.random.default_rng(seed)
    width = max(lengths)
    mask = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
    tokens = np.where(mask, rng.integers(1, vocab_size, size=mask.shape), 0).astype(np.int32)
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), mask.shape).copy()
    return tokens, mask, positions


def hf_logits(directory: str, tokens, mask, positions) -> np.ndarray:
    """transformers' float32 logits [B, T, V] for a saved model directory."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long),
            attention_mask=torch.as_tensor(np.asarray(mask), dtype=torch.long),
            position_ids=torch.as_tensor(np.asarray(positions), dtype=torch.long),
        )
    return out.logits.float().numpy()


_JITTED: dict = {}


def _jitted(name: str):
    """One jit wrapper per functional entry point, so repeated calls reuse compilations."""
    if name not in _JITTED:
        import jax

        from flexmarl_jax.models import functional

        donate = {"decode_step": (4,)}.get(name, ())
        _JITTED[name] = jax.jit(getattr(functional, name), static_argnums=0, donate_argnums=donate)
    return _JITTED[name]


def our_logits(graphdef, params, tokens, mask, positions) -> np.ndarray:
    """Our float32 logits [B, T, V] (jitted `functional.forward`)."""
    return np.asarray(_jitted("forward")(graphdef, params, tokens, positions, mask))


def masked_max_abs_diff(a, b, mask) -> float:
    """max |a - b| over positions where mask [B, T] is True (a, b [B, T, V])."""
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))[np.asarray(mask)].max())


def decode_max_abs_diff(
    graphdef, params, config, *, prompt_lengths=(3, 7, 12), steps: int = 32, seed: int = 0
):
    """Worst |cached - full| logit diff over prefill and `steps` teacher-forced decode steps."""
    import jax.numpy as jnp

    from flexmarl_jax.models import functional as F

    rng = np.random.default_rng(seed)
    lengths = np.asarray(prompt_lengths)
    batch, prompt_width = len(lengths), int(lengths.max())
    width = prompt_width + steps
    tokens = rng.integers(1, config.vocab_size, size=(batch, width)).astype(np.int32)
    full_mask = np.arange(width)[None] < (lengths + steps)[:, None]
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (batch, width))
    reference = our_logits(graphdef, params, tokens, full_mask, positions)

    prompt_mask = np.arange(prompt_width)[None] < lengths[:, None]
    cache = F.init_cache(config, batch, width)
    logits, cache = _jitted("prefill")(
        graphdef, params, jnp.asarray(np.where(prompt_mask, tokens[:, :prompt_width], 0)), prompt_mask, cache
    )
    worst = masked_max_abs_diff(logits, reference[:, :prompt_width], prompt_mask)
    step_fn = _jitted("decode_step")
    rows = np.arange(batch)
    for step in range(steps):
        pos = (lengths + step).astype(np.int32)
        logits, cache = step_fn(graphdef, params, jnp.asarray(tokens[rows, pos]), jnp.asarray(pos), cache)
        worst = max(worst, float(np.abs(np.asarray(logits) - reference[rows, pos]).max()))
    return worst


def measure(workdir: str) -> dict:
    """Runs every parity measurement in `workdir`; returns the JSON dict (diffs plus context)."""
    import jax
    import jax.numpy as jnp

    from flexmarl_jax.mesh.meshes import make_mesh
    from flexmarl_jax.models.checkpoint import from_pretrained, save_pretrained

    result: dict = {}
    loaded = {}
    for kind in ("qwen2", "llama", "qwen3"):
        directory = build_hf_checkpoint(kind, os.path.join(workdir, f"hf_{kind}"))
        loaded[kind] = from_pretrained(directory)
        tokens, mask, positions = padded_batch(loaded[kind].config.vocab_size)
        ours = our_logits(loaded[kind].graphdef, loaded[kind].params, tokens, mask, positions)
        result[f"{kind}_max_abs_diff"] = masked_max_abs_diff(
            ours, hf_logits(directory, tokens, mask, positions), mask
        )

    config, graphdef, params = loaded["llama"]
    result["decode_max_abs_diff"] = max(
        decode_max_abs_diff(m.graphdef, m.params, m.config) for m in loaded.values()
    )

    roundtrip = 0.0
    for kind, model in loaded.items():
        exported = os.path.join(workdir, f"ours_{kind}")
        save_pretrained((model.graphdef, model.params), exported, max_shard_bytes=64 * 1024)  # several shards
        tokens, mask, positions = padded_batch(model.config.vocab_size, seed=1)
        ours = our_logits(model.graphdef, model.params, tokens, mask, positions)
        roundtrip = max(
            roundtrip, masked_max_abs_diff(ours, hf_logits(exported, tokens, mask, positions), mask)
        )
    result["roundtrip_max_abs_diff"] = roundtrip

    devices = jax.devices()
    tp = 2 if len(devices) >= 2 else 1
    fsdp = min(4, len(devices) // tp)
    mesh = make_mesh(devices[: fsdp * tp], fsdp=fsdp, tp=tp)
    sharded = from_pretrained(os.path.join(workdir, "hf_llama"), mesh=mesh)
    tokens, mask, positions = padded_batch(config.vocab_size, (8, 5, 16, 2), seed=2)
    reference = our_logits(graphdef, params, tokens, mask, positions)
    with jax.set_mesh(mesh):
        sharded_logits = our_logits(sharded.graphdef, sharded.params, tokens, mask, positions)
    result["sharded_max_abs_diff"] = masked_max_abs_diff(sharded_logits, reference, mask)
    result["sharded_mesh"] = f"fsdp={fsdp},tp={tp}"

    bf16 = from_pretrained(os.path.join(workdir, "hf_qwen2"), dtype=jnp.bfloat16)
    tokens, mask, positions = padded_batch(bf16.config.vocab_size)
    low = our_logits(bf16.graphdef, bf16.params, tokens, mask, positions)
    high = our_logits(loaded["qwen2"].graphdef, loaded["qwen2"].params, tokens, mask, positions)
    result["bf16_max_abs_diff"] = masked_max_abs_diff(low, high, mask)
    result["bf16_logits_dtype"] = str(low.dtype)
    result["fp32_logit_abs_max"] = float(np.abs(high[mask]).max())
    result["backend"] = jax.default_backend()
    return result


def _print_table(result: dict, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"parity (max abs logit diff), {seconds:.1f} s, backend {result['backend']}")
    for column in ("measurement", "max abs diff", "bound", "diff / bound"):
        table.add_column(column, justify="right" if column != "measurement" else "left")
    for key, bound in THRESHOLDS.items():
        value = result[key]
        ratio = f"{value / bound:.3f}" if bound else "-"
        table.add_row(key, f"{value:.3e}", f"{bound:.0e}" if bound else "report", ratio)
    Console().print(table)
    print(
        f"sharded on {result['sharded_mesh']}; bf16 logits dtype {result['bf16_logits_dtype']}, "
        f"fp32 |logit| max {result['fp32_logit_abs_max']:.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flexmarl bench parity", description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the result object here")
    parser.add_argument("--workdir", help="keep the checkpoints here (default: a temporary directory)")
    args = parser.parse_args(argv)
    # The sharded check wants 8 devices; on CPU fake them (takes effect if JAX is not initialised yet).
    fake_cpu_devices(8)

    start = time.perf_counter()
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        result = measure(args.workdir)
    else:
        with tempfile.TemporaryDirectory() as workdir:
            result = measure(workdir)
    seconds = time.perf_counter() - start
    result["seconds"] = seconds
    _print_table(result, seconds)
    write_json(args.json, result)
    failed = [k for k, bound in THRESHOLDS.items() if bound is not None and not result[k] < bound]
    if failed:
        print(f"above bound: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
