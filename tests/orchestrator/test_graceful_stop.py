"""SIGTERM stops `flexmarl train` at an iteration boundary within a bounded time, says where to resume, and the
workdir resumes to the end with every sample trained exactly once."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ITERATIONS = 3
ARGS = ["--config=configs/tiny.py:smoke", "--config.store.backend=file", f"--config.iterations={ITERATIONS}",
        "--config.pipeline.debug_invariants=true", "--config.eval.enabled=false"]


def _train(workdir):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("XLA_FLAGS", None)  # the CLI fakes the config's CPU devices itself
    return subprocess.Popen([sys.executable, "-m", "flexmarl_jax.cli.main", "train", f"--workdir={workdir}", *ARGS],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _iterations(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        records = [json.loads(line) for line in handle if line.endswith("\n")]
    return [record for record in records if record.get("kind", "iteration") == "iteration"]


@pytest.mark.timeout(600)
def test_sigterm_finishes_the_iteration_and_the_workdir_resumes(tmp_path):
    from flexmarl_jax.orchestrator.journal import PENDING_TRAINED, RunJournal

    workdir = str(tmp_path / "run")
    first = _train(workdir)
    deadline = time.monotonic() + 400
    while not _iterations(workdir):
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, "the first iteration never finished"
        time.sleep(0.1)
    first.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    output, _ = first.communicate(timeout=120)
    assert time.monotonic() - signalled < 60  # the iteration in flight finishes; nothing else starts
    assert first.returncode == 128 + signal.SIGTERM, output
    (line,) = [text for text in output.splitlines() if text.startswith("flexmarl train: stopped by SIGTERM")]
    stopped_at = len(_iterations(workdir))
    assert 1 <= stopped_at < ITERATIONS
    assert f"after iteration {stopped_at - 1} (checkpointed)" in line
    assert f"resumes from its last checkpoint: flexmarl train --workdir={workdir}" in line
    assert not os.path.exists(os.path.join(workdir, PENDING_TRAINED))  # the iteration was finished, not cut
    assert RunJournal(workdir).stops()[-1]["reason"] == "signal"

    second = _train(workdir)
    output, _ = second.communicate(timeout=400)
    assert second.returncode == 0, output
    records = _iterations(workdir)
    assert [r["iteration"] for r in records] == list(range(ITERATIONS))  # each recorded exactly once
    from flexmarl_jax.store import ExperienceStore

    store = ExperienceStore.open(workdir, backend="file", must_exist=True)
    for agent, counts in store.counters().items():
        trained = sum(r["agent"][agent]["samples"] for r in records)
        assert counts["consumed"] == trained, (agent, counts, trained)
        assert counts["ready"] == counts["claimed"] == counts["pending"] == counts["dropped"] == 0, (agent, counts)
    attempts = json.load(open(os.path.join(workdir, "attempts.json")))
    assert attempts == {str(iteration): 1 for iteration in range(ITERATIONS)}  # a finished stop redoes nothing
