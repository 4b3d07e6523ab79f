"""`StepProgress`: an engine instance's step counter, readable without the instance's lock.

A step that never returns holds whatever the stepping thread holds; anything that needs the instance's
lock to learn whether it is alive would hang with it. So the stepping thread publishes its progress in
plain attributes (one writer; reads of an int or float attribute are atomic in Python), and the router's
health check and the run's watchdog read them from any thread, at any time, without waiting on anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class StepProgress:
    """`steps`: engine steps finished; `last_step_at()`: when the last one finished (or the tracker was made);
    `step_started_at`: when the step now running began (None between steps)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.steps = 0
        self._last_step_at = clock()
        self.step_started_at: float | None = None

    def begin(self) -> None:
        self.step_started_at = self._clock()

    def end(self) -> None:
        self.steps += 1
        self._last_step_at = self._clock()
        self.step_started_at = None

    def last_step_at(self) -> float:
        return self._last_step_at
