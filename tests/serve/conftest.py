"""One trained smoke run shared by the serving and chat tests (training and compiling it is the cost)."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> str:
    """The workdir of `flexmarl train --config=configs/tiny.py:smoke` (the chain team after 2 iterations)."""
    from flexmarl_jax.cli.main import main

    workdir = str(tmp_path_factory.mktemp("serve") / "run")
    assert main(["train", "--config=flexmarl_jax.configs.tiny:smoke", f"--workdir={workdir}"]) == 0
    return workdir


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """`flexmarl serve ...` in a subprocess (JetStream's Driver SIGKILLs its process when a thread fails), with
    its output lines collected by a reader thread."""

    def __init__(self, args: list[str]):
        self.lines: list[str] = []
        self._new_lines: queue.Queue[str | None] = queue.Queue()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flexmarl_jax.cli.main", "serve", *args], cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            self._new_lines.put(line)
        self._new_lines.put(None)

    def wait_for(self, text: str, timeout_s: float) -> str:
        """The first output line containing ``text``; fails with the output so far if the process ends first."""
        deadline = time.monotonic() + timeout_s
        for line in self.lines:
            if text in line:
                return line
        while time.monotonic() < deadline:
            try:
                line = self._new_lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            if text in line:
                return line.rstrip("\n")
        raise AssertionError(f"no line with {text!r}; rc={self.process.poll()}; output:\n" + "\n".join(self.lines))

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
