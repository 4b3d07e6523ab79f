"""Plots: every function writes real, non-blank PNGs and returns their paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from matplotlib import image

from flexmarl_jax import metrics
from flexmarl_jax.metrics import plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_real_png(path: Path, min_width: int = 400, min_height: int = 250) -> None:
    assert path.exists(), path
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    pixels = image.imread(path)
    height, width = pixels.shape[:2]
    assert width >= min_width and height >= min_height, (path, pixels.shape)
    assert float(np.std(pixels[..., :3])) > 0.05, f"{path} is (nearly) blank"


def test_curves_from_records_and_from_a_workdir(tmp_path, synthetic_records):
    written = plots.plot_curves(synthetic_records, tmp_path / "from_records")
    assert [path.name for path in written] == ["curves.png", "train_stats.png", "time_breakdown.png"]
    for path in written:
        assert_real_png(path)

    with metrics.MetricsWriter(tmp_path / "run", tensorboard=False) as writer:
        for record in synthetic_records:
            writer.write(record)
    from_workdir = plots.plot_curves(tmp_path / "run", tmp_path / "from_workdir")
    assert [path.name for path in from_workdir] == [path.name for path in written]


def test_curves_accept_flattened_agent_keys_and_skip_missing_panels(tmp_path):
    records = [
        {
            "iteration": i,
            "team_accuracy": 0.1 * i,
            "agent/solver/accuracy": 0.12 * i,
            "agents/planner/accuracy": 0.05,
        }
        for i in range(5)
    ]
    rows = [metrics.flatten(record) for record in records]
    assert set(plots._agent_series(rows, ["planner", "solver"], "accuracy")) == {"planner", "solver"}
    written = plots.plot_curves(records, tmp_path)
    assert [path.name for path in written] == ["curves.png"]  # no kl/clip/entropy, no times
    assert_real_png(written[0])
    assert plots.plot_curves([], tmp_path / "empty") == []


@pytest.mark.parametrize("color_by", ["agent", "kind"])
def test_gantt_chart(tmp_path, synthetic_timeline, color_by):
    written = plots.plot_gantt(synthetic_timeline, tmp_path, color_by=color_by)
    assert written == [tmp_path / "gantt.png"]
    assert_real_png(written[0], min_width=800)
    window = plots.plot_gantt(synthetic_timeline, tmp_path, color_by=color_by, t0=15, t1=45, filename="w.png")
    assert_real_png(window[0], min_width=800)


def test_load_plot(tmp_path, synthetic_timeline):
    written = plots.plot_load(synthetic_timeline, tmp_path)
    assert written == [tmp_path / "load.png"]
    assert_real_png(written[0], min_width=800, min_height=600)


def test_plot_all_replots_a_workdir_from_its_files(tmp_path, synthetic_records, synthetic_timeline):
    with metrics.MetricsWriter(tmp_path, tensorboard=False) as writer:
        for record in synthetic_records:
            writer.write(record)
    synthetic_timeline.save(tmp_path)
    written = plots.plot_all(tmp_path)
    assert sorted(path.name for path in written) == [
        "curves.png",
        "gantt.png",
        "load.png",
        "time_breakdown.png",
        "train_stats.png",
    ]
    assert all(path.parent == tmp_path / "plots" for path in written)
    for path in written:
        assert_real_png(path)


def test_empty_timeline_still_plots_and_bad_color_by_is_rejected(tmp_path):
    timeline = metrics.Timeline()
    assert plots.plot_gantt(timeline, tmp_path)[0].read_bytes()[:8] == PNG_SIGNATURE
    assert plots.plot_load(timeline, tmp_path)[0].read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="color_by='resource' is not allowed"):
        plots.plot_gantt(timeline, tmp_path, color_by="resource")


def test_agent_colours_depend_on_the_set_of_names_not_their_order():
    first = plots.agent_colors(["solver", "verifier", "planner"])
    second = plots.agent_colors(["verifier", "planner", "solver", "solver"])
    assert first == second
    assert len(set(second.values())) == 3


def test_main_replots_a_workdir_and_rejects_an_empty_one(
    tmp_path, synthetic_records, synthetic_timeline, capsys
):
    with metrics.MetricsWriter(tmp_path, tensorboard=False) as writer:
        for record in synthetic_records[:3]:
            writer.write(record)
    synthetic_timeline.save(tmp_path)
    assert plots.main([str(tmp_path), "--out-dir", str(tmp_path / "png")]) == 0
    printed = capsys.readouterr().out
    assert "Run summary (3 records, iterations 0..2)" in printed
    assert sorted(Path(line).name for line in printed.splitlines() if line.endswith(".png")) == [
        "curves.png",
        "gantt.png",
        "load.png",
        "time_breakdown.png",
        "train_stats.png",
    ]
    with pytest.raises(SystemExit):
        plots.main([str(tmp_path / "nothing-here")])
    assert "holds neither metrics.jsonl nor timeline.json" in capsys.readouterr().err


def test_curves_put_the_held_out_evals_beside_the_training_curves(tmp_path):
    records = [{"iteration": i, "team_accuracy": 0.1 * i, "agent": {"solver": {"accuracy": 0.12 * i}}}
               for i in range(6)]
    evals = [{"kind": "eval", "iteration": step, "eval_team_accuracy": 0.1 + 0.1 * step,
              "eval_pass_at_k": 0.5 + 0.05 * step, "eval_sampled_accuracy": 0.2, "eval_k": 4,
              "agent": {"solver": {"eval_accuracy": 0.1 * step}}} for step in (0, 3, 6)]
    (without,) = plots.plot_curves(records, tmp_path / "train_only")
    (with_evals,) = plots.plot_curves(records + evals, tmp_path / "with_evals")
    assert_real_png(with_evals)
    # A third panel, as wide as each of the other two.
    width = image.imread(with_evals).shape[1] / image.imread(without).shape[1]
    assert width == pytest.approx(1.5, abs=0.01)
    (only_evals,) = plots.plot_curves(evals, tmp_path / "evals_only")  # e.g. a run stopped after its first eval
    assert_real_png(only_evals)
