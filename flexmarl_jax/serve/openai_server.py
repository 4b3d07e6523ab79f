"""`flexmarl serve WORKDIR --api openai`: a run's agents behind the OpenAI-compatible HTTP API, on uvicorn.

Each agent is served by our own `EngineInstance` (continuous batching, per-request sampling), not JetStream's
Driver: that one carries no sampling, n, stop strings, log-probs or cancellation, and any error in its threads
SIGKILLs the process. SIGINT or SIGTERM ends every open stream, gives the connections `GRACEFUL_SHUTDOWN_S` to
close, stops the engines' threads and returns.

    models = load_served_models(workdir, ["solver"], slots=4)
    asyncio.run(serve_openai(models, host="127.0.0.1", port=8000))
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import socket
from collections.abc import Callable, Iterator, Sequence

import jax
import uvicorn

from flexmarl_jax.config.lora_groups import lora_base_groups
from flexmarl_jax.config.workflow_from_config import team_agents
from flexmarl_jax.rollout.instance import EngineInstance
from flexmarl_jax.rollout.settings import MAX_TOP_LOGPROBS
from flexmarl_jax.serve.openai_app import build_app
from flexmarl_jax.serve.openai_models import ServedModel, ServedModels
from flexmarl_jax.serve.served_agent import (
    ServeError,
    build_engine,
    build_group_engine,
    load_agent,
    read_run,
    serving_engine_config,
)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACEFUL_SHUTDOWN_S = 3.0  # then uvicorn cancels what is still open; the bound for the whole stop is 10 s


def openai_engine_config(run, agent: str, *, slots: int = 0, max_new_tokens: int = 0):
    """`flexmarl serve`'s engine shapes for ``agent`` (served_agent.serving_engine_config) with the raw top
    log-probs the API's `logprobs` need reported every step."""
    return dataclasses.replace(serving_engine_config(run, agent, slots=slots, max_new_tokens=max_new_tokens),
                               top_logprobs=MAX_TOP_LOGPROBS)


def load_served_models(workdir: str, agents: Sequence[str] | None = None, *, version: int | None = None,
                       slots: int = 0, max_new_tokens: int = 0,
                       announce: Callable[[str], None] = print) -> ServedModels:
    """Loads each agent's policy, builds and compiles its engine (agent i on device i mod the device count) and
    starts its instance's thread. The LoRA agents of one base group (config/lora_groups.py) share one engine:
    the base once and each agent's adapter (`served_agent.build_group_engine`)."""
    run = read_run(workdir)
    names = list(agents) if agents else list(team_agents(run.workflow))
    groups = lora_base_groups(run, order=names)
    group_of = {name: groups.get(name, (name,)) for name in names}  # an agent outside a group serves alone
    devices = jax.devices()
    # A group's agents are loaded unmerged: their engine reads the base once, not one merged model per agent.
    loaded = {name: load_agent(workdir, name, version=version, run=run, merged=len(group_of[name]) == 1)
              for name in names}
    models, shared = {}, {}
    for index, name in enumerate(names):
        agent, group = loaded[name], group_of[name]
        if group[0] in shared:  # served by its group leader's engine
            models[name] = ServedModel(name, agent.policy_version, shared[group[0]], agent.tokenizer)
            continue
        engine_config = openai_engine_config(run, name, slots=slots, max_new_tokens=max_new_tokens)
        device = devices[index % len(devices)]
        if len(group) > 1:
            engine, params = build_group_engine([loaded[member] for member in group], engine_config, device)
            announce(f"compiling agents {', '.join(group)} on one engine (a LoRA base group)")
        else:
            engine, params = build_engine(agent, engine_config, device)
            announce(f"compiling agent {name} (policy_version {agent.policy_version})")
        engine.warm_up(params)
        instance = EngineInstance(engine, params, policy_version=agent.policy_version, name=f"serve-{name}",
                                  adapter_agents=group if len(group) > 1 else ())
        instance.start()
        shared[group[0]] = instance
        models[name] = ServedModel(name, agent.policy_version, instance, agent.tokenizer)
    return ServedModels(models)


class _Server(uvicorn.Server):
    """uvicorn's server, which also ends our open streams when a signal asks it to stop (uvicorn alone would
    wait for them to finish)."""

    def __init__(self, config: uvicorn.Config, models: ServedModels, loop: asyncio.AbstractEventLoop):
        super().__init__(config)
        self._models, self._loop = models, loop

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._loop.call_soon_threadsafe(self._models.shut_down)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM stop the server. uvicorn's own handling raises the signal again once it has shut
        down, which would end this command with -15 rather than the clean exit a requested stop is."""
        for signal_number in STOP_SIGNALS:
            self._loop.add_signal_handler(signal_number, self.handle_exit, signal_number, None)
        try:
            yield
        finally:
            for signal_number in STOP_SIGNALS:
                self._loop.remove_signal_handler(signal_number)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0: a free port); ServeError in one line when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ServeError(f"--host {host} --port {port}: cannot listen there ({error.strerror})") from None
    return sock


async def serve_openai(models: ServedModels, *, host: str, port: int, api_key: str | None = None,
                       announce: Callable[[str], None] = print) -> None:
    """Serves until SIGINT or SIGTERM, then ends the open streams and stops the engines."""
    sock = bind(host, port)
    config = uvicorn.Config(build_app(models, api_key=api_key), log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = _Server(config, models, asyncio.get_running_loop())
    bound_host, bound_port = sock.getsockname()[:2]
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            for name, model in models.models.items():
                announce(f"agent {name} (policy_version {model.policy_version}): prompts up to "
                         f"{model.max_prompt_tokens} tokens, max_tokens 1..{model.max_tokens}, "
                         f"{model.instance.capacity} slots")
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            announce(f"OpenAI API on http://{shown}:{bound_port}/v1 (ready; SIGINT or SIGTERM stops the server)")
        await task
    finally:
        models.stop()
        sock.close()
    announce("stopped")
