"""`flexmarl bench pipeline --emulate CHIP:MODEL`: the quick workload's modes on emulated chips (their E2E then
follows the cost model of a 14B model, not this CPU), every emulated resource on chips of its own; a bad value
is one line naming it and the choices."""

import json

import pytest

from flexmarl_benchmarks import pipeline


@pytest.mark.timeout(300)
def test_the_quick_bench_runs_its_modes_on_emulated_chips(tmp_path):
    path = tmp_path / "pipeline.json"
    assert pipeline.main(["--quick", "--modes", "sync,flexmarl", "--emulate", "v5p:qwen2.5-14b",
                          "--set", "pipeline.emulate_compression=20", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert "paced" not in result  # the emulation sets the pace
    for name, numbers in result["modes"].items():
        assert numbers["overrides"]["pipeline.emulate"] == "v5p:qwen2.5-14b", name
        assert 0 < numbers["utilization"] <= 1 and numbers["tokens_per_s"] > 0, name
        # 3 agents x (1 instance + 1 training mesh), one v5p chip each: six emulated chips
        assert numbers["devices"] == 6, name
        # a 14B model's decode step on v5p is ~10 ms, compressed 20x: an iteration of 8-token responses
        # and 14B training steps lasts well over a millisecond of wall time
        assert numbers["e2e_s"] > 0.01, name


@pytest.mark.parametrize("value, message", [
    ("tpu9:qwen2.5-14b", "--emulate: unknown chip 'tpu9'; choices: h100, h200, v5e, v5p, v6e"),
    ("v5p", "--emulate: emulate='v5p' is not CHIP:MODEL"),
])
def test_a_bad_emulate_value_is_one_line(value, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pipeline.parse_args(["--emulate", value])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
