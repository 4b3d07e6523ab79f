"""Kill `flexmarl train` with SIGKILL mid-run, resume it, and check that no sample is lost or counted twice."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from flexmarl_jax.mesh.host_devices import without_fake_cpu_devices
from flexmarl_jax.orchestrator.run_audit import iteration_records

ARGS = ["--config=configs/tiny.py:smoke", "--config.store.backend=file", "--config.iterations=3",
        "--config.pipeline.debug_invariants=true"]


def _train(workdir, **kwargs):
    # the CLI fakes the config's CPU devices itself
    env = dict(without_fake_cpu_devices(os.environ), TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.Popen([sys.executable, "-m", "flexmarl_jax.cli.main", "train", f"--workdir={workdir}", *ARGS],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, **kwargs)


@pytest.mark.timeout(600)
def test_sigkill_mid_run_then_resume(tmp_path):
    workdir = str(tmp_path / "run")
    first = _train(workdir)
    deadline = time.monotonic() + 400
    while not iteration_records(workdir):
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, "the first iteration never finished"
        time.sleep(0.1)
    time.sleep(0.5)  # inside iteration 1 or its checkpoint (iterations take ~0.6 s, checkpoints more)
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at = len(iteration_records(workdir))
    assert killed_at < 3

    second = _train(workdir)
    output, _ = second.communicate(timeout=400)
    assert second.returncode == 0, output

    records = iteration_records(workdir)
    assert [r["iteration"] for r in records] == [0, 1, 2]  # each iteration recorded exactly once
    assert all(version == 3 for version in records[-1]["policy_version"].values())

    from flexmarl_jax.store import ExperienceStore

    store = ExperienceStore.open(workdir, backend="file", must_exist=True)
    for agent, counts in store.counters().items():
        trained = sum(r["agent"][agent]["samples"] for r in records)
        assert counts["consumed"] == trained, (agent, counts, trained)
        assert counts["ready"] == counts["claimed"] == counts["pending"] == 0, (agent, counts)
    attempts = {int(k): v for k, v in json.load(open(os.path.join(workdir, "attempts.json"))).items()}
    # Every iteration ran once, except the one the kill interrupted before its checkpoint, which ran twice.
    # (metrics.jsonl may lag the checkpoint by one iteration at the kill, so that one is >= killed_at.)
    assert sorted(attempts) == [0, 1, 2] and set(attempts.values()) <= {1, 2}
    redone = [iteration for iteration, count in attempts.items() if count == 2]
    assert len(redone) <= 1 and all(iteration >= killed_at for iteration in redone)
    # The resumed run kept recording on the first run's timeline: every policy version since 0 is on it.
    from flexmarl_jax.metrics import POLICY_VERSION, Timeline

    versions = {event.attrs["version"] for event in Timeline.load(workdir).events(POLICY_VERSION)}
    assert versions == {0, 1, 2, 3}


def test_a_pending_record_is_kept_only_when_its_iteration_was_checkpointed(tmp_path):
    from flexmarl_jax.metrics import MetricsWriter
    from flexmarl_jax.orchestrator.journal import PENDING_RECORD, RunJournal

    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write({"iteration": 0, "team_accuracy": 0.1})
    pending = tmp_path / PENDING_RECORD
    pending.write_text(json.dumps({"iteration": 1, "team_accuracy": 0.2}))
    RunJournal(str(tmp_path)).settle(None, writer, start=1)  # iteration 1 is redone: its record is dropped
    assert not pending.exists() and [r["iteration"] for r in iteration_records(tmp_path)] == [0]
    pending.write_text(json.dumps({"iteration": 1, "team_accuracy": 0.2}))
    RunJournal(str(tmp_path)).settle(None, writer, start=2)  # checkpointed, but its metrics line was lost
    assert not pending.exists() and [r["iteration"] for r in iteration_records(tmp_path)] == [0, 1]


def test_rows_of_a_checkpointed_iteration_are_consumed_on_resume(tmp_path):
    """A kill between the checkpoint and mark_consumed: the resume marks the trained rows consumed."""
    import numpy as np

    from flexmarl_jax.orchestrator.journal import PENDING_TRAINED, RunJournal
    from flexmarl_jax.store import ExperienceStore

    store = ExperienceStore.open(str(tmp_path), agents=["solver"], backend="file")
    for query in ("q0", "q1"):
        store.append_rows("solver", input_ids=[query] * 2, trajectory_ids=[0, 1], group_size=2,
                          policy_versions={"solver": 0},
                          columns={"reward": np.ones(2, np.float32), "advantage": np.zeros(2, np.float32),
                                   "prompt_tokens": [[1], [2]], "response_tokens": [[3], [4]],
                                   "behaviour_logprobs": [[-1.0], [-1.0]]})
    pending = tmp_path / PENDING_TRAINED
    pending.write_text(json.dumps({"iteration": 0, "sample_ids": {"solver": ["q0_0_0", "q0_0_1"]}}))
    RunJournal(str(tmp_path)).settle(store, None, start=0)  # iteration 0 not checkpointed: redone, untouched
    assert not pending.exists() and store.counters("solver")["consumed"] == 0
    pending.write_text(json.dumps({"iteration": 0, "sample_ids": {"solver": ["q0_0_0", "q0_0_1"]}}))
    RunJournal(str(tmp_path)).settle(store, None, start=1)  # checkpointed: its rows count as consumed
    assert not pending.exists()
    assert store.counters("solver")["consumed"] == 2 and store.counters("solver")["ready"] == 2
