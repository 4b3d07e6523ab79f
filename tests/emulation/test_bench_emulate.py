"""`flexmarl bench emulate`: the headline figures are the stated ratios of the modes' numbers, a small preset
runs one mode end to end through the real orchestrator, and bad preset changes are refused."""

import pytest

from flexmarl_jax.bench import emulate
from flexmarl_jax.bench._emulate_presets import MA


def test_headline_figures_are_the_stated_ratios():
    def mode(e2e, tokens_per_s, utilization=0.5):
        return {"e2e_s": e2e, "tokens_per_s": tokens_per_s, "train_utilization": utilization,
                "host_overhead_within_bound": True}

    figures = emulate.headline({"serial": mode(70.0, 10.0), "sync": mode(20.0, 30.0),
                                "flexmarl": mode(10.0, 100.0, 0.6),
                                "no_async": mode(20.3, 50.0), "no_balancing": mode(12.0, 77.0),
                                "static_allocation": mode(10.0, 100.0, 0.2)})
    assert figures["speedup_vs_serial"] == pytest.approx(7.0)
    assert figures["speedup_vs_sync"] == pytest.approx(2.0)
    assert figures["e2e_increase_without_async"] == pytest.approx(1.03)  # +103%, as the paper writes it
    assert figures["throughput_loss_without_balancing"] == pytest.approx(0.23)
    assert figures["train_utilization"] == 0.6 and figures["train_utilization_static_allocation"] == 0.2
    assert emulate.headline({"flexmarl": mode(10.0, 1.0)})["speedup_vs_serial"] is None  # a mode not run


def test_the_ma_preset_is_the_papers_team_shape():
    assert MA.agents == 15 and MA.instances_per_agent == 4 and MA.max_response == 8192
    assert MA.queries * MA.samples == 64 and MA.micro_batch == 16 and MA.max_staleness == 5
    assert len(MA.proposers()) == sum(MA.proposer_calls) > MA.agents - 1  # skew: some agents answer more than once


@pytest.mark.timeout(120)
def test_a_small_preset_runs_a_mode_through_the_orchestrator(tmp_path):
    preset = MA.scaled(proposer_calls=(2, 1), max_response=16, median_response=4, instances_per_agent=1,
                       queries=1, train_slices=1, compression=20.0, iterations=1)
    numbers = emulate.run_mode(preset, "flexmarl", preset.modes()["flexmarl"], seed=0, root=str(tmp_path))
    assert numbers["e2e_s"] > 0 and numbers["tokens_per_s"] > 0
    assert numbers["e2e_s"] == pytest.approx(numbers["wall_s_per_iteration"] * 20.0)
    assert 0 < numbers["train_utilization"] <= 1 and numbers["host_stall_share"] >= 0


def test_bad_preset_changes_are_refused(capsys):
    with pytest.raises(SystemExit):
        emulate.parse_args(["--set", "agents=3"])
    assert "expected FIELD=VALUE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        emulate.parse_args(["--presets", "XX"])
    with pytest.raises(SystemExit):
        emulate.parse_args(["--emulate", "tpu9:qwen2.5-14b"])
    assert "unknown chip 'tpu9'; choices: h100, h200, v5e, v5p, v6e" in capsys.readouterr().err
    assert emulate.parse_args(["--emulate", "h200:qwen2.5-32b"]).changes == {"emulate": "h200:qwen2.5-32b"}
