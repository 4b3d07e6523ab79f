"""flexmarl_benchmarks/learning.py: the three runs' configs, the comparisons, and a small end-to-end run (JSON
structure and invariants of the budgeted curves; no accuracy or speed asserts)."""

import json
import subprocess
import sys

import pytest

from flexmarl_benchmarks import learning


def test_runs_differ_from_the_default_only_where_they_say(tmp_path):
    team = learning.run_config(learning.TEAM_FLEXMARL, seed=3, workdir=str(tmp_path))
    sync = learning.run_config(learning.TEAM_SYNC, seed=3, workdir=str(tmp_path))
    alone = learning.run_config(learning.SOLVER_ALONE, seed=3, workdir=str(tmp_path))
    assert team.pipeline.mode == "flexmarl" and sync.pipeline.mode == "sync"
    assert sync.to_dict() == {**team.to_dict(), "pipeline": {**team.to_dict()["pipeline"], "mode": "sync"}}
    assert sorted(team.agents) == ["corrector", "solver", "verifier"]
    assert tuple(alone.agents) == ("solver",) and alone.agents["solver"] == team.agents["solver"]
    assert alone.workflow.name == "dag" and alone.workflow.task == team.workflow.task
    # Same learning problem for the solver: task, split, eval list, warm-up and RL settings.
    for section in ("train", "eval", "rollout", "pipeline"):
        assert alone.to_dict()[section] == team.to_dict()[section]
    for field in ("task", "warmup", "warmup_steps", "warmup_learning_rate", "queries_per_iteration",
                  "samples_per_query"):
        assert getattr(alone.workflow, field) == getattr(team.workflow, field)
    assert alone.workflow.shaping_weights == {"own_answer_correct": team.workflow.shaping_weights["solver_correct"]}
    assert alone.seed == team.seed == 3


def test_overrides_reach_every_run_and_unknown_runs_are_refused(tmp_path):
    for name in learning.RUNS:
        config = learning.run_config(name, seed=0, workdir=str(tmp_path), overrides={"workflow.warmup_steps": "7"})
        assert config.workflow.warmup_steps == 7
    with pytest.raises(ValueError, match="unknown run 'duo'; allowed: team_flexmarl, team_sync, solver_alone"):
        learning.run_config("duo", seed=0, workdir=str(tmp_path))
    with pytest.raises(SystemExit):
        learning.parse_args(["--runs", "team_flexmarl,duo"])
    with pytest.raises(SystemExit):
        learning.parse_args(["--budget-s", "0"])


def test_config_spec_is_every_runs_start_and_smoke_adds_its_variant(tmp_path, monkeypatch):
    from flexmarl_jax.models.fixture_cache import synthetic_checkpoint

    # configs/smollm2_team.py reads $FLEXMARL_CHECKPOINTS/SmolLM2-135M-Instruct: a synthetic Llama stands in
    (tmp_path / "SmolLM2-135M-Instruct").symlink_to(synthetic_checkpoint("llama", size="smoke"))
    monkeypatch.setenv("FLEXMARL_CHECKPOINTS", str(tmp_path))
    spec = "configs/smollm2_team.py:cpu"
    team, sync, alone = (learning.run_config(name, seed=1, workdir=str(tmp_path / name), spec=spec)
                         for name in learning.RUNS)
    assert team.workflow.task == alone.workflow.task == "word_problems" and team.eval.samples == 0
    assert team.agents["solver"].model.endswith("SmolLM2-135M-Instruct") and tuple(alone.agents) == ("solver",)
    assert alone.agents["solver"] == team.agents["solver"] and sync.pipeline.mode == "sync"
    assert learning.config_spec(spec, smoke=True) == "configs/smollm2_team.py:cpu,smoke"
    assert learning.config_spec(None, smoke=True) == "flexmarl_jax.configs.tiny:smoke"
    smoke = learning.run_config(learning.TEAM_FLEXMARL, seed=1, workdir=str(tmp_path), smoke=True, spec=spec)
    assert smoke.workflow.queries_per_iteration == 4 and smoke.workflow.task == "word_problems"


def _run(at_budget: float) -> dict:
    return {"eval_accuracy_at_budget": at_budget}


def test_comparisons_are_ratios_and_differences_of_the_accuracy_at_budget():
    result = learning.summarize({learning.TEAM_FLEXMARL: _run(0.6), learning.TEAM_SYNC: _run(0.4),
                                 learning.SOLVER_ALONE: _run(0.8)}, budget_s=10.0, seed=1)
    assert result["eval_accuracy_at_budget"] == {"team_flexmarl": 0.6, "team_sync": 0.4, "solver_alone": 0.8}
    assert result["team_vs_solver_alone"] == pytest.approx(0.75)
    assert result["flexmarl_vs_sync_at_budget"] == pytest.approx(1.5)
    assert result["team_minus_solver_alone"] == pytest.approx(-0.2)
    assert result["flexmarl_minus_sync_at_budget"] == pytest.approx(0.2)
    zero = learning.summarize({learning.TEAM_FLEXMARL: _run(0.5), learning.SOLVER_ALONE: _run(0.0)},
                              budget_s=10.0, seed=1)
    assert zero["team_vs_solver_alone"] is None and zero["team_minus_solver_alone"] == 0.5
    assert zero["flexmarl_vs_sync_at_budget"] is None  # sync did not run


@pytest.mark.timeout(600)
def test_a_small_budgeted_comparison_reports_curves_in_rl_time(tmp_path):
    out = tmp_path / "learning.json"
    budget = 2.0
    completed = subprocess.run(
        [sys.executable, "-m", "flexmarl_benchmarks.learning", "--smoke", "--budget-s", str(budget),
         "--eval-every-s", "1", "--runs", "team_flexmarl,solver_alone", "--json", str(out)],
        capture_output=True, text=True, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"team_flexmarl", "solver_alone"}
    for name, run in result["runs"].items():
        curve = run["curve"]
        assert curve[0]["iteration"] == 0 and curve[0]["rl_s"] == 0.0  # the start of RL, before any update
        assert [p["iteration"] for p in curve] == sorted({p["iteration"] for p in curve})  # one eval per policy
        assert [p["rl_s"] for p in curve] == sorted(p["rl_s"] for p in curve)
        assert run["rl_s"] >= budget and run["iterations"] >= 1 and curve[-1]["iteration"] == run["iterations"]
        assert curve[-1]["rl_s"] == run["rl_s"]
        assert run["eval_accuracy_at_budget"] == curve[-1]["eval_team_accuracy"] == result[
            "eval_accuracy_at_budget"][name]
        assert all(0.0 <= p[key] <= 1.0 for p in curve for key in ("eval_team_accuracy", "eval_pass_at_k"))
    assert result["runs"]["solver_alone"]["agents"] == ["solver"]
    assert result["runs"]["team_flexmarl"]["agents"] == ["solver", "verifier", "corrector"]
    assert "team_vs_solver_alone" in result and result["flexmarl_vs_sync_at_budget"] is None
    assert (tmp_path / "learning.png").stat().st_size > 10_000
    assert "held-out greedy accuracy after 2 s of RL" in completed.stdout
