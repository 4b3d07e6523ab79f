"""Graceful stop: SIGTERM or SIGINT ends a run at a consistent point, within a bounded time.

The first signal asks for a stop. With `run.stop_mode=finish` the running iteration completes (its update is
checkpointed and its rows consumed) and the run loop ends before the next one; with `abandon` the iteration is
given up at once (`JointOrchestrator.abandon_iteration`: nothing of it is applied; the claims are released, and
a resume redoes it). A second signal abandons in either mode. Either way the process ends within
`run.stop_timeout_s` of the first signal: past that, a timer logs every thread's stack, marks the journal and
exits (the workdir is consistent at any instant, as after a kill -9).

Python runs signal handlers on the main thread between bytecodes; the pipeline's waits block in short slices,
so a handler runs promptly. A main thread stuck inside a native call is the watchdog's case.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Installs SIGTERM/SIGINT handlers (main thread only) that record a stop request; see the module docstring.

    Args:
      mode: "finish" or "abandon" (run.stop_mode).
      stop_timeout_s: the process ends this long after the first signal at the latest.
      abandon: gives up the running iteration (called from the handler: must only set events).
      on_timeout: called on the timer thread when the stop took too long (logs, marks the journal, exits).
    """

    def __init__(self, mode: str, stop_timeout_s: float, *, abandon: Callable[[], None],
                 on_timeout: Callable[[str], None]):
        if mode not in ("finish", "abandon"):
            raise ValueError(f"stop mode {mode!r}; allowed: finish, abandon")
        self.mode, self.stop_timeout_s = mode, stop_timeout_s
        self._abandon, self._on_timeout = abandon, on_timeout
        self.requested = threading.Event()
        self.signal_name: str | None = None
        self.signal_number: int | None = None
        self.abandoned = False
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    @property
    def exit_code(self) -> int:
        """128 + the signal number, the shell's convention for a process ended by a signal."""
        return 128 + (self.signal_number or signal.SIGTERM)

    def install(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread (tests that run a run on a thread)
        for number in HANDLED:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()

    def request(self, number: int) -> None:
        """What a signal does (also callable directly)."""
        name = signal.Signals(number).name
        if not self.requested.is_set():
            self.signal_name, self.signal_number = name, number
            self.requested.set()
            self._timer = threading.Timer(self.stop_timeout_s, self._on_timeout,
                                          args=(f"the stop asked for by {name} took over "
                                                f"run.stop_timeout_s={self.stop_timeout_s:g} s",))
            self._timer.daemon = True
            self._timer.start()
            if self.mode == "finish":
                logger.warning("%s: finishing the running iteration, then stopping (send it again to abandon the "
                               "iteration instead)", name)
                return
        elif self.abandoned:
            return
        logger.warning("%s: abandoning the running iteration (a resume redoes it)", name)
        self.abandoned = True
        self._abandon()

    def _handle(self, number, frame) -> None:
        self.request(number)
