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


@pytest.fixture(scope="session")
def chat_run(tmp_path_factory) -> str:
    """A one-iteration run of the chain team on the synthetic BPE chat checkpoint (a Qwen2 byte-level BPE
    tokenizer and a ChatML template; models/synthetic.py), for the OpenAI API tests."""
    from flexmarl_jax.cli.main import main
    from flexmarl_jax.configs.gsm8k_chain import SMOKE_DATA
    from flexmarl_jax.models.fixture_cache import synthetic_checkpoint

    checkpoint = synthetic_checkpoint("qwen2", size="smoke")
    workdir = str(tmp_path_factory.mktemp("openai") / "run")
    assert main(["train", "--config=flexmarl_jax.configs.tiny:smoke", f"--workdir={workdir}",
                 *(f"--config.agents.{agent}.model={checkpoint}" for agent in ("solver", "verifier", "corrector")),
                 "--config.iterations=1", "--config.workflow.queries_per_iteration=2",
                 "--config.workflow.samples_per_query=2", "--config.workflow.warmup_steps=0",
                 "--config.train.micro_batch_size=4",
                 "--config.rollout.max_prompt_length=192", "--config.rollout.max_response_length=24",
                 "--config.rollout.decode_slots=4", f"--config.workflow.task={SMOKE_DATA}",
                 "--config.workflow.task_options.jsonl.verifier=math", "--config.eval.problems=1",
                 "--config.eval.samples=0", "--config.eval.every=1"]) == 0
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
