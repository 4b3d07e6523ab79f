"""`flexmarl` — train, bench, inspect, export.

Each subcommand is a thin shell over a function tests can call directly. Heavy imports (JAX, JetStream,
TensorFlow) happen inside the subcommand that needs them, so `flexmarl --help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pkgutil
import sys

from flexmarl_jax.config.errors import ConfigError

COMMANDS_HELP = """commands:
  train     run multi-agent RL: --config=PATH[:VARIANT], --config.KEY=VALUE, --workdir=DIR (flexmarl train --help)
  bench     run a benchmark: flexmarl bench NAME [--json PATH] (flexmarl bench --list)
  inspect   summarise a workdir (experience store tables, metrics)
  export    write a trained agent as a Hugging Face model directory: WORKDIR --agent NAME --out DIR [--version V]
"""


def _prepare_devices(fake_cpu_devices: int) -> int:
    """Fakes CPU devices (before JAX is imported) and returns the device count JAX sees."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # JetStream pulls in TensorFlow, which is chatty
    from flexmarl_jax.mesh.host_devices import fake_cpu_devices as fake

    fake(fake_cpu_devices)
    import jax

    if os.environ.get("FLEXMARL_DISTRIBUTED") == "1":  # multi-host (TPU pod): one process per host
        jax.distributed.initialize()
    return jax.device_count()


def cmd_train(argv: list[str]) -> int:
    """`flexmarl train`: flags parsed and the config built and checked before JAX starts."""
    from flexmarl_jax.config import RunConfig, check_devices, parse_train_flags
    from flexmarl_jax.config.cli_flags import train_help

    if any(arg in ("-h", "--help", "--helpfull") for arg in argv):
        print(train_help())
        return 0
    parsed = parse_train_flags(argv)
    config = RunConfig.from_config(parsed.config)  # every field checked before touching JAX
    if parsed.workdir:
        config = dataclasses.replace(config, workdir=parsed.workdir)
    if parsed.log_level is not None:
        logging.basicConfig(level=parsed.log_level)
        logging.getLogger().setLevel(parsed.log_level)
    if parsed.verbosity is not None:  # also brings back the native libraries' INFO lines (jetstream_compat)
        from absl import logging as absl_logging

        absl_logging.set_verbosity(parsed.verbosity)
    from flexmarl_jax import faults
    from flexmarl_jax.orchestrator.workdir_lock import WorkdirLock

    try:
        faults.parse(os.environ.get(faults.ENV_VAR, ""))  # armed by run_training; a bad name fails here, first
    except ValueError as error:
        raise ConfigError(f"${faults.ENV_VAR}: {error}") from None
    with WorkdirLock(config.workdir):  # a live run's workdir fails here, in a second, before JAX starts
        check_devices(config, _prepare_devices(config.mesh.fake_cpu_devices))
        from flexmarl_jax.orchestrator.run import run_training

        return run_training(config, workdir_locked=True)


def _available_benchmarks() -> list[str]:
    import flexmarl_jax.bench as bench_package

    return sorted(m.name for m in pkgutil.iter_modules(bench_package.__path__) if not m.name.startswith("_"))


def cmd_bench(argv: list[str]) -> int:
    names = _available_benchmarks()
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print("usage: flexmarl bench NAME [--json PATH] [options]\navailable: " + ", ".join(names))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"flexmarl bench: unknown benchmark {name!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(f"flexmarl_jax.bench.{name}")
    return int(module.main(rest) or 0)


def cmd_inspect(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="flexmarl inspect", description="Summarise a run directory.")
    parser.add_argument("workdir")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.workdir):
        print(f"flexmarl inspect: {args.workdir!r} is not a directory", file=sys.stderr)
        return 2
    from flexmarl_jax.cli.inspect_workdir import format_workdir_summary

    print(format_workdir_summary(args.workdir))
    return 0


def cmd_export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="flexmarl export",
        description="Write one agent of a run as a Hugging Face model directory (weights, config, tokenizer).")
    parser.add_argument("workdir", help="the run's --workdir (holds config.json and checkpoints/)")
    parser.add_argument("--agent", required=True, help="the agent to export (a key of config.agents)")
    parser.add_argument("--out", required=True, help="the directory to write (must be empty or absent)")
    parser.add_argument("--version", type=int, default=None, help="the policy version to export (default: latest)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)
    # Export reads and converts arrays on the host: keep JAX off accelerators that a run may be using.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from flexmarl_jax.cli.export import ExportError, export_agent

    try:
        result = export_agent(args.workdir, args.agent, args.out, policy_version=args.version, force=args.force)
    except ExportError as error:
        print(f"flexmarl export: {error}", file=sys.stderr)
        return 2
    print(result.summary())
    return 0


COMMANDS = {"train": cmd_train, "bench": cmd_bench, "inspect": cmd_inspect, "export": cmd_export}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: flexmarl COMMAND [options]\n\nflexmarl-jax: multi-agent LLM RL on JAX.\n\n" + COMMANDS_HELP)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"flexmarl: unknown command {command!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    from flexmarl_jax.orchestrator.workdir_lock import WorkdirBusy

    try:
        return COMMANDS[command](rest)
    except ConfigError as error:
        print(f"flexmarl {command}: config error: {error}", file=sys.stderr)
        return 2
    except WorkdirBusy as error:
        print(f"flexmarl {command}: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        from flexmarl_jax.orchestrator.run import RunStopped

        if not isinstance(error, RunStopped):
            raise
        print(f"flexmarl {command}: stopped: {error}", file=sys.stderr)  # the traceback is in the log above
        return 1


if __name__ == "__main__":
    sys.exit(main())
