"""The workdir path layer: plain paths, file:// URLs and object-store URLs name one place for epath, TensorStore
and Orbax alike."""

import os

import pytest
from etils import epath

from flexmarl_jax import workdir_paths
from flexmarl_jax.config import ConfigError, RunConfig, load_config


def test_a_file_url_names_its_local_path_and_other_locations_are_kept():
    assert workdir_paths.normalize("file:///abs/run") == "/abs/run"
    assert workdir_paths.normalize("file://localhost/abs/my%20run") == "/abs/my run"
    assert workdir_paths.normalize("runs/tiny") == "runs/tiny"
    assert workdir_paths.normalize("gs://bucket/run") == "gs://bucket/run"
    assert [workdir_paths.is_local(x) for x in ("file:///a", "runs/x", "/a", "gs://b/r")] == [True, True, True, False]


@pytest.mark.parametrize(("location", "why"), [("file://host/abs", "names host 'host'"),
                                               ("file://relative", "names host 'relative'")])
def test_a_file_url_with_a_host_is_refused_in_one_line(location, why):
    with pytest.raises(workdir_paths.BadLocation, match=why):
        workdir_paths.normalize(location)


def test_one_location_gives_one_place_to_epath_tensorstore_and_orbax(tmp_path):
    url = f"file://{tmp_path}/run"
    assert workdir_paths.path(url, "metrics.jsonl") == epath.Path(tmp_path / "run" / "metrics.jsonl")
    assert workdir_paths.kvstore_url(url, "store") == f"file://{tmp_path}/run/store/"
    assert workdir_paths.kvstore_url("gs://bucket/run/", "store") == "gs://bucket/run/store/"
    assert os.fspath(workdir_paths.orbax_directory("gs://bucket/run", "checkpoints", "solver")) == \
        "gs://bucket/run/checkpoints/solver"
    relative = workdir_paths.orbax_directory("runs/x", "checkpoints")
    assert os.fspath(relative) == os.path.abspath("runs/x/checkpoints")


def test_appended_lines_and_atomic_writes_land_whole(tmp_path):
    target = workdir_paths.path(f"file://{tmp_path}", "log.jsonl")
    for number in range(3):
        workdir_paths.append_line(target, f"{number}\n")
    assert target.read_text() == "0\n1\n2\n"
    replaced = workdir_paths.path(tmp_path, "state.json")
    workdir_paths.write_atomically(replaced, "old")
    workdir_paths.write_atomically(replaced, "new")
    assert replaced.read_text() == "new" and sorted(os.listdir(tmp_path)) == ["log.jsonl", "state.json"]


def test_the_config_normalises_a_file_url_workdir_and_refuses_other_schemes(tmp_path):
    config = RunConfig.from_config(load_config("configs/tiny.py:smoke"))
    import dataclasses

    assert dataclasses.replace(config, workdir=f"file://{tmp_path}/run").workdir == f"{tmp_path}/run"
    assert dataclasses.replace(config, workdir="gs://bucket/run").workdir == "gs://bucket/run"
    with pytest.raises(ConfigError, match=r"^config.workdir='http://x/run' has scheme http://; allowed"):
        dataclasses.replace(config, workdir="http://x/run")
    with pytest.raises(ConfigError, match=r"^config.workdir='file://host/run': 'file://host/run' names host"):
        dataclasses.replace(config, workdir="file://host/run")
