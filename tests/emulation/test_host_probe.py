"""This host as an emulated chip: the probe's figures are positive, finite and of a CPU's order, and the chip
is one device (a run's fake XLA devices share the same cores)."""

import math

from flexmarl_jax.emulation.host_probe import HOST_CHIP, probe_host


def test_the_host_probe_measures_a_cpu():
    chip = probe_host(matmul_rows=256, bandwidth_bytes=8 << 20)
    assert chip.name == HOST_CHIP and chip.one_device and chip.source.startswith("measured")
    for figure in (chip.peak_bf16_flops, chip.hbm_bytes_per_s, chip.hbm_bytes, chip.call_overhead_s):
        assert math.isfinite(figure) and figure > 0
    # a CPU core or two: between a MFLOP/s and a PFLOP/s, a call of microseconds to milliseconds
    assert 1e6 < chip.peak_bf16_flops < 1e15 and 1e6 < chip.hbm_bytes_per_s < 1e13
    assert 1e-7 < chip.call_overhead_s < 5e-2
