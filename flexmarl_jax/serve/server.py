"""`flexmarl serve`: JetStream's Driver and gRPC service for each agent, on a `grpc.aio` server bound to --host.

This mirrors JetStream 0.2.2's `core/server_lib.run` (one Driver over the engine, interleaved prefill and
generate on it, the `Orchestrator` service on a `grpc.aio` server with a thread pool of at least 64 workers,
optional Prometheus metrics) with three differences: the server binds the address it is given (`run` binds
every interface: `[::]`), requests pass `CheckedOrchestrator`'s checks before the Driver sees them, and SIGINT
or SIGTERM cancels the in-flight streams, stops the Driver's threads and returns.

    endpoints = await start_endpoints([PreparedAgent(...), ...], host="127.0.0.1", port=9000)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import grpc
from prometheus_client import start_http_server

from flexmarl_jax.rollout.jetstream_compat import driver_engine, jetstream_pb2_grpc
from flexmarl_jax.serve.request_checks import RequestLimits
from flexmarl_jax.serve.served_agent import ServeError
from flexmarl_jax.serve.servicer import CheckedOrchestrator, orchestrator

logger = logging.getLogger(__name__)

MIN_RPC_THREADS = 64  # server_lib.run's floor for the RPC worker pool
# A shutdown that takes longer than this (a Driver thread stuck in a device call) ends the process anyway.
SHUTDOWN_DEADLINE_S = 8.0


@dataclasses.dataclass(frozen=True)
class PreparedAgent:
    """An agent ready to serve: its warmed-up engine and the parameters placed for it."""

    name: str
    policy_version: int
    engine: Any  # FlexEngine
    params: Any


@dataclasses.dataclass
class Endpoint:
    """One agent's Driver and the gRPC server in front of it."""

    agent: PreparedAgent
    address: str  # host:port as bound
    port: int
    limits: RequestLimits
    driver: Any
    server: grpc.aio.Server

    def describe(self) -> str:
        engine = self.agent.engine
        return (f"agent {self.agent.name} (policy_version {self.agent.policy_version}) on {self.address}: prompts up "
                f"to {self.limits.max_prefill_length} tokens, max_tokens 1..{self.limits.max_tokens}, "
                f"{engine.max_concurrent_decodes} slots")


def grpc_address(host: str, port: int) -> str:
    """``host:port`` as gRPC wants it (an IPv6 literal in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def agent_metrics_collector(agent: str) -> Any:
    """A JetStream metrics collector whose series carry ``id=<agent>``.

    `JetstreamMetricsCollector` is a process-wide singleton labelled with the host name, so two agents in one
    process would write the same series; a separate instance with its own id keeps them apart (the gauges
    themselves are class attributes, registered once).
    """
    collector = object.__new__(orchestrator.JetstreamMetricsCollector)  # not the singleton: one per agent
    collector._id = agent
    return collector


async def start_endpoint(agent: PreparedAgent, *, host: str, port: int, metrics: bool = False) -> Endpoint:
    """Starts a Driver over ``agent.engine`` and a gRPC server for it on host:port (0: a free port)."""
    engine = agent.engine
    driven = driver_engine(engine)
    driver = orchestrator.Driver(
        prefill_engines=[driven], generate_engines=[driven], prefill_params=[agent.params],
        generate_params=[agent.params], interleaved_mode=True,
        metrics_collector=agent_metrics_collector(agent.name) if metrics else None)
    try:
        threads = max(driver.get_total_concurrent_requests(), MIN_RPC_THREADS)
        server = grpc.aio.server(futures.ThreadPoolExecutor(max_workers=threads))
        limits = RequestLimits.of(engine)
        jetstream_pb2_grpc.add_OrchestratorServicer_to_server(CheckedOrchestrator(driver, engine.tokenizer, limits),
                                                              server)
        try:
            bound = server.add_insecure_port(grpc_address(host, port))
        except RuntimeError as error:  # grpc raises for an address it cannot bind
            raise ServeError(f"--host {host} --port {port}: cannot listen there ({error})") from None
        if bound == 0:
            raise ServeError(f"--host {host} --port {port}: cannot listen there")
        await server.start()
    except BaseException:
        driver.stop()
        raise
    return Endpoint(agent, grpc_address(host, bound), bound, limits, driver, server)


async def stop_endpoint(endpoint: Endpoint) -> None:
    """Cancels the endpoint's in-flight streams, then stops its Driver's threads (while the event loop still
    runs: the Driver hands results to the loop until its threads end)."""
    await endpoint.server.stop(grace=None)
    await asyncio.to_thread(endpoint.driver.stop)


async def serve_until_signalled(agents: Sequence[PreparedAgent], *, host: str, port: int, metrics_port: int = 0,
                                announce: Callable[[str], None] = print) -> None:
    """Serves every agent, agent i on ``port + i`` (every one on a free port when ``port`` is 0), until SIGINT or
    SIGTERM; then cancels the streams in flight, stops the Drivers and returns.

    ``announce`` gets one line per endpoint and a last line once all of them take requests.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signal_number, stop.set)
    if metrics_port:
        try:
            start_http_server(metrics_port, addr=host)
        except OSError as error:
            raise ServeError(f"--metrics-port {metrics_port}: cannot listen on {host} ({error})") from None
        announce(f"Prometheus metrics on {grpc_address(host, metrics_port)}/metrics")
    endpoints: list[Endpoint] = []
    try:
        for index, agent in enumerate(agents):
            endpoint = await start_endpoint(agent, host=host, port=port + index if port else 0,
                                            metrics=bool(metrics_port))
            endpoints.append(endpoint)
            announce(endpoint.describe())
        announce("ready (SIGINT or SIGTERM stops the server)")
        await stop.wait()
        announce("stopping: cancelling streams in flight")
    finally:
        watchdog = _exit_if_shutdown_hangs()
        try:
            await asyncio.gather(*(stop_endpoint(endpoint) for endpoint in endpoints))
        finally:
            watchdog.cancel()


def _exit_if_shutdown_hangs() -> threading.Timer:
    """A started timer that ends the process unless cancelled within SHUTDOWN_DEADLINE_S."""
    def force_exit() -> None:
        print(f"flexmarl serve: shutdown took over {SHUTDOWN_DEADLINE_S:.0f} s; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(SHUTDOWN_DEADLINE_S, force_exit)
    timer.daemon = True
    timer.start()
    return timer
