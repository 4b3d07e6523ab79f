"""This host as an emulated chip: the probe's figures are positive, finite and of a CPU's order, and the chip
is one device (a run's fake XLA devices share the same cores)."""

import math

import pytest

from flexmarl_jax.emulation.host_probe import HOST_CHIP, probe_host, work_conserving


def test_the_host_probe_measures_a_cpu():
    chip = probe_host(matmul_rows=256, bandwidth_bytes=8 << 20)
    assert chip.name == HOST_CHIP and chip.one_device and chip.source.startswith("measured")
    for figure in (chip.peak_bf16_flops, chip.hbm_bytes_per_s, chip.hbm_bytes, chip.call_overhead_s):
        assert math.isfinite(figure) and figure > 0
    # a CPU core or two: between a MFLOP/s and a PFLOP/s, a call of microseconds to milliseconds
    assert 1e6 < chip.peak_bf16_flops < 1e15 and 1e6 < chip.hbm_bytes_per_s < 1e13
    assert 1e-7 < chip.call_overhead_s < 5e-2


@pytest.mark.timeout(300)  # a thread keeps one side busy while the other is timed
def test_the_program_probe_measures_a_real_engine_and_trainer_and_how_they_slow_each_other():
    """`probe_programs` on the smoke config: per-call costs of a CPU's order, an MFU in (0, 1], and contention
    factors of at least 1 (each is clipped there), one of them above: engine and trainer share this host's
    cores, so at least one side slows. Which one is the host's doing: on CI, the engines once ran untouched
    (1.0) while training slowed 3.0x."""
    from flexmarl_benchmarks._program_probe import probe_programs
    from flexmarl_jax.config import RunConfig, apply_overrides
    from flexmarl_jax.configs import tiny

    config = RunConfig.from_config(apply_overrides(tiny.get_config("smoke"), {"workdir": "/unused"}))
    costs = probe_programs(config, probe_host(matmul_rows=256, bandwidth_bytes=8 << 20), train_calls=3)
    assert 1e-5 < costs.decode_step_s < 1.0 and 1e-4 < costs.train_micro_batch_s < 10.0
    assert 0 <= costs.decode_call_overhead_s <= costs.decode_step_s  # the overhead is a part of a call
    assert 0 < costs.train_mfu <= 1
    measured = (costs.measured_engine_slowdown, costs.measured_training_slowdown)
    assert all(1.0 <= factor < 20 for factor in measured) and max(measured) > 1.0
    # the chip's factors: the measured split of the cores, conserving their work
    engine, training = costs.engine_slowdown_beside_training, costs.training_slowdown_beside_engines
    assert 1 / engine + 1 / training <= 1 + 1e-9
    assert engine / training == pytest.approx(costs.measured_engine_slowdown / costs.measured_training_slowdown)


def test_two_sides_sharing_the_cores_get_no_more_done_than_either_alone():
    # rates 1/1.2 + 1/2.5 = 1.2333: both factors scaled by it, so the rates sum to one
    engine, training = work_conserving(1.2, 2.5)
    assert (engine, training) == pytest.approx((1.48, 3.0833333), rel=1e-6)
    assert 1 / engine + 1 / training == pytest.approx(1.0)
    assert work_conserving(2.0, 3.0) == (2.0, 3.0)  # rates 0.83: already below the host's throughput
    assert work_conserving(2.0, 2.0) == (2.0, 2.0)  # exactly one
