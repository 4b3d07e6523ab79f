"""A daemon thread that calls one function every `interval_s` until stopped (balancer polls, timeout checks)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class PeriodicThread:
    """Runs `tick()` every `interval_s` on a daemon thread; a failing tick is logged and the loop goes on."""

    def __init__(self, name: str, interval_s: float, tick: Callable[[], None]):
        self.name, self.interval_s, self._tick = name, interval_s, tick
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - keep going; the error is logged
                logger.exception("%s: periodic call failed", self.name)
