"""`flexmarl train` stopped four ways on one workdir — a checkpoint save that fails (one agent already a version
ahead), a weight sync that fails (after its iteration's checkpoint and commit), a store commit that fails,
SIGTERM — each time with one line
saying how to resume and a stop in the journal; the workdir then resumes to the end with every iteration recorded
once and every sample trained exactly once. In-process (signals included), so the runs share one JAX start."""

import json
import os
import signal
import threading
import time

import pytest

from flexmarl_jax import faults
from flexmarl_jax.orchestrator.run_audit import iteration_records

# Enough iterations that the SIGTERM below lands before the last one wherever the failed commit left the run
# (with 4, a commit failing in iteration 2 left SIGTERM to land in the last iteration, which then just finished).
ITERATIONS = 6
ARGS = ["--config=configs/tiny.py:smoke", "--config.store.backend=file", f"--config.iterations={ITERATIONS}",
        "--config.eval.enabled=false", "--config.pipeline.debug_invariants=true"]


def _stop_line(capsys) -> str:
    (line,) = [text for text in capsys.readouterr().err.splitlines() if text.startswith("flexmarl train: stopped")]
    return line


@pytest.mark.timeout(900)
def test_failed_save_sync_commit_and_sigterm_each_stop_the_run_and_it_resumes(tmp_path, monkeypatch, capsys):
    from flexmarl_jax.cli.main import main
    from flexmarl_jax.orchestrator.journal import PENDING_TRAINED, RunJournal
    from flexmarl_jax.store import ExperienceStore

    workdir = str(tmp_path / "run")
    train = ["train", *ARGS, f"--workdir={workdir}"]
    hint = f"resumes from its last checkpoint: flexmarl train --workdir={workdir}"

    def run_with_fault(spec: str) -> int:
        monkeypatch.setenv(faults.ENV_VAR, spec)
        try:
            return main(train)
        finally:
            assert faults.fired(spec.split(":")[0]) == 1
            faults.disarm()
            monkeypatch.delenv(faults.ENV_VAR)

    # 1. Saves: the warm-up's 3 (one per agent), then 3 per iteration: the 5th is iteration 0's second agent's.
    assert run_with_fault("checkpoint_save:after=4") == 1
    line = _stop_line(capsys)
    assert "iteration 0 failed: injected fault checkpoint_save at " in line and hint in line
    assert iteration_records(workdir) == []
    # 2. Syncs: 3 at the start, then 3 per iteration: the 5th is iteration 0's (redone) second agent's.
    assert run_with_fault("weight_sync:after=4") == 1
    line = _stop_line(capsys)
    assert "iteration 0 failed: injected fault weight_sync at " in line and hint in line
    # 3. A commit of the experience store fails (the sixth of the run's).
    assert run_with_fault("store_commit:after=5") == 1
    line = _stop_line(capsys)
    assert "injected fault store_commit" in line and hint in line
    # 4. SIGTERM once a new iteration is recorded: that iteration's successor finishes, then the run stops.
    recorded = len(iteration_records(workdir))  # the resume writes iteration 0's record, kept with its checkpoint

    def terminate_after_an_iteration() -> None:
        deadline = time.monotonic() + 600
        while len(iteration_records(workdir)) <= max(recorded, 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate_after_an_iteration, daemon=True)
    killer.start()
    assert main(train) == 128 + signal.SIGTERM
    killer.join(5)
    stopped_at = len(iteration_records(workdir))
    assert 2 <= stopped_at < ITERATIONS
    line = _stop_line(capsys)
    assert f"stopped by SIGTERM after iteration {stopped_at - 1} (checkpointed)" in line and hint in line
    assert not os.path.exists(os.path.join(workdir, PENDING_TRAINED))  # finished, not cut
    assert [stop["reason"] for stop in RunJournal(workdir).stops()] == ["error", "error", "error", "signal"]
    # 5. The resume runs to the end.
    assert main(train) == 0
    records = iteration_records(workdir)
    assert [r["iteration"] for r in records] == list(range(ITERATIONS))  # each recorded exactly once
    store = ExperienceStore.open(workdir, backend="file", must_exist=True)
    try:
        for agent, counts in store.counters().items():
            trained = sum(r["agent"][agent]["samples"] for r in records)
            assert counts["consumed"] == trained, (agent, counts, trained)
            assert counts["ready"] == counts["claimed"] == counts["pending"] == 0, (agent, counts)
    finally:
        store.close()
    attempts = json.load(open(os.path.join(workdir, "attempts.json")))
    # The failed save's iteration was redone from the previous checkpoint; the failed sync came after its
    # iteration's checkpoint; the failed commit's iteration ran at most twice; SIGTERM let its iteration finish.
    assert sorted(attempts) == [str(i) for i in range(ITERATIONS)] and attempts["0"] == 2
    assert set(attempts.values()) <= {1, 2} and sum(v == 2 for v in attempts.values()) <= 2


@pytest.mark.timeout(900)
def test_faults_before_the_first_iteration_stop_cleanly_and_the_workdir_resumes(tmp_path, monkeypatch, capsys):
    """A warm-up save that fails after the first agent's was written, then an engine's first weight sync that
    fails: each a stop with one line and a journal entry (before the fix: a raw traceback from the setup, and
    the resume died in Orbax's StepAlreadyExistsError on the first agent's version 0)."""
    from flexmarl_jax.cli.main import main
    from flexmarl_jax.orchestrator.journal import RunJournal
    from flexmarl_jax.orchestrator.run_audit import audit_workdir, rows_per_iteration
    from flexmarl_jax.train.checkpoint import checkpoint_versions

    workdir = str(tmp_path / "run")
    train = ["train", "--config=configs/tiny.py:smoke", "--config.store.backend=file", "--config.iterations=1",
             "--config.eval.enabled=false", f"--workdir={workdir}"]
    for spec in ("checkpoint_save:after=1", "weight_sync:after=1"):
        monkeypatch.setenv(faults.ENV_VAR, spec)
        try:
            assert main(train) == 1, spec
        finally:
            assert faults.fired(spec.split(":")[0]) == 1
            faults.disarm()
            monkeypatch.delenv(faults.ENV_VAR)
        line = _stop_line(capsys)
        assert f"setup failed before the first iteration: injected fault {spec.split(':')[0]}" in line, line
        assert f"resumes from its last checkpoint: flexmarl train --workdir={workdir}" in line
        if spec.startswith("checkpoint_save"):  # one agent holds version 0, the others not
            held = [checkpoint_versions(os.path.join(workdir, "checkpoints", agent))
                    for agent in ("solver", "verifier", "corrector")]
            assert sorted(held) == [[], [], [0]], held
    stops = RunJournal(workdir).stops()
    assert [stop["reason"] for stop in stops] == ["error", "error"]
    assert all(stop["detail"].startswith("setup: InjectedFault") for stop in stops)
    assert main(train) == 0  # the cut warm-up save is deleted and redone; then the run's one iteration
    assert [record["iteration"] for record in iteration_records(workdir)] == [0]
    from flexmarl_jax.config import RunConfig, load_config
    from flexmarl_jax.config.workflow_from_config import workflow_from_config

    config = RunConfig.from_config(load_config("configs/tiny.py:smoke"))
    samples = config.workflow.queries_per_iteration * config.workflow.samples_per_query
    audit = audit_workdir(workdir, iterations=1,
                          expected_rows=rows_per_iteration(workflow_from_config(config.workflow), samples))
    assert audit.lost_rows == 0 and audit.double_trained_rows == 0, audit.findings
