"""The watchdog: a run that makes no progress for `run.stall_timeout_s` ends, loudly, instead of hanging.

Pipeline waits already give up after the stall timeout (`liveness.Liveness`); the watchdog is the backstop for
everything else — a checkpoint save, a weight transfer or a native call that never returns on the main
thread. It polls the run's `ProgressBeacon` on its own daemon thread; on a stall it writes every thread's stack
to the log, records the stop in the run journal (`stops.jsonl`) and ends the process with `EXIT_STALLED`
(`os._exit`: a hung thread cannot be asked to return). What is on disk is consistent at any instant (the
journal's invariant), so `flexmarl train` on the workdir resumes as after a kill -9.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable

from flexmarl_jax.orchestrator.liveness import ProgressBeacon

logger = logging.getLogger(__name__)

EXIT_STALLED = 3  # the exit code of a run the watchdog ended


def thread_stacks() -> str:
    """Every live thread's name and current stack, as text."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}):\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


def exit_now(code: int) -> None:
    """Flushes the log handlers and the standard streams, then ends the process without unwinding threads."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Watchdog:
    """Calls `on_stall(idle_s, what)` once when `beacon` has been quiet for more than `stall_timeout_s`.

    `on_stall` defaults to `report_and_exit` with a journal hook; tests pass their own to observe the trigger.
    """

    def __init__(self, beacon: ProgressBeacon, stall_timeout_s: float,
                 on_stall: Callable[[float, str], None], *, poll_s: float | None = None):
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s={stall_timeout_s!r} must be > 0")
        self.beacon, self.stall_timeout_s, self.on_stall = beacon, stall_timeout_s, on_stall
        self.poll_s = poll_s if poll_s is not None else min(1.0, stall_timeout_s / 10)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self.fired = threading.Event()

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            at, what = self.beacon.last()
            idle = self.beacon.clock() - at
            if idle > self.stall_timeout_s:
                self.fired.set()
                self.on_stall(idle, what)
                return

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def report_stall(idle_s: float, what: str, stall_timeout_s: float,
                 mark_journal: Callable[[str], None]) -> str:
    """Logs every thread's stack and marks the journal for a stall; returns the one-line summary."""
    summary = (f"no iteration, micro-batch or decode step made progress for {idle_s:.0f} s "
               f"(run.stall_timeout_s={stall_timeout_s:g}); the last progress was: {what}")
    log_stacks_and_mark(f"run stalled: {summary}", mark_journal)
    return summary


def log_stacks_and_mark(summary: str, mark_journal: Callable[[str], None]) -> None:
    """What every hard stop does before it exits: the summary and every thread's stack to the log, the
    summary to the journal."""
    logger.critical("%s; every thread's stack follows\n%s", summary, thread_stacks())
    try:
        mark_journal(summary)
    except Exception:  # noqa: BLE001 - the stacks are logged; exiting matters more
        logger.exception("could not mark the run journal")
