"""One live run per workdir: a second `flexmarl train` fails with one line naming the holder, before writing
anything; a lock whose holder died is taken over."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from flexmarl_jax.mesh.host_devices import without_fake_cpu_devices
from flexmarl_jax.orchestrator.workdir_lock import LOCK_FILE, WorkdirBusy, WorkdirLock

HOLD = ("import sys, time; from flexmarl_jax.orchestrator.workdir_lock import WorkdirLock; "
        "lock = WorkdirLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(120)")


def _hold(workdir):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.timeout(60)
def test_a_live_holder_is_named_and_a_dead_ones_lock_is_taken_over(tmp_path):
    holder = _hold(tmp_path)
    try:
        with pytest.raises(WorkdirBusy, match=rf"^workdir {tmp_path} is in use by a live run: pid {holder.pid} on "):
            WorkdirLock(str(tmp_path)).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = WorkdirLock(str(tmp_path)).acquire()  # the kernel dropped the dead holder's flock
    try:
        assert lock.previous_holder["pid"] == holder.pid
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


@pytest.mark.timeout(120)
def test_a_second_flexmarl_train_fails_in_one_line_before_writing_anything(tmp_path):
    holder = _hold(tmp_path)
    try:
        before = sorted(os.listdir(tmp_path))
        env = dict(without_fake_cpu_devices(os.environ), TF_CPP_MIN_LOG_LEVEL="3")
        started = time.monotonic()
        second = subprocess.run([sys.executable, "-m", "flexmarl_jax.cli.main", "train",
                                 "--config=configs/tiny.py:smoke", f"--workdir={tmp_path}"],
                                capture_output=True, text=True, env=env, timeout=100)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"flexmarl train: workdir {tmp_path} is in use by a live run: "
                                                       f"pid {holder.pid} on "), second.stderr
        assert sorted(os.listdir(tmp_path)) == before == [LOCK_FILE]
        assert time.monotonic() - started < 100
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_a_run_that_wrote_nothing_leaves_no_workdir_behind(tmp_path):
    """A preflight error stops a run after it took the lock: the lock file and the directories the lock made go
    again, so 'nothing is written' holds for bad input; a workdir the run wrote into, or that existed, stays."""
    fresh = tmp_path / "runs" / "new"
    with WorkdirLock(str(fresh)):
        assert (fresh / LOCK_FILE).is_file()
    assert not (tmp_path / "runs").exists()
    with WorkdirLock(str(fresh)):
        (fresh / "metrics.jsonl").write_text("{}\n")
    assert sorted(p.name for p in fresh.iterdir()) == ["metrics.jsonl", LOCK_FILE]
    existing = tmp_path / "existing"
    existing.mkdir()
    with WorkdirLock(str(existing)):
        pass
    assert existing.is_dir()
