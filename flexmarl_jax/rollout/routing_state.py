"""The RequestRouter's bookkeeping (router.py): what each routed request and each instance holds, and the
per-agent heaps that find the least-loaded instance.

Kept apart from the router so that the routing policy there (queues, dispatch, timeouts, retries,
migrations) reads as decisions over this state, and the load arithmetic lives in one place. Nothing here
locks: every method runs under the router's lock.

Per agent, a min-heap of instance loads (outstanding tokens, then samples in flight) picks the target.
Entries are invalidated lazily rather than removed: each instance carries a version that every load
change bumps, so an entry with an older version is stale and skipped when it surfaces, which keeps a load
change O(log n) instead of a heap search.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import heapq
import itertools
from collections.abc import Hashable, Iterable, Mapping, Sequence

from flexmarl_jax.rollout.loop import RolloutRequest
from flexmarl_jax.rollout.protocols import RoutableInstance

# An instance's life in the router: SERVING its agent; DRAINING its in-flight work before it moves to
# another agent; LOADING that agent's weights; BROKEN after a failure (it gets no more requests).
SERVING, DRAINING, LOADING, BROKEN = "serving", "draining", "loading", "broken"


@dataclasses.dataclass(eq=False)
class Job:
    """One routed request; `attempt` is the live attempt's id (None while queued or finished)."""

    label: str
    agent: str
    request: RolloutRequest
    future: concurrent.futures.Future
    attempts: int = 0
    attempt: int | None = None
    deadline: float | None = None
    finished: bool = False


@dataclasses.dataclass(eq=False)
class Attempt:
    attempt_id: int
    job: Job
    request: RolloutRequest  # the copy handed to the instance (carries the router's callbacks)
    samples: int
    tokens: int


@dataclasses.dataclass(eq=False)
class Member:
    """The router's view of one instance: whom it serves and what it holds (cancelled attempts included,
    since they occupy slots until the instance lets go of them)."""

    instance: RoutableInstance
    agent: str  # the agent it serves (the first of `serves` for an instance shared by several)
    capacity: int
    architecture: Hashable
    # Every agent it serves: an instance of a LoRA base group serves each agent of the group from one engine
    # (its adapter table); its load is one, shared by their requests, and it never moves.
    serves: tuple[str, ...] = ()
    state: str = SERVING
    target_agent: str | None = None
    inflight: dict[int, Attempt] = dataclasses.field(default_factory=dict)
    samples: int = 0
    tokens: int = 0
    version: int = 0  # bumped on every load change; heap entries with an older version are stale
    migrated_at: float = float("-inf")
    moving_since: float | None = None  # when its current move began (it stopped taking its old agent's requests)
    # (steps seen, router-clock time they were first seen) while it holds live requests: the health check's
    # memory of when this instance last made progress (None while it holds none).
    watch: tuple[int, float] | None = None

    def __post_init__(self):
        self.serves = tuple(self.serves) or (self.agent,)

    @property
    def name(self) -> str:
        return self.instance.name

    @property
    def shared(self) -> bool:
        """Whether it serves several agents at once (a base group's instance)."""
        return len(self.serves) > 1

    def key(self) -> tuple[int, int]:
        return (self.tokens, self.samples)

    def has_room(self, samples: int) -> bool:
        """Room for a request of `samples` (an idle instance takes any size: its loop queues the excess)."""
        return self.samples == 0 or self.samples + samples <= self.capacity

    def hold(self, attempt: Attempt) -> None:
        """Counts `attempt` as this instance's load."""
        self.inflight[attempt.attempt_id] = attempt
        self.samples += attempt.samples
        self.tokens += attempt.tokens

    def live_attempts(self) -> list[Attempt]:
        """The attempts it holds that still count for their request (not cancelled, not superseded)."""
        return [a for a in self.inflight.values() if a.job.attempt == a.attempt_id]

    def drop(self, attempt_id: int) -> Attempt | None:
        """Stops counting an attempt; None if it was already dropped."""
        attempt = self.inflight.pop(attempt_id, None)
        if attempt is not None:
            self.samples -= attempt.samples
            self.tokens -= attempt.tokens
        return attempt


def members_of(instances: Mapping[str, Sequence[RoutableInstance]]) -> dict[str, Member]:
    """The router's members by instance name, from agent -> its instances (at least one each, names unique, each
    capacity >= 1). An instance listed under several agents is one member that serves them all."""
    members: dict[str, Member] = {}
    serves: dict[str, list[str]] = {}  # instance name -> the agents it is listed under
    for agent, agent_instances in instances.items():
        if not agent_instances:
            raise ValueError(f"agent {agent!r} has no engine instance; every agent needs at least one")
        for instance in agent_instances:
            known = members.get(instance.name)
            if known is not None and known.instance is not instance:
                raise ValueError(f"instance name {instance.name!r} is used twice; names must be unique")
            serves.setdefault(instance.name, []).append(agent)
            if known is None:
                capacity = int(instance.capacity)
                if capacity < 1:
                    raise ValueError(f"instance {instance.name!r} has capacity {capacity}; needs >= 1")
                members[instance.name] = Member(instance, agent, capacity, instance.architecture)
    for name, member in members.items():
        member.serves = tuple(serves[name])
    return members


class LoadHeaps:
    """Per agent, the serving instances by load, least loaded first (see the module docstring)."""

    def __init__(self, agents: Iterable[str]) -> None:
        self._heaps: dict[str, list] = {agent: [] for agent in agents}
        self._ties = itertools.count()
        self._tracked = 0

    def track(self, member: Member) -> None:
        """A new instance, entered under its agent."""
        self._tracked += 1
        self.push(member)

    def push(self, member: Member) -> None:
        """(Re-)enters `member` at its current load under every agent it serves; older entries go stale."""
        member.version += 1
        for agent in member.serves:
            heapq.heappush(self._heaps[agent], (member.key(), next(self._ties), member.version, member))

    def pick(self, agent: str, samples: int) -> Member | None:
        """The least-loaded serving instance of `agent` with room for `samples`."""
        heap, skipped, chosen = self._heaps[agent], [], None
        while heap:
            entry = heapq.heappop(heap)
            if not _live(entry, agent):
                continue
            if entry[3].has_room(samples):
                chosen = entry[3]
                break
            skipped.append(entry)
        for entry in skipped:
            heapq.heappush(heap, entry)
        if len(heap) > 4 * self._tracked + 16:  # drop stale entries now and then
            heap[:] = [entry for entry in heap if _live(entry, agent)]
            heapq.heapify(heap)
        return chosen


def _live(entry: tuple, agent: str) -> bool:
    """Whether a heap entry still describes its member: same load version, serving, and serving `agent`."""
    member = entry[3]
    return entry[2] == member.version and holds(member, agent)


def holds(member: Member, agent: str, *, include_incoming: bool = False) -> bool:
    """Whether `member` is one of `agent`'s instances: serving it now, or (`include_incoming`) being moved to it."""
    return ((member.state == SERVING and agent in member.serves)
            or (include_incoming and member.state in (DRAINING, LOADING) and member.target_agent == agent))


def move_problem(member: Member, to_agent: str, members: Iterable[Member], min_instances: int) -> str | None:
    """Why `member` cannot move to `to_agent` now, or None: it is not serving, it is a LoRA base group's shared
    engine, it serves `to_agent` already, `to_agent`'s instances run another model architecture, or its agent
    would keep fewer than `min_instances` instances (those moving to it count)."""
    members = list(members)
    name = member.name
    if member.state != SERVING:
        return f"instance {name!r} is {member.state}; only a serving instance can move"
    if member.shared:
        return (f"instance {name!r} serves {list(member.serves)} at once (a LoRA base group's engine); it does not "
                "move between agents")
    if member.agent == to_agent:
        return f"instance {name!r} already serves {to_agent!r}"
    peers = [m for m in members if m.state != BROKEN and m is not member
             and (m.agent == to_agent or m.target_agent == to_agent)]
    if peers and peers[0].architecture != member.architecture:
        return (f"cannot move instance {name!r} from {member.agent!r} to {to_agent!r}: its model architecture "
                f"{member.architecture!r} differs from {to_agent!r}'s {peers[0].architecture!r}; instances only "
                "move between agents of the same architecture")
    remaining = sum(holds(m, member.agent, include_incoming=True) for m in members) - 1
    if remaining < min_instances:
        return (f"moving {name!r} would leave {member.agent!r} with {remaining} instance(s); every agent keeps at "
                f"least {min_instances}")
    return None
