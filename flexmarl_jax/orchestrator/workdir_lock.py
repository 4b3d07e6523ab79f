"""One live run per workdir: an exclusive `flock` on `WORKDIR/run.lock`, held for the life of the process.

In a run of several processes (`config.distributed`) each process locks its own file (`run.lock` for process 0,
`run.process<i>.lock` for process i), so one run's processes share the workdir and a second run's process i
still fails on process i's lock.

Two runs on one workdir would both claim, checkpoint and journal there and corrupt each other's state, so a
second `flexmarl train` fails with one line naming the holder before it writes anything. The kernel releases
an flock when its process dies, however it dies (kill -9 included), so a lock left by a dead run is simply
taken over; the file's contents (pid, host, start time, command) only serve the messages.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import time

from flexmarl_jax.workdir_paths import is_local

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


def lock_file_name(process_index: int = 0) -> str:
    """The file process ``process_index`` of a run locks (`run.lock` for a single process and process 0)."""
    return LOCK_FILE if process_index == 0 else f"run.process{process_index}.lock"


class WorkdirBusy(RuntimeError):
    """Another live process holds the workdir; the message names it."""


def _describe(holder: dict) -> str:
    if not holder:
        return "another process (no details recorded)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')} since {started} ({holder.get('command', '?')})"


class WorkdirLock:
    """`acquire()` takes the workdir or raises WorkdirBusy; `release()` (or process exit) gives it back."""

    def __init__(self, workdir: str, process_index: int = 0):
        self.workdir = workdir
        self.file_name = lock_file_name(process_index)
        self.path = os.path.join(workdir, self.file_name)
        self._handle = None
        self._created: list[str] = []  # directories acquire() made, outermost first
        self.previous_holder: dict | None = None  # what a dead run left in the file, when we took it over

    def acquire(self) -> WorkdirLock:
        """Creates the workdir if needed (the only thing written before the lock is held; `release` removes it
        again when the run wrote nothing else). An object-store workdir (gs://) has no locks: a warning says
        that one run per workdir is then the launcher's to keep."""
        if not is_local(self.workdir):
            logger.warning("workdir %s is on an object store, which has no file locks: make sure one run at a "
                           "time uses it", self.workdir)
            return self
        self._created = _missing_directories(self.workdir)
        os.makedirs(self.workdir, exist_ok=True)
        handle = open(self.path, "a+")  # noqa: SIM115 - held open for the life of the lock
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(handle)
            handle.close()
            raise WorkdirBusy(f"workdir {self.workdir} is in use by a live run: {_describe(holder)}; stop it "
                              "or pass another --workdir") from None
        previous = _read(handle)
        if previous and previous.get("pid") != os.getpid():
            self.previous_holder = previous
            logger.info("took over the lock of workdir %s left by a run that is gone: %s", self.workdir,
                        _describe(previous))
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                                 "command": " ".join(os.path.basename(arg) for arg in sys.argv[:2])}))
        handle.flush()
        self._handle = handle
        return self

    def release(self) -> None:
        if self._handle is not None:
            self._remove_if_untouched()
            fcntl.flock(self._handle.fileno(), fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None

    def _remove_if_untouched(self) -> None:
        """A run stopped before it wrote anything (a preflight error: a prompt too long, too little memory)
        leaves no workdir behind: the lock file and the directories `acquire` made go again."""
        if not self._created:
            return
        try:
            if os.listdir(self.workdir) != [self.file_name]:
                return
            os.remove(self.path)
            for directory in reversed(self._created):
                os.rmdir(directory)
        except OSError:  # something else appeared meanwhile: keep what is there
            pass

    def __enter__(self) -> WorkdirLock:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()


def _missing_directories(path: str) -> list[str]:
    """The directories on the way to `path` (itself included) that do not exist yet, outermost first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing[::-1]


def _read(handle) -> dict:
    handle.seek(0)
    text = handle.read()
    try:
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {}
