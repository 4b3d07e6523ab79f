"""Waits for process 0's coordinator service to accept TCP connections, before JAX's runtime tries it.

JAX's own client retries an unreachable coordinator until its initialization timeout and then fails from
C++ with a message that does not say which address was tried; probing first turns that into one line naming
the address, the process and the timeout. Pure Python: it runs before JAX is imported.
"""

from __future__ import annotations

import socket
import time


class CoordinatorUnreachable(RuntimeError):
    """Process 0's coordinator did not accept a connection in time; the message names it."""


def split_address(address: str) -> tuple[str, int]:
    """("10.0.0.2", 8476) from "10.0.0.2:8476" ("[::1]:8476" for IPv6)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def wait_for_coordinator(address: str, timeout_s: float, *, process_id: int, poll_s: float = 0.5) -> float:
    """Returns the seconds it took until ``address`` accepted a TCP connection; raises CoordinatorUnreachable
    after ``timeout_s`` seconds without one. Process 0 starts the coordinator inside
    `jax.distributed.initialize`, so the other processes may start first: refused connections are retried."""
    host, port = split_address(address)
    started = time.monotonic()
    deadline = started + timeout_s
    last_error: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=min(remaining, 5.0)):
                return time.monotonic() - started
        except OSError as error:
            last_error = error
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    raise CoordinatorUnreachable(
        f"process {process_id}: the coordinator at {address} (process 0) did not accept a connection within "
        f"distributed.init_timeout_s={timeout_s:g} s ({last_error}); start process 0 with the same "
        "distributed.coordinator_address, or check that the address is reachable from this host")
