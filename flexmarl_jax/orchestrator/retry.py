"""One iteration, tried again once after a trainer error, then the run stops.

A trainer that raises in a micro-batch or in its update (`dispatch.TrainerFailed`) leaves nothing applied when
every agent is still at the iteration's starting version: the orchestrator has given every claimed row back,
so the iteration can run again from scratch (fresh input ids; the failed attempt's rows are dropped, never
trained). A second failure, or a failure after some agent already applied its update, stops the run with
`IterationFailed`; the last checkpoint is intact and the workdir resumes from it. Other errors (the store, a
rollout request that failed after its retries, a stall) are not retried: they stop the run at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from flexmarl_jax import faults
from flexmarl_jax.orchestrator.dispatch import TrainerFailed

logger = logging.getLogger(__name__)


class IterationFailed(RuntimeError):
    """The run stops: an iteration failed and could not be retried (the message says why)."""


class Iterations(Protocol):
    def versions(self) -> dict[str, int]: ...

    def run_iteration(self, iteration: int) -> dict: ...


def run_with_one_retry(orchestrator: Iterations, iteration: int, begin_attempt: Callable[[int], None]) -> dict:
    """Runs `iteration` (after `begin_attempt(iteration)`); after a TrainerFailed with no update applied, calls
    `begin_attempt(iteration)` again and runs it a second time. Returns the metrics record; raises
    IterationFailed when the iteration cannot complete."""
    start = orchestrator.versions()
    begin_attempt(iteration)
    try:
        return orchestrator.run_iteration(iteration)
    except TrainerFailed as first:
        if orchestrator.versions() != start:
            raise IterationFailed(f"iteration {iteration}: {first}, after other agents had applied their update "
                                  f"(versions {start} -> {orchestrator.versions()}); not retried") from first
        logger.warning("iteration %d: %s; every row it claimed was released; trying the iteration once more",
                       iteration, first)
        faults.detected(f"iteration {iteration} retried after a trainer error")
        begin_attempt(iteration)
        try:
            return orchestrator.run_iteration(iteration)
        except TrainerFailed as second:
            raise IterationFailed(f"iteration {iteration} failed twice: {first}; then {second}") from second
