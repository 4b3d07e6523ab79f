"""The store audit of `flexmarl bench faults` (orchestrator/run_audit.py): on a durable store whose rows were lost
and trained twice by hand, it counts exactly those rows, and nothing on a clean one."""

import numpy as np

from flexmarl_jax.orchestrator.run_audit import AgentRows, attempt_of, audit_rows, audit_workdir, rows_per_iteration
from flexmarl_jax.store import ExperienceStore

AGENTS = ["solver", "corrector"]  # the solver runs on every sample (2 per iteration), the corrector only sometimes
EXPECTED = {"solver": 2, "corrector": None}


def _append(store, agent, input_id, version, samples):
    versions = {"solver": version} if agent == "solver" else {"solver": version, "corrector": version}
    return store.append_rows(agent, input_ids=[input_id] * samples, trajectory_ids=list(range(samples)),
                             group_size=samples, policy_versions=versions,
                             columns={"reward": np.ones(samples, np.float32),
                                      "advantage": np.zeros(samples, np.float32),
                                      "prompt_tokens": [[1]] * samples, "response_tokens": [[2]] * samples,
                                      "behaviour_logprobs": [[-1.0]] * samples})


def test_rows_lost_and_trained_twice_by_hand_are_each_counted(tmp_path):
    store = ExperienceStore.open(str(tmp_path), agents=AGENTS, backend="file")
    # Version 0: attempt 0 failed (its solver rows dropped, but one corrector row was consumed: trained twice);
    # attempt 1 (input ids ending r1) was applied and fully consumed.
    failed = _append(store, "solver", "t-0-0", 0, 2)
    stray = _append(store, "corrector", "t-0-0", 0, 1)
    applied = _append(store, "solver", "t-0-0r1", 0, 2) + _append(store, "corrector", "t-0-0r1", 0, 1)
    store.consume_rows("corrector", stray)
    store.consume_rows("solver", applied[:2])
    store.consume_rows("corrector", applied[2:])
    assert store.drop_stale_rows(current_versions={"solver": 1, "corrector": 1}, max_staleness=0) == len(failed)
    # Version 1: one solver row and the corrector row were never consumed (2 lost).
    _append(store, "corrector", "t-1-0", 1, 1)
    store.consume_rows("solver", _append(store, "solver", "t-1-0", 1, 1))  # two groups of one: one consumed
    _append(store, "solver", "t-1-1", 1, 1)
    # Version 2: only one of the solver's 2 rows reached the store (1 lost), and it was consumed.
    store.consume_rows("solver", _append(store, "solver", "t-2-0", 2, 1))
    # Version 3 was never applied (the run had 3 iterations), yet 2 of its rows were consumed (trained twice).
    store.consume_rows("solver", _append(store, "solver", "t-3-0", 3, 2))
    store.close()

    audit = audit_workdir(str(tmp_path), iterations=3, expected_rows=EXPECTED)
    assert (audit.lost_rows, audit.double_trained_rows) == (1 + 1 + 1, 1 + 2)
    assert len(audit.findings) == 5 and not audit.clean
    assert any(line.startswith("corrector v0: 1 consumed rows of attempts other than the applied 1")
               for line in audit.findings)
    assert any(line.startswith("solver v3: 2 rows consumed for a version the run never applied")
               for line in audit.findings)
    # Its conditional agent's batch never exceeds one: two more corrector rows at version 0 are 2 more lost
    # (not consumed), and consuming them makes them count as neither lost nor doubled (no fixed batch).
    store = ExperienceStore.open(str(tmp_path), backend="file", must_exist=True)
    late = _append(store, "corrector", "t-0-1r1", 0, 2)
    assert audit_workdir(str(tmp_path), iterations=3, expected_rows=EXPECTED).lost_rows == 3 + 2
    store.consume_rows("corrector", late)
    store.close()
    assert audit_workdir(str(tmp_path), iterations=3, expected_rows=EXPECTED).lost_rows == 3


def test_a_clean_run_and_an_unapplied_version_without_rows():
    rows = AgentRows(["q-0-0_0_0", "q-0-0_0_1", "q-0-0r1_0_0", "q-0-0r1_0_1", "q-1-0_0_0", "q-1-0_0_1"],
                     np.array([5, 5, 4, 4, 4, 4]), np.array([0, 0, 0, 0, 1, 1]))
    clean = audit_rows({"solver": rows}, iterations=2, expected_rows={"solver": 2})
    assert clean.clean and clean.findings == []
    # A third iteration the run applied but whose rows the store does not have: its whole batch is lost.
    missing = audit_rows({"solver": rows}, iterations=3, expected_rows={"solver": 2})
    assert (missing.lost_rows, missing.double_trained_rows) == (2, 0)
    assert [attempt_of(s) for s in rows.sample_ids] == [0, 0, 1, 1, 0, 0]


def test_the_chain_trains_one_row_per_sample_of_solver_and_verifier_and_a_varying_count_of_the_corrector():
    from flexmarl_jax.workflows.builtin import chain

    assert rows_per_iteration(chain(), 16) == {"solver": 16, "verifier": 16, "corrector": None}
    assert rows_per_iteration(chain(corrector_runs="always"), 16) == {"solver": 16, "verifier": 16, "corrector": 16}
