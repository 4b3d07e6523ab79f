"""The `flexmarl` command: help is fast and JAX-free; bad configs exit non-zero with one line."""

import subprocess
import sys

import pytest

from flexmarl_jax.cli.main import main


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "flexmarl_jax.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_help_does_not_import_jax_or_tensorflow():
    code = ("import sys; from flexmarl_jax.cli.main import main; main(['--help']); "
            "print(sorted(m for m in ('jax', 'tensorflow', 'jetstream') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("args, fragment", [
    (["--config=configs/tiny.py", "--config.train.micro_batch_size=-1"], "train.micro_batch_size=-1"),
    (["--config.train.nonsense=1"], "'train' has no field 'nonsense'"),
    (["--config.mesh.train_devices_per_agent=21"], "config.mesh needs 66 devices"),
])
def test_bad_config_exits_with_one_line_and_no_traceback(args, fragment):
    result = _run("train", *args)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip() and "flexmarl" in line]
    assert len(lines) == 1 and fragment in lines[0]
    assert "Traceback" not in result.stderr


def test_unknown_command_and_benchmark(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err
