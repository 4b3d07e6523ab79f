"""The cost model against cases worked out by hand, and its bad-input errors.

The hand cases use a made-up model and chip whose numbers are easy to follow:

model (`SMALL`): hidden e=64, MLP m=128, 2 layers, 4 heads, 2 KV heads, head_dim d=16, vocabulary 1000,
untied, no biases (a Llama: Qwen2 configs always have q/k/v biases).
  matmul weights per layer = e(h+2k)d + h d e + 3 e m = 64*8*16 + 4*16*64 + 3*64*128
                           = 8192 + 4096 + 24576 = 36864;  x 2 layers = 73728;  + LM head 64*1000
                           -> W = 137728
  parameters = 2 layers x (attention 64*16*(2*4 + 2*2) = 12288 + MLP 24576 + 2 norms 128 = 36992)
               + embedding 64000 + LM head 64000 + final norm 64 = 202048
  forward FLOPs per token attending to K keys = 2W + 4 * layers * heads * d * K = 275456 + 512 K
  KV bytes per position = 2 (K and V) * 2 layers * 2 KV heads * 16 * 2 bytes = 256

chip (`ROUND`): 1e10 FLOP/s, 1e9 B/s HBM (ridge: 10 FLOP per byte), 1 GB, interconnect 4e9 B/s both ways
(2e9 one way).
"""

import json

import pytest

from flexmarl_jax.emulation import (
    CHIPS,
    Chip,
    CostModel,
    Link,
    TimeScale,
    get_chip,
    get_link,
    parse_emulate,
    resolve_model_shape,
    transfer_s,
)
from flexmarl_jax.models.config import ModelConfig
from flexmarl_jax.models.presets import get_preset
from tests.settings_views import cost_model

SMALL = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, tie_word_embeddings=False, qkv_bias=False,
                    architecture="LlamaForCausalLM")
ROUND = Chip(name="round", title="a chip with round numbers", peak_bf16_flops=1e10, hbm_bytes_per_s=1e9,
             hbm_bytes=1e9, interconnect="ICI", interconnect_bytes_per_s=4e9, source="this test")


def small(**kwargs) -> CostModel:
    return cost_model(SMALL, ROUND, **{"collective_latency_s": 1e-5, **kwargs})


def test_sizes_of_the_small_model():
    model = small()
    assert SMALL.num_params() == 202048
    assert model.kv_bytes_per_token() == 256
    assert model.weights_bytes() == 404096  # 202048 x 2 bytes
    # 404096 weight bytes + 3e6 positions x 256 = 768.4 MB: one 1 GB chip; 4e6 positions: 1.0244 GB -> 2
    assert model.min_chips(kv_tokens=3_000_000) == 1
    assert model.min_chips(kv_tokens=4_000_000) == 2


def test_decode_is_the_larger_of_compute_and_memory_time():
    model = small()
    # batch 1, context 100: FLOPs 275456 + 51200 = 326656 -> 3.26656e-5 s;
    # bytes 2W = 275456 + 100 x 256 = 301056 -> 3.01056e-4 s: memory-bound
    assert model.decode_step_s(1, 100) == pytest.approx(3.01056e-4, rel=1e-12)
    # batch 64, context 100: FLOPs 64 x 326656 = 20905984 -> 2.0905984e-3 s;
    # bytes 275456 + 64 x 100 x 256 = 1913856 -> 1.913856e-3 s: compute-bound
    assert model.decode_step_s(64, 100) == pytest.approx(2.0905984e-3, rel=1e-12)


def test_prefill():
    # 2 prompts x 7 tokens, mean keys (7+1)/2 = 4: FLOPs 14 x (275456 + 2048) = 3885056 -> 3.885056e-4 s;
    # bytes 275456 + 14 x 256 = 279040 -> 2.7904e-4 s: compute-bound
    assert small().prefill_s(2, 7) == pytest.approx(3.885056e-4, rel=1e-12)


def test_training_micro_batch_and_optimizer_apply():
    model = small(mfu=0.5)
    # FLOPs 3 x 14 x 277504 = 11655168 at 0.5 x 1e10 -> 2.3310336e-3 s;
    # gradient accumulation 202048 x 8 bytes = 1616384 -> 1.616384e-3 s; total 3.9474176e-3 s
    assert model.train_micro_batch_s(2, 7) == pytest.approx(3.9474176e-3, rel=1e-12)
    # Adam: 202048 x 30 bytes = 6061440 -> 6.06144e-3 s
    assert model.optimizer_apply_s() == pytest.approx(6.06144e-3, rel=1e-12)
    # twice the MFU: the compute part halves (1.1655168e-3), the memory part does not
    assert small(mfu=1.0).train_micro_batch_s(2, 7) == pytest.approx(1.1655168e-3 + 1.616384e-3, rel=1e-12)


def test_tensor_parallel_splits_the_work_and_adds_collectives():
    two = small(chips=2, mfu=0.5)
    # decode batch 64, context 100 on 2 chips: roofline 2.0905984e-3 / 2 = 1.0452992e-3;
    # 2 layers x 2 all-reduces of 64 tokens x 64 x 2 bytes = 8192 bytes, each 2(2-1)/2 x 8192 / 2e9
    # = 4.096e-6 s + 1e-5 latency = 1.4096e-5; x 4 = 5.6384e-5
    assert two.decode_step_s(64, 100) == pytest.approx(1.0452992e-3 + 5.6384e-5, rel=1e-12)
    # training [2, 7]: compute 1.1655168e-3 + accumulation 8.08192e-4, and 2 passes x 2 layers x 2 = 8
    # all-reduces of 14 x 64 x 2 = 1792 bytes: 8 x (8.96e-7 + 1e-5) = 8.7168e-5
    assert two.train_micro_batch_s(2, 7) == pytest.approx(1.1655168e-3 + 8.08192e-4 + 8.7168e-5, rel=1e-12)
    assert two.optimizer_apply_s() == pytest.approx(6.06144e-3 / 2, rel=1e-12)
    assert small().tensor_parallel_s(64, passes=1) == 0.0  # one chip: no collectives


def test_transfers():
    link = Link("slow", bytes_per_s=1e8, latency_s=1e-3)
    # 404096 weight bytes over 1e8 B/s after 1 ms: 5.04096e-3 s; two shards in parallel: 3.02048e-3 s
    assert small().weight_sync_s(link) == pytest.approx(5.04096e-3, rel=1e-12)
    assert small(chips=2).weight_sync_s(link) == pytest.approx(3.02048e-3, rel=1e-12)
    assert transfer_s(1e9, link) == pytest.approx(10.001, rel=1e-12)
    # a chip's own interconnect, one direction: half the published bidirectional figure
    assert get_link("ici", get_chip("v5e")).bytes_per_s == 200e9
    assert get_link("nvlink", get_chip("h200")).bytes_per_s == 450e9


def test_a_real_model_on_a_real_chip():
    """Qwen2.5-14B decoding one token on one H200 reads every matmul weight once.

    W = 48 x (5120 x 56 x 128 + 40 x 128 x 5120 + 3 x 5120 x 13824) + 5120 x 152064
      = 48 x (36700160 + 26214400 + 212336640) + 778567680 = 13990625280
    bytes = 2W + one position's KV (2 x 48 x 8 x 128 x 2 = 196608) = 27981447168 at 4.8e12 B/s
          = 5.829468160e-3 s (compute: ~2.8e13 FLOPs / 989.5e12 = 2.8e-5 s)."""
    model = cost_model(get_preset("qwen2.5-14b"), get_chip("h200"))
    assert model.decode_step_s(1, 1) == pytest.approx(27981447168 / 4.8e12, rel=1e-12)
    assert model.min_chips() == 1  # 29.5 GB of bf16 weights in 141 GB
    assert cost_model(get_preset("qwen2.5-32b"), get_chip("v5e")).min_chips() == 5  # 65.5 GB in 16 GB chips


def test_chip_table_holds_the_required_chips_with_sources():
    assert {"v5e", "v5p", "v6e"} <= set(CHIPS) and {"h100", "h200"} & set(CHIPS)
    for name, chip in CHIPS.items():
        assert chip.name == name and chip.source.startswith("https://")
        assert chip.peak_bf16_flops > 1e14 and chip.hbm_bytes_per_s > 1e11 and chip.hbm_bytes >= 16e9
    assert get_chip("V5P") is CHIPS["v5p"]


@pytest.mark.parametrize("mfu", [0.0, -0.1, 1.5, float("nan")])
def test_mfu_outside_zero_one_is_one_line_naming_it(mfu):
    with pytest.raises(ValueError, match=r"^mfu=.* is outside \(0, 1\]") as error:
        small(mfu=mfu)
    assert "\n" not in str(error.value)


def test_mfu_of_exactly_one_is_allowed():
    assert small(mfu=1.0).mfu == 1.0


def test_unknown_chip_and_model_name_the_choices():
    with pytest.raises(ValueError, match=r"^unknown chip 'tpu9'; choices: h100, h200, v5e, v5p, v6e$"):
        get_chip("tpu9")
    with pytest.raises(ValueError, match=r"^unknown model 'qwen9'; choices: a preset \(.*qwen2\.5-32b.*tiny\)"):
        resolve_model_shape("qwen9")
    with pytest.raises(ValueError, match=r"^unknown chip 'tpu9'"):
        parse_emulate("tpu9:tiny")
    with pytest.raises(ValueError, match=r"^emulate='v5p' is not CHIP:MODEL"):
        parse_emulate("v5p")
    with pytest.raises(ValueError, match=r"^unknown link 'carrier-pigeon'; choices: ici, dcn100, pcie4, pcie5$"):
        get_link("carrier-pigeon", get_chip("v6e"))


@pytest.mark.parametrize("compression", [0.5, 0.0, -3.0, float("nan")])
def test_compression_below_one_is_one_line_naming_it(compression):
    with pytest.raises(ValueError, match=r"^compression=.* must be >= 1") as error:
        TimeScale(compression)
    assert "\n" not in str(error.value)


def test_timescale_and_the_host_overhead_bound():
    scale = TimeScale(100.0)
    assert scale.wall_s(2.0) == pytest.approx(0.02) and scale.device_s(0.02) == pytest.approx(2.0)
    # a 0.5 s device step lasts 5 ms compressed: 1 ms of host overhead is 20% of it, 0.4 ms is 8%
    assert scale.overhead_share(1e-3, 0.5) == pytest.approx(0.2)
    assert not scale.overhead_within_bound(1e-3, 0.5)
    assert scale.overhead_within_bound(4e-4, 0.5)
    assert TimeScale(1.0).wall_s(3.0) == 3.0


def test_emulate_resolves_presets_and_hf_configs(tmp_path):
    device = parse_emulate("H200:qwen2.5-14b")
    assert device.chip is CHIPS["h200"] and device.model == get_preset("qwen2.5-14b")
    hf = SMALL.to_hf_config()
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert resolve_model_shape(str(tmp_path)) == SMALL  # a directory holding config.json
    assert parse_emulate(f"v6e:{tmp_path / 'config.json'}").model == SMALL
    (tmp_path / "broken.json").write_text(json.dumps({k: v for k, v in hf.items() if k != "hidden_size"}))
    with pytest.raises(ValueError, match=r"broken\.json lacks the field 'hidden_size'"):
        resolve_model_shape(str(tmp_path / "broken.json"))


def test_importing_the_cost_model_starts_no_jax():
    """Config checks and benches resolve chips and models before anything heavy starts."""
    import subprocess
    import sys

    code = "import sys, flexmarl_jax.emulation; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_chips_call_overhead_is_added_once_per_call():
    import dataclasses

    launched = cost_model(SMALL, dataclasses.replace(ROUND, call_overhead_s=5e-4), collective_latency_s=1e-5)
    # the hand cases above, each plus 0.5 ms; k decode steps in one go are k single steps, overhead included
    assert launched.decode_step_s(1, 100) == pytest.approx(3.01056e-4 + 5e-4, rel=1e-12)
    assert launched.prefill_s(2, 7) == pytest.approx(3.885056e-4 + 5e-4, rel=1e-12)
    assert launched.optimizer_apply_s() == pytest.approx(6.06144e-3 + 5e-4, rel=1e-12)
    assert launched.decode_steps_s(64, 100, 3) == pytest.approx(
        sum(launched.decode_step_s(64, 100 + step) for step in range(3)), rel=1e-12)
    assert launched.decode_steps_s(1, 100, 3) == pytest.approx(
        3 * (275456 + 5e-4 * 1e9) / 1e9 + (100 + 101 + 102) * 256 / 1e9, rel=1e-12)  # memory-bound steps


def test_a_measured_chip_is_registered_for_the_process_but_never_over_a_spec_sheet_one():
    import dataclasses

    from flexmarl_jax.emulation.chips import register_chip

    measured = dataclasses.replace(ROUND, name="measured-test", source="measured by this test", one_device=True)
    try:
        assert register_chip(measured) is measured and get_chip("measured-test") is measured
        assert parse_emulate("measured-test:tiny").chip.one_device
    finally:
        CHIPS.pop("measured-test", None)
    with pytest.raises(ValueError, match=r"^chip name 'v5p' is a spec-sheet chip's"):
        register_chip(dataclasses.replace(ROUND, name="v5p"))
    assert not any(chip.one_device or chip.call_overhead_s for chip in CHIPS.values())  # spec sheets: neither
    with pytest.raises(ValueError, match=r"^chip 'round': engine_slowdown_beside_training=0.9 must be >= 1"):
        dataclasses.replace(ROUND, one_device=True, engine_slowdown_beside_training=0.9)
    with pytest.raises(ValueError, match=r"training_slowdown_beside_engines=2.0 applies only to a one_device chip"):
        dataclasses.replace(ROUND, training_slowdown_beside_engines=2.0)


def test_a_one_device_chip_gives_engines_one_timeline_and_trainers_another():
    """This host as a chip: every engine's calls queue on one timeline, every trainer's calls and weight syncs
    on a second (chips.Chip.one_device); a spec-sheet chip gives each its own."""
    import dataclasses

    from flexmarl_jax.config import RunConfig, apply_overrides
    from flexmarl_jax.configs import tiny
    from flexmarl_jax.emulation.chips import register_chip
    from flexmarl_jax.orchestrator.emulated_setup import Emulation

    def emulation(chip: str) -> Emulation:
        config = apply_overrides(tiny.get_config("smoke"), {"workdir": "/unused", "pipeline.emulate": f"{chip}:tiny"})
        return Emulation.from_config(RunConfig.from_config(config))

    register_chip(dataclasses.replace(ROUND, name="measured-two-lanes", source="measured by this test",
                                      one_device=True))
    try:
        shared = emulation("measured-two-lanes")
    finally:
        CHIPS.pop("measured-two-lanes", None)
    assert shared.shared_rollout_device is not None and shared.shared_train_device is not None
    assert shared.shared_rollout_device is not shared.shared_train_device
    shared.shared_train_device.enqueue(10.0)  # a trainer's long call does not hold up an engine's
    assert shared.shared_rollout_device.enqueue(1.0) - shared.shared_train_device.clock() < 2.0
    register_chip(dataclasses.replace(ROUND, name="measured-contended", source="measured by this test",
                                      one_device=True, engine_slowdown_beside_training=3.0,
                                      training_slowdown_beside_engines=1.5))
    try:
        contended = emulation("measured-contended")
    finally:
        CHIPS.pop("measured-contended", None)
    contended.shared_train_device.enqueue(10.0)  # ... but slows it by the chip's measured factor
    assert 2.9 < contended.shared_rollout_device.enqueue(1.0) - contended.shared_train_device.clock() < 3.0
    spec = emulation("v5p")
    assert spec.shared_rollout_device is None and spec.shared_train_device is None
