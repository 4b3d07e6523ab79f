"""One side of a side-by-side benchmark in its own process, driven command by command from the parent.

`flexmarl bench realshape` runs our stack and torch/transformers in two processes (both sides' training
state does not fit in one host's memory at real size) and still interleaves their repeats: the parent sends
one JSON command per line on the worker's stdin and reads one JSON reply per line. The worker's own stdout
is pointed at stderr before anything else runs, so library prints cannot corrupt the reply stream; its
stderr (progress lines, warnings) goes straight to the parent's stderr.

Pure Python (no JAX, no torch, nothing from the package that pulls them in): both workers import it first.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

Handler = Callable[..., dict]


def pin_to_cores(threads: int) -> list[int]:
    """Restricts this process to its first `threads` allowed cores (before JAX/torch start their pools), so
    both sides of a comparison run on the same cores with the same thread count. Returns the cores."""
    allowed = sorted(os.sched_getaffinity(0))
    if threads > len(allowed):
        raise ValueError(f"--threads={threads} is more than the {len(allowed)} cores this process may use")
    cores = allowed[:threads]
    os.sched_setaffinity(0, cores)
    return cores


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def rss_gb() -> float:
    """This process's resident memory now (from /proc; 0.0 where there is none)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        return 0.0


def release_freed_memory() -> None:
    """Collects garbage and hands memory that was freed back to the OS (glibc keeps freed heap pages mapped).

    Both workers live on one host for the whole benchmark; a side whose freed optimizer state stays resident
    squeezes the other side's next round into less memory. Each side calls this after every round."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: nothing to trim
            pass


def progress(message: str) -> None:
    print(f"  [{os.path.basename(sys.argv[0]).removesuffix('.py')}] {message}", file=sys.stderr, flush=True)


def _plain(value: Any) -> Any:
    """numpy scalars (what timing code often returns) as Python numbers for json."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot send {type(value).__name__} to the parent")


def serve(handlers: Mapping[str, Handler]) -> int:
    """Answers commands {"command": NAME, **kwargs} until "exit" or end of input.

    A failing handler answers {"error": traceback} and the loop goes on, so the parent reports the cause.
    """
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from libraries land on stderr, never in the reply stream
    for line in sys.stdin:
        request = json.loads(line)
        command = request.pop("command")
        if command == "exit":
            break
        try:
            reply = handlers[command](**request)
        except Exception:  # the parent re-raises with this text
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply, default=_plain) + "\n")
    return 0


class SideProcess:
    """The parent's handle on one worker: `call(command, **kwargs)` returns its reply dict."""

    def __init__(self, name: str, argv: list[str], *, env: Mapping[str, str] | None = None):
        self.name = name
        self._process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         env=dict(env) if env is not None else None)

    def call(self, command: str, **kwargs: Any) -> dict:
        self._process.stdin.write(json.dumps({"command": command, **kwargs}) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            code = self._process.wait()
            raise RuntimeError(f"{self.name} worker exited (code {code}) during {command!r}; see its stderr above")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.name} worker failed in {command!r}:\n{reply['error']}")
        return reply

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._process.stdin.write(json.dumps({"command": "exit"}) + "\n")
                self._process.stdin.close()
                self._process.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> SideProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
