"""`flexmarl bench lora` at the smallest size: every figure is there, the adapter sync moves a fraction of the
model's bytes (the tiny preset's rank-16 adapter is large against its 64-wide layers; on SmolLM2 it is 3.6%), and
the two peak-memory side processes report."""

import json

import pytest

from flexmarl_jax.cli.main import main


@pytest.mark.timeout(600)
def test_the_lora_bench_reports_every_figure(tmp_path):
    path = tmp_path / "lora.json"
    assert main(["bench", "lora", "--model", "tiny", "--agents", "2,3", "--separate", "3", "--slots", "4",
                 "--new-tokens", "2", "--repeats", "1", "--train-len", "16", "--rank", "4",
                 "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert sorted(result["agents"]) == ["2", "3"] and "separate_tokens_per_s" in result["agents"]["3"]
    for figures in result["agents"].values():
        assert figures["mixed_tokens_per_s"] > 0 and figures["base_tokens_per_s"] > 0
        assert figures["mixed_vs_base_tokens_per_s"] == pytest.approx(
            figures["mixed_tokens_per_s"] / figures["base_tokens_per_s"])
    assert result["mixed15_vs_separate_engines_tokens_per_s"] == result["agents"]["3"]["mixed_vs_separate_tokens_per_s"]
    sync = result["sync"]
    assert sync["adapter_bytes"] < sync["full_bytes"] and result["adapter_sync_bytes_fraction"] == pytest.approx(
        sync["adapter_bytes"] / sync["full_bytes"])
    assert result["train_step_s"]["adapter"] > 0 and result["train_step_s"]["full"] > 0
    memory = result["memory"]
    assert memory["agents"] == 3 and memory["team_peak_rss_bytes"] > 0 and memory["full_peak_rss_bytes"] > 0
    assert result["team15_peak_memory_vs_one_full_agent"] == pytest.approx(
        memory["team_peak_rss_bytes"] / memory["full_peak_rss_bytes"])
