"""flexmarl_benchmarks/realshape.py end to end at a toy shape: checkpoint writer, both worker processes, interleaved
repeats, every reported key present and positive, ratios consistent with the absolute figures."""

import json
import math

import pytest

from flexmarl_benchmarks import realshape
from flexmarl_jax.emulation import roofline

PER_SIDE = {"rollout_tokens_per_s": ("ours", "hf"), "train_step_s": ("ours", "torch"), "peak_rss_gb": ("ours", "torch")}
SCALARS = ("rollout_speedup_vs_hf", "train_speedup_vs_torch")


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@pytest.mark.timeout(300)
def test_tiny_run_reports_every_key(tmp_path):
    out = tmp_path / "realshape.json"
    argv = ["--shape", "tiny", "--batch", "3", "--new-tokens", "5", "--prompt-len", "3:6", "--train-rows", "2",
            "--train-len", "16", "--repeats", "2", "--dtypes", "float32,bfloat16", "--json", str(out)]
    assert realshape.main(argv) == 0
    result = json.loads(out.read_text())

    assert result["dtype"] == "float32" and result["dtypes"] == ["float32", "bfloat16"]
    assert result["params"] == result["params_torch"] > 0  # both sides loaded the same checkpoint
    for suffix in ("", "_bf16"):
        for key in SCALARS:
            assert _positive(result[key + suffix]), (key + suffix, result[key + suffix])
        for key, sides in PER_SIDE.items():
            assert all(_positive(result[key + suffix][side]) for side in sides), (key + suffix, result[key + suffix])
        # on CPU there is no roofline: every fraction is null, never a made-up number
        roof = result["roofline" + suffix]
        assert _positive(roof["model_flops_train_step"]) and _positive(roof["model_bytes_rollout"])
        for side in ("ours", "torch"):
            assert roof[side]["device"] is None
            assert all(roof[side][k] is None for k in roof[side] if k.endswith("_fraction"))

    for dtype, figures in result["per_dtype"].items():
        seconds = figures["rollout_seconds"]
        assert len(seconds["ours"]) == len(seconds["hf"]) == 2 and len(figures["train_step_seconds"]["ours"]) == 2
        tokens = 3 * 5
        assert figures["rollout_tokens_per_s"]["ours"] == pytest.approx(tokens / figures["rollout_s"]["ours"])
        assert figures["rollout_speedup_vs_hf"] == pytest.approx(
            figures["rollout_tokens_per_s"]["ours"] / figures["rollout_tokens_per_s"]["hf"])
        assert figures["train_speedup_vs_torch"] == pytest.approx(
            figures["train_step_s"]["torch"] / figures["train_step_s"]["ours"])
        assert figures["info"]["ours"]["dtype"] == figures["info"]["torch"]["dtype"] == dtype
        assert figures["info"]["ours"]["threads"] == figures["info"]["torch"]["threads"] == result["threads"]
        assert _positive(figures["ours_rollout_breakdown_ms"]["generate_step_ms"])
        # every round starts with an untimed step on both sides (a new trainer compiles), two in bfloat16's first
        warm_ups = 2 + (1 if dtype == "bfloat16" else 0)
        assert len(figures["train_warm_up_s"]["ours"]) == len(figures["train_warm_up_s"]["torch"]) == warm_ups
        assert all(_positive(v) for side in ("ours", "torch") for v in figures["rss_gb_after_train_round"][side])


def test_roofline_table_and_model_flops():
    assert roofline.device_peaks("cpu") is None and roofline.device_peaks(None) is None
    assert roofline.device_peaks("NVIDIA H200").bandwidth == 4.8e12
    assert roofline.device_peaks("NVIDIA H100 80GB HBM3").name == "NVIDIA H100 SXM"
    assert roofline.device_peaks("TPU v5 lite").name == "TPU v5e"
    config = realshape.SHAPES["real"]
    # Qwen2.5-0.5B: 494M parameters, 136M of them the (tied) embedding; every weight but norms/biases is a matmul
    assert 3.5e8 < roofline.matmul_weights(config) - config.vocab_size * config.hidden_size < 3.65e8
    # a train step is 3 forward passes: ~6 FLOPs per weight per token, plus attention
    flops = roofline.train_step_flops(config, 4, 256)
    assert 6 * roofline.matmul_weights(config) * 1024 < flops < 1.05 * 6 * roofline.matmul_weights(config) * 1024


def test_default_dtypes_skip_bfloat16_only_where_a_side_lacks_its_kernels():
    native = {"ours": {"float32": 139.0, "bfloat16": 111.0}, "torch": {"float32": 120.0, "bfloat16": 240.0}}
    fallback = {"ours": {"float32": 139.0, "bfloat16": 111.0}, "torch": {"float32": 124.0, "bfloat16": 18.9}}
    assert realshape.plan_dtypes(realshape.DTYPES, False, native) == (["float32", "bfloat16"], {})
    dtypes, skipped = realshape.plan_dtypes(realshape.DTYPES, False, fallback)
    assert dtypes == ["float32"] and list(skipped) == ["bfloat16"]
    assert "torch's bfloat16 projection runs at 0.15x" in skipped["bfloat16"]["skipped"]
    assert "ours" not in skipped["bfloat16"]["skipped"].split(":")[1]  # only the side that falls short is named
    assert skipped["bfloat16"]["matmul_gflops"] == fallback
    # an explicit --dtypes runs what it lists, whatever the probe would say
    assert realshape.plan_dtypes(realshape.DTYPES, True, None) == (["float32", "bfloat16"], {})
    assert realshape.plan_dtypes(("float32",), False, None) == (["float32"], {})


@pytest.mark.timeout(120)
def test_probe_measures_both_dtypes_on_both_sides():
    config, workload = realshape.SHAPES["tiny"], realshape.Workload([[3, 4]], 2, 2, 16, 0)
    for side in ("ours", "torch"):
        rates = realshape.probe_rates(side, config, workload, threads=1)
        assert set(rates) == {"float32", "bfloat16"} and all(_positive(v) for v in rates.values()), (side, rates)
