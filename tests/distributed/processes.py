"""Starting a run's processes on this machine: N local processes x D fake CPU devices, joined over gloo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from flexmarl_jax.mesh.host_devices import without_fake_cpu_devices

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_env(devices_per_process: int) -> dict[str, str]:
    """The environment of one process: its own fake CPU devices and our tree first on the path."""
    env = without_fake_cpu_devices(os.environ)
    count = f"--xla_force_host_platform_device_count={devices_per_process}"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {count}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def start(argv_for, count: int, *, devices_per_process: int, cwd: Path | None = None) -> list[subprocess.Popen]:
    """Starts ``count`` processes; ``argv_for(process_id)`` is process i's command after the interpreter."""
    env = process_env(devices_per_process)
    return [subprocess.Popen([sys.executable, *argv_for(index)], env=env, cwd=cwd or REPO, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for index in range(count)]


def wait_all(processes: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each process; kills every one still running after ``timeout`` s."""
    results = []
    for process in processes:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            out, err = process.communicate()
        results.append((process.returncode, out, err))
    return results
