"""kill -9 of one of a run's two processes: the survivor exits non-zero within the heartbeat timeout (plus the
shutdown's margin) with a message naming the lost process, and rerunning both on the same workdir resumes and
finishes, every iteration recorded once, with no computation over every device in the resume (all_device_watch).

The runs use a 10 s heartbeat timeout, not the default 30 s, so that the survivor's wait is a third as long; the
default is checked against the documented bound below."""

import json
import signal
import time

import pytest

from flexmarl_jax.config import RunConfig
from tests.distributed import all_device_watch, processes
from tests.distributed.test_two_process_run import distributed_flags

ITERATIONS = 2
HEARTBEAT_TIMEOUT_S = 10
SHUTDOWN_MARGIN_S = 30  # from the missed heartbeat to the process's exit: the error path and JAX's teardown
OVERRIDES = ["--config=configs/tiny.py:smoke", f"--config.iterations={ITERATIONS}",
             "--config.pipeline.deterministic=True", "--config.rollout.instances_per_agent=2",
             "--config.mesh.train_slices=1", "--config.mesh.train_devices_per_agent=2",
             "--config.store.backend=file", "--config.eval.enabled=False",
             f"--config.distributed.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}"]


def _records(workdir) -> list[int]:
    path = workdir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines(keepends=True)
            if line.endswith("\n") and json.loads(line).get("kind", "iteration") == "iteration"]


def _start(workdir):
    port = processes.free_port()
    return processes.start(lambda index: ["-m", "tests.distributed.watched_child", "train", *OVERRIDES,
                                          f"--workdir={workdir}", *distributed_flags(port, index)],
                           2, devices_per_process=4)


def test_the_default_heartbeat_stops_a_survivor_within_a_minute():
    assert RunConfig().distributed.heartbeat_timeout_s + SHUTDOWN_MARGIN_S <= 60


@pytest.mark.timeout(900)
def test_a_killed_process_stops_the_other_within_the_heartbeat_timeout_and_both_resume(tmp_path):
    workdir = tmp_path / "run"
    survivor, victim = _start(workdir)
    deadline = time.monotonic() + 600
    while not _records(workdir) and time.monotonic() < deadline and survivor.poll() is None:
        time.sleep(0.2)
    if not _records(workdir):
        ended = processes.wait_all([survivor, victim], timeout=120)
        pytest.fail(f"iteration 0 was never recorded: {[err[-2000:] for _, _, err in ended]}")
    assert _records(workdir) == [0]
    victim.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    victim.communicate()
    _, err = survivor.communicate(timeout=120)
    took = time.monotonic() - killed
    assert survivor.returncode != 0
    assert took < HEARTBEAT_TIMEOUT_S + SHUTDOWN_MARGIN_S, f"the survivor exited {took:.1f} s after the kill"
    assert "Task 1 heartbeat timeout" in err, err[-3000:]  # JAX's runtime names the lost process
    assert 0 < len(_records(workdir)) < ITERATIONS

    results = processes.wait_all(_start(workdir), timeout=600)  # the resume
    for index, (code, _, err) in enumerate(results):
        assert code == 0, f"process {index} of the rerun: {err[-3000:]}"
        assert all_device_watch.MARK not in err, f"process {index} of the rerun: {err[-3000:]}"
    assert _records(workdir) == list(range(ITERATIONS))  # resumed: each iteration once, none lost
