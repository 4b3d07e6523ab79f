"""`flexmarl bench store` writes every documented key and counts no lost or duplicated rows."""

import json

import pytest

from flexmarl_benchmarks import store as store_bench


@pytest.mark.timeout(120)
def test_bench_store_json_keys(tmp_path):
    path = tmp_path / "store.json"
    argv = ["--json", str(path), "--rows", "512", "--file-rows", "256", "--append-batch", "64"]
    argv += [
        "--micro-batch",
        "32",
        "--group-size",
        "8",
        "--response-tokens",
        "16",
        "--workdir",
        str(tmp_path),
    ]
    assert store_bench.main(argv) == 0
    results = json.loads(path.read_text())
    for prefix in ("", "file_"):
        assert results[prefix + "append_rows_per_s"] > 0 and results[prefix + "claim_rows_per_s"] > 0
        assert results[prefix + "lost_rows"] == 0 and results[prefix + "duplicated_rows"] == 0
    assert results["response_tokens"] == 16
