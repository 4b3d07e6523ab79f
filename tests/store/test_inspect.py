"""`flexmarl inspect` store part: per-agent counts, versions seen, columns."""

from flexmarl_jax.store import ExperienceStore
from flexmarl_jax.store.inspect import format_store_summary, summarize_store


def test_summary_counts_states_and_versions(tmp_path):
    store = ExperienceStore.open(tmp_path, agents=["planner", "solver"], backend="file")
    full = {
        "prompt_tokens": [[1]] * 2,
        "response_tokens": [[2, 3]] * 2,
        "behaviour_logprobs": [[-0.1, -0.2]] * 2,
        "reward": [1.0, 0.0],
        "advantage": [0.5, -0.5],
    }
    for i, version in enumerate([0, 1, 1]):
        store.append_rows("solver", input_ids=[f"q{i}"] * 2, trajectory_ids=[0, 1], group_size=2,
                          policy_versions={"solver": version, "planner": 2}, columns=full)  # fmt: skip
    store.append_rows(
        "solver", input_ids=["p"], trajectory_ids=[0], group_size=2, policy_versions={"solver": 1}
    )
    store.mark_consumed(store.claim_micro_batch("solver", 2, current_versions={"solver": 0, "planner": 2}))
    store.claim_micro_batch("solver", 2, current_versions={"solver": 1, "planner": 2})  # a lease: not stored
    store.close()
    summary = {entry["agent"]: entry for entry in summarize_store(tmp_path)}
    solver = summary["solver"]
    assert (solver["rows"], solver["groups"]) == (7, 4)
    assert (solver["pending"], solver["ready"], solver["claimed"], solver["consumed"]) == (1, 4, 0, 2)
    assert solver["versions"] == {"solver": [0, 1], "planner": [2]}
    assert solver["columns"]["response_tokens"] == "int32[]"
    assert summary["planner"]["rows"] == 0 and summary["planner"]["versions"] == {}
    text = format_store_summary(tmp_path)
    assert "solver" in text and "solver:0..1" in text and "planner:2" in text
    assert all(header in text for header in ("rows", "pending", "consumed", "versions seen"))


def test_summary_of_a_workdir_without_a_store(tmp_path):
    assert format_store_summary(tmp_path).startswith("store: none at file://")
    assert not (tmp_path / "store").exists()
