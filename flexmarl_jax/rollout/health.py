"""`InstanceHealthMonitor`: the service that keeps a RequestRouter's requests moving when instances fail.

Every `poll_s` it asks the router to take out instances that hold requests but made no engine step for
`stall_s` (`first_step_s` before an instance's first step, which compiles; `RequestRouter.check_progress`, which
reads each instance's lock-free step counter) and to cancel and re-queue requests past their timeout
(`check_timeouts`). Neither call waits on an instance's lock for long (a cancel waits at most the instance's
`cancel_wait_s`), so one hung engine step cannot stop the checks for the others. It runs in every
pipeline mode, with or without the inter-agent balancer.
"""

from __future__ import annotations

from flexmarl_jax.rollout.periodic import PeriodicThread
from flexmarl_jax.rollout.router import RequestRouter


class InstanceHealthMonitor:
    """Polls `router` on a daemon thread (`start()`/`stop()`); `poll_once()` runs one check (tests)."""

    def __init__(self, router: RequestRouter, *, stall_s: float, first_step_s: float | None = None,
                 poll_s: float = 0.5):
        if not stall_s > 0:
            raise ValueError(f"stall_s={stall_s!r} must be > 0 seconds")
        if first_step_s is not None and not first_step_s >= stall_s:
            raise ValueError(f"first_step_s={first_step_s!r} must be >= stall_s={stall_s!r}")
        if not poll_s > 0:
            raise ValueError(f"poll_s={poll_s!r} must be > 0 seconds")
        # An instance's first step compiles its programs: it may take up to first_step_s (None: stall_s).
        self.router, self.stall_s, self.first_step_s = router, stall_s, first_step_s
        self.taken_out: list[str] = []
        self._poller = PeriodicThread("instance-health", poll_s, self.poll_once)

    def poll_once(self) -> list[str]:
        """Takes stuck instances out and handles timed-out requests; returns the instances taken out."""
        stuck = self.router.check_progress(self.stall_s, self.first_step_s)
        self.taken_out.extend(stuck)
        self.router.check_timeouts()
        return stuck

    def start(self) -> InstanceHealthMonitor:
        self._poller.start()
        return self

    def stop(self) -> None:
        self._poller.stop()
