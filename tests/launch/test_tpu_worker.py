"""launch/tpu_worker.sh, the part of tpu_vm.sh that runs on each TPU VM worker, run here with a stand-in
`flexmarl` in a stand-in venv (FLEXMARL_HOME) and the worker index given (TPU_WORKER_ID) instead of read from the
TPU metadata. Its `install` (apt, pip) is not run here."""

import os
import signal
import subprocess
import time

import pytest

from tests.launch.conftest import LAUNCH

pytestmark = pytest.mark.timeout(60)

# A stand-in `flexmarl`: prints its arguments and directory, then exits with $FAKE_STATUS after $FAKE_SLEEP s.
FLEXMARL = """#!/usr/bin/env bash
echo "args: $*"
echo "cwd: $PWD"
sleep "${FAKE_SLEEP:-0}"
echo "last line"
exit "${FAKE_STATUS:-0}"
"""


@pytest.fixture
def worker(tmp_path):
    home = tmp_path / "flexmarl"
    (home / "venv" / "bin").mkdir(parents=True)
    flexmarl = home / "venv" / "bin" / "flexmarl"
    flexmarl.write_text(FLEXMARL)
    flexmarl.chmod(0o755)
    return home


def run_worker(home, *args, **env):
    full_env = {"PATH": "/usr/bin:/bin", "HOME": str(home.parent), "FLEXMARL_HOME": str(home),
                "TPU_WORKER_ID": "3", **env}
    return subprocess.run(["bash", str(LAUNCH / "tpu_worker.sh"), *args], env=full_env, capture_output=True,
                          text=True, timeout=30)


def test_train_starts_one_distributed_process_streams_its_log_and_exits_with_its_status(worker):
    result = run_worker(worker, "train", "--config=x.py", "--config.a=b c", FAKE_STATUS="5")
    assert result.returncode == 5
    lines = result.stdout.splitlines()
    assert all(line.startswith("[worker 3] ") for line in lines), lines
    assert lines[1:] == [
        "[worker 3] args: train --config.distributed.enabled=True --config=x.py --config.a=b c",
        f"[worker 3] cwd: {worker}",
        "[worker 3] last line",
        "[worker 3] flexmarl train exited with status 5"]
    # The worker keeps its log: `logs` prints it again, with the run's status.
    assert (worker / "logs" / "train.log").read_text().endswith("last line\n")
    again = run_worker(worker, "logs")
    assert again.returncode == 5 and again.stdout.splitlines() == lines[1:]


def test_a_local_tree_is_the_working_directory(worker):
    (worker / "src" / "configs").mkdir(parents=True)
    result = run_worker(worker, "train")
    assert result.returncode == 0, result.stdout
    assert f"[worker 3] cwd: {worker / 'src'}" in result.stdout.splitlines()


def test_train_before_install_says_so(tmp_path):
    result = run_worker(tmp_path / "flexmarl", "train")
    assert result.returncode == 1
    assert result.stdout == (f"[worker 3] flexmarl is not installed on this worker (no {tmp_path}/flexmarl/venv/bin/"
                             "flexmarl): run tpu_vm.sh install first\n")
    assert not (tmp_path / "flexmarl" / "logs").exists()


def test_a_second_train_on_a_busy_worker_is_refused(worker):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(worker.parent), "FLEXMARL_HOME": str(worker), "TPU_WORKER_ID": "0",
           "FAKE_SLEEP": "30"}
    first = subprocess.Popen(["bash", str(LAUNCH / "tpu_worker.sh"), "train"], env=env, stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        pid_file = worker / "logs" / "train.pid"
        deadline = time.monotonic() + 10
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        run_pid = int(pid_file.read_text())
        second = run_worker(worker, "train", TPU_WORKER_ID="0")
        assert second.returncode == 1
        assert second.stdout == (f"[worker 0] a run is already going on this worker (pid {run_pid}); "
                                 "tpu_vm.sh logs follows it\n")
        assert run_worker(worker, "logs", TPU_WORKER_ID="0").stdout.splitlines()[-1] == \
            "[worker 0] flexmarl train is still running"
    finally:
        # The run is detached into its own session (setsid: its pid is its process group): end that group, then
        # the follower's.
        os.killpg(int((worker / "logs" / "train.pid").read_text()), signal.SIGTERM)
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=10)
