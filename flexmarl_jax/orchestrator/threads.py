"""Run a set of named callables on threads of their own and re-raise the first error.

The pipeline starts threads in three places (one dispatcher per agent, one update per agent, the training
side beside the rollout); each must join every thread it started, even when one of them or the caller's
own work fails, and must not swallow an error. This is the one place that does that. With a `Liveness`, a
join waits only while the run makes progress (or until the iteration is abandoned): a thread stuck for good
is then left behind (they are daemons) and the join raises, naming it, instead of hanging the run.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping

from flexmarl_jax.orchestrator.liveness import Liveness


@contextlib.contextmanager
def threads_running(targets: Mapping[str, Callable[[], None]], *,
                    liveness: Liveness | None = None) -> Iterator[None]:
    """Runs each target on its own daemon thread (named by its key) while the block runs.

    On leaving the block every thread is joined; then the block's own error, if any, propagates, else the
    first error a target raised (in completion order) is re-raised. A target must end by itself: the
    caller arranges that (e.g. a dispatcher's drain returns once the rollout it waits on is done).
    With `liveness`, a join ends early with PipelineStalled when the run stops making progress.
    """
    errors: list[BaseException] = []
    lock = threading.Lock()

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as error:  # re-raised on the caller's thread below
            with lock:
                errors.append(error)

    threads = [threading.Thread(target=guarded, args=(target,), name=name, daemon=True)
               for name, target in targets.items()]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        for thread in threads:
            if liveness is None:
                thread.join()
            else:  # the caller's targets end soon after an abandon (dispatchers stop claiming): wait for them
                liveness.join(thread, abandonable=False)
    if errors:
        raise errors[0]


def run_threads(targets: Mapping[str, Callable[[], None]], *, liveness: Liveness | None = None) -> None:
    """Runs the targets concurrently and returns when all are done; re-raises the first error."""
    with threads_running(targets, liveness=liveness):
        pass
