"""The records a `Timeline` holds (busy intervals, point events, samples) and the conventional names of
its series and interval kinds.

They are plain frozen values with no behaviour beyond naming, kept apart from the recorder so that the
utilization accounting (utilization.py), the recorder (timeline.py) and the plots can all use them
without importing one another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# Interval kinds the plots know colours for; any other string is allowed too.
KNOWN_KINDS = ("prefill", "decode", "train", "sync", "swap", "load")  # load: an engine taking in weights

# Conventional names, so the orchestrator, the balancer and the plots agree without string typos.
MIGRATION = "migration"  # event: an instance moved from one agent to another
POLICY_VERSION = "policy_version"  # event: an agent's policy version changed
ITERATION_SPAN = "iteration_span"  # event at an iteration's start; attrs: iteration (its number), end (its end)
QUEUE_LENGTH = "queue_length"  # gauge per agent: requests waiting
INSTANCES = "instances"  # gauge per agent: rollout instances serving it
REQUESTS = "requests"  # counter per agent: rollout requests submitted
GENERATED_TOKENS = "generated_tokens"  # counter per agent: tokens generated


@dataclasses.dataclass(frozen=True)
class BusyInterval:
    """`resource` was busy doing `kind` (for `agent`) from `start` to `end` seconds."""

    resource: str
    start: float
    end: float
    kind: str = "busy"
    agent: str | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def group(self) -> str:
        return resource_group(self.resource)


@dataclasses.dataclass(frozen=True)
class PointEvent:
    """Something that happened at one instant (a migration, a policy version change, ...)."""

    time: float
    name: str
    agent: str | None = None
    resource: str | None = None
    attrs: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Sample:
    """One value of a time series `series` for `key` (usually an agent name) at `time`.

    For counters `value` is the increment recorded at that time, not the running total.
    """

    time: float
    series: str
    key: str
    value: float


def resource_group(resource: str) -> str:
    """`"rollout/solver/0"` -> `"rollout"`: the first path component of a resource name."""
    return resource.split("/", 1)[0]
