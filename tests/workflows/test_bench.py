"""The workflows benchmark's bookkeeping (its speed figure belongs to `flexmarl bench workflows`)."""

import json

import pytest

from flexmarl_benchmarks import workflows as bench


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workflow", ["chain", "debate"])
def test_bench_writes_the_documented_keys(tmp_path, workflow):
    path = tmp_path / "out.json"
    argv = [
        "--json",
        str(path),
        "--workflow",
        workflow,
        "--queries",
        "3",
        "--samples",
        "2",
        "--repeats",
        "2",
        "--base-ms",
        "0.2",
        "--tail-ms",
        "2",
        "--tail-prob",
        "0.3",
    ]
    assert bench.main(argv) == 0
    result = json.loads(path.read_text())
    assert result["dependency_driven_speedup"] > 0
    assert sum(result["agent_request_share"].values()) == pytest.approx(1.0)
    load = result["load"]
    total_calls = sum(agent["calls"] for agent in load.values())
    for agent, share in result["agent_request_share"].items():
        assert share == pytest.approx(load[agent]["calls"] / total_calls)
    # A stage can only end with its slowest call, so the staged critical path is never the shorter one.
    assert result["ideal_staged_s"] >= result["ideal_dependency_s"] > 0
    assert len(result["staged_s"]) == len(result["dependency_s"]) == 2
    if workflow == "chain":
        assert load["solver"]["calls"] == 12  # 2 batches x 3 queries x 2 samples
        assert load["corrector"]["calls"] + load["corrector"]["skipped"] == 12


def test_bench_rejects_bad_arguments(capsys):
    assert bench.main(["--queries", "0"]) == 2
    assert "--queries=0 must be >= 1" in capsys.readouterr().err
