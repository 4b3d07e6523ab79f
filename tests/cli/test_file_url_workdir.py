"""A `file://` URL workdir works for a whole run: metrics, plots, checkpoints, the store and the journal all land
under the path it names (flexmarl_jax/workdir_paths.py)."""

import json

import pytest

from flexmarl_jax.cli.main import main


@pytest.mark.timeout(600)
def test_a_whole_run_on_a_file_url_workdir(tmp_path):
    workdir = tmp_path / "run"
    code = main(["train", "--config=configs/tiny.py:smoke", f"--workdir=file://{workdir}",
                 "--config.store.backend=file", "--config.eval.enabled=False"])
    assert code == 0
    assert json.loads((workdir / "config.json").read_text())["workdir"] == str(workdir)
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [record["iteration"] for record in records] == [0, 1]
    for agent in ("solver", "verifier", "corrector"):
        assert sorted(p.name for p in (workdir / "checkpoints" / agent).iterdir() if p.name.isdigit()) == ["1", "2"]
    assert (workdir / "store" / "manifest.ocdbt").is_file()  # the experience store's OCDBT database
    assert (workdir / "timeline.json").is_file() and (workdir / "plots" / "curves.png").is_file()
    assert json.loads((workdir / "attempts.json").read_text()) == {"0": 1, "1": 1}  # the journal
    assert not (tmp_path / "file:").exists()  # nothing went to a directory named after the URL
