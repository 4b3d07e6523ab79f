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


@pytest.mark.parametrize("args, fragment", [
    (["--config.workflow.nonsense=1"], "'workflow' has no field 'nonsense'; known: name, options"),
    (["--config.train.micro_batch_size=abc"], "config.train.micro_batch_size='abc' is not an int"),
    (["--config.pipeline.balancing=maybe"], "config.pipeline.balancing='maybe' is not a bool; allowed: true, false"),
    (["--config.train"], "config.train is a section"),
    (["--config.pipeline.mode=turbo"], "config.pipeline.mode='turbo' is not allowed; choose one of: serial, sync"),
    (["--config.train.algorithm=sft"], "config.train.algorithm='sft' is not allowed; choose one of: grpo, drgrpo"),
    (["--config.store.backend=disk"], "config.store.backend='disk' is not allowed; choose one of: memory, file"),
    (["--config.workflow.task=sudoku"], "config.workflow.task='sudoku' is not allowed; choose one of: arithmetic"),
    (["--config=configs/tiny.py:nope"], "unknown variant 'nope' of configs/tiny.py; allowed: sync"),
    (["--config.train.micro_batch_size"], "--config.train.micro_batch_size needs a value"),  # nothing follows
    (["--wrkdir=runs/x"], "unknown flag --wrkdir"),
    (["--config.pipeline.balancing", "false", "stray"], "unexpected argument(s) ['stray']"),
    (["--gantt-iterations=-1"], "--gantt-iterations='-1' is not an int >= 0: the iterations the Gantt chart draws"),
    (["--gantt-iterations", "three"], "--gantt-iterations='three' is not an int >= 0"),
])
def test_bad_input_stops_before_any_work_in_process(capsys, args, fragment):
    # In-process, with pytest's own sys.argv: the flags must come from `argv`, never from sys.argv.
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and err.startswith("flexmarl train: config error: ")


def test_flags_are_parsed_from_the_given_argv_space_separated_too():
    from flexmarl_jax.config import ConfigError, RunConfig, parse_train_flags

    parsed = parse_train_flags(["--config.train.micro_batch_size", "16", "--config.pipeline.balancing", "false",
                                "--noconfig.pipeline.async_micro_batches", "--config", "configs/debate.py:judge",
                                "--config.train.max_staleness", "-1", "--workdir", "runs/x", "-v", "1"])
    assert parsed.workdir == "runs/x" and parsed.verbosity == 1 and parsed.log_level == 10
    config = parsed.config
    assert config.workflow.options.aggregate == "judge"  # --config after its overrides still applies first
    assert config.train.micro_batch_size == 16 and config.train.max_staleness == -1
    assert config.pipeline.balancing is False and config.pipeline.async_micro_batches is False
    with pytest.raises(ConfigError, match="max_staleness=-1 must be >= 0"):
        RunConfig.from_config(config)
    assert parse_train_flags([]).config.workflow.name == "chain"  # the embedded default
    assert parse_train_flags([]).verbosity is None
    assert parse_train_flags([]).gantt_iterations is None  # the plots' default
    assert parse_train_flags(["--gantt-iterations", "0"]).gantt_iterations == 0


def test_gantt_iterations_reach_the_run(monkeypatch, tmp_path):
    """`flexmarl train --gantt-iterations=K` hands K to `run_training` (which passes it to `plot_all`)."""
    import types

    import flexmarl_jax.cli.main as cli

    calls = []
    fake_run = types.ModuleType("flexmarl_jax.orchestrator.run")
    fake_run.run_training = lambda config, **kwargs: calls.append(kwargs) or 0
    monkeypatch.setitem(sys.modules, "flexmarl_jax.orchestrator.run", fake_run)
    monkeypatch.setattr(cli, "_prepare_devices", lambda config: config.mesh.fake_cpu_devices)
    workdir = f"--workdir={tmp_path}"  # the CLI locks the workdir before it calls the run
    assert main(["train", workdir, "--gantt-iterations=7"]) == 0
    assert main(["train", workdir]) == 0
    assert calls == [{"workdir_locked": True, "gantt_iterations": 7},
                     {"workdir_locked": True, "gantt_iterations": None}]


def test_train_help_lists_every_field_without_jax():
    code = ("import sys; from flexmarl_jax.cli.main import main; main(['train', '--help']); "
            "print(sorted(m for m in ('jax', 'tensorflow', 'jetstream') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "[]"
    assert any(line.startswith("  train.micro_batch_size: ") for line in lines)
    assert any(line.startswith("  agents.*.temperature: ") for line in lines)


@pytest.mark.timeout(300)
def test_train_on_the_default_config_starts_no_tensorflow(tmp_path):
    """`flexmarl train` rolls out on our engine: JetStream (and TensorFlow with it, ~4 s a process) is for the
    serving Driver only. One small iteration of the embedded default, in a fresh process."""
    args = ["train", f"--workdir={tmp_path / 'run'}", "--config.iterations=1", "--config.eval.enabled=false",
            "--config.workflow.queries_per_iteration=2", "--config.workflow.samples_per_query=4",
            "--config.workflow.warmup_steps=0", "--config.train.micro_batch_size=8"]
    code = (f"import sys; from flexmarl_jax.cli.main import main; code = main({args!r}); "
            "print(code, sorted(m for m in ('tensorflow', 'jetstream', 'seqio') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "0 []"
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count('"iteration"') >= 1
