"""Intra-agent routing: each agent's request queue, least-loaded dispatch, timeouts, re-queues and the
mechanics of moving an instance to another agent.

The router keeps every agent's waiting requests itself and hands a request to an instance only while
that instance has a free decode slot (admission control). So the agent's queue length is a real signal
for the inter-agent balancer (balancer.py), and an instance can be taken away from an agent without any
request stranded in it: it stops getting that agent's work, finishes what it holds, loads the receiving
agent's weights, and only then takes the receiving agent's requests.

Per agent, a min-heap of instance loads (outstanding tokens, then samples in flight) picks the target;
entries are invalidated lazily (each instance carries a version that every load change bumps).

A dispatched request past `timeout_s` is cancelled (the instance's `cancel(request)`; where that returns
False, its late result is ignored and it keeps its slots until it ends) and re-queued at the
front of its agent's queue, at most `max_retries` times; after that its future fails with
`RequestFailed` naming the request. A request therefore resolves exactly once: with its results, or
with an error — never dropped, never delivered twice.

Instances implement `protocols.RoutableInstance` (name, capacity, architecture, check_request, submit,
update_params, cancel). Instance methods are never called while the router's lock is held (instances
call back into the router from their own threads, sometimes under their own locks).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from flexmarl_jax.rollout.backend import EngineBackend
from flexmarl_jax.rollout.loop import RolloutRequest, SequenceResult
from flexmarl_jax.rollout.protocols import RoutableInstance

logger = logging.getLogger(__name__)

SERVING, DRAINING, LOADING, BROKEN = "serving", "draining", "loading", "broken"


class RequestFailed(RuntimeError):
    """A request that could not be served: it timed out on `max_retries + 1` attempts, or its instance
    failed on the last attempt. The message names the request."""

    def __init__(self, label: str, attempts: int, reason: str):
        super().__init__(f"request {label!r} failed after {attempts} attempt(s): {reason}")
        self.label, self.attempts, self.reason = label, attempts, reason


@dataclasses.dataclass(eq=False)
class _Job:
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
class _Attempt:
    attempt_id: int
    job: _Job
    request: RolloutRequest  # the copy handed to the instance (carries the router's callbacks)
    samples: int
    tokens: int


@dataclasses.dataclass(eq=False)
class _Member:
    """The router's view of one instance: whom it serves and what it holds (cancelled attempts included,
    since they occupy slots until the instance lets go of them)."""

    instance: RoutableInstance
    agent: str
    capacity: int
    architecture: Hashable
    state: str = SERVING
    target_agent: str | None = None
    inflight: dict[int, _Attempt] = dataclasses.field(default_factory=dict)
    samples: int = 0
    tokens: int = 0
    version: int = 0  # bumped on every load change; heap entries with an older version are stale
    migrated_at: float = float("-inf")

    @property
    def name(self) -> str:
        return self.instance.name

    def key(self) -> tuple[int, int]:
        return (self.tokens, self.samples)

    def has_room(self, samples: int) -> bool:
        """Room for a request of `samples` (an idle instance takes any size: its loop queues the excess)."""
        return self.samples == 0 or self.samples + samples <= self.capacity


class RequestRouter:
    """Per-agent queues and least-loaded dispatch over `instances[agent]`.

    Args:
      instances: agent -> its instances (at least one each; names unique).
      timeout_s: a dispatched attempt older than this is cancelled and re-queued (None: never).
      max_retries: re-queues allowed per request after timeouts or instance errors (>= 0).
      weights_provider: agent -> (params, policy_version) that agent's instances serve now; a migrated
        instance loads these before it takes the agent's requests. Defaults to the last weights given to
        `update_params` (or `initial_weights`).
      initial_weights: agent -> (params, version) the instances start with (for the default provider).
      on_migrated: (instance, from_agent, to_agent) called when a moved instance starts serving.
      clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, instances: Mapping[str, Sequence[RoutableInstance]], *, timeout_s: float | None = None,
                 max_retries: int = 2, weights_provider: Callable[[str], tuple[Any, int]] | None = None,
                 initial_weights: Mapping[str, tuple[Any, int]] | None = None,
                 on_migrated: Callable[[RoutableInstance, str, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds (or None for no timeout)")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries={max_retries!r} must be an int >= 0")
        self.timeout_s, self.max_retries, self.clock = timeout_s, max_retries, clock
        self._migration_listeners = [on_migrated] if on_migrated is not None else []
        self._lock = threading.RLock()
        self._members: dict[str, _Member] = {}
        self._queues: dict[str, collections.deque[_Job]] = {}
        self._heaps: dict[str, list] = {}
        self._weights: dict[str, tuple[Any, int]] = dict(initial_weights or {})
        self._weights_generation: collections.Counter = collections.Counter()
        self._weights_provider = weights_provider or self.current_weights
        self._attempt_ids = itertools.count()
        self._heap_ties = itertools.count()
        self.stats = collections.Counter()  # submitted / completed / timeouts / retries / failed / migrations
        for agent, agent_instances in instances.items():
            if not agent_instances:
                raise ValueError(f"agent {agent!r} has no engine instance; every agent needs at least one")
            self._queues[agent] = collections.deque()
            self._heaps[agent] = []
            for instance in agent_instances:
                if instance.name in self._members:
                    raise ValueError(f"instance name {instance.name!r} is used twice; names must be unique")
                capacity = int(instance.capacity)
                if capacity < 1:
                    raise ValueError(f"instance {instance.name!r} has capacity {capacity}; needs >= 1")
                member = _Member(instance, agent, capacity, instance.architecture)
                self._members[instance.name] = member
                self._push(member)

    # ------------------------------------------------------------------ queries
    @property
    def agents(self) -> list[str]:
        return list(self._queues)

    def queue_length(self, agent: str) -> int:
        """Requests of `agent` waiting for an instance (dispatched ones are not counted)."""
        with self._lock:
            return len(self._queues[agent])

    def queue_lengths(self) -> dict[str, int]:
        with self._lock:
            return {agent: len(queue) for agent, queue in self._queues.items()}

    def instances_of(self, agent: str, *, include_incoming: bool = False) -> list[RoutableInstance]:
        """Instances serving `agent` now (with `include_incoming`, also those being moved to it)."""
        with self._lock:
            return [m.instance for m in self._members.values()
                    if (m.state == SERVING and m.agent == agent)
                    or (include_incoming and m.state in (DRAINING, LOADING) and m.target_agent == agent)]

    def num_instances(self, agent: str) -> int:
        return len(self.instances_of(agent, include_incoming=True))

    def instance_counts(self) -> dict[str, int]:
        return {agent: self.num_instances(agent) for agent in self._queues}

    def members(self) -> list[_Member]:
        with self._lock:
            return list(self._members.values())

    def inflight(self, instance_name: str) -> int:
        """Samples the instance holds (cancelled attempts that still occupy it included)."""
        with self._lock:
            return self._members[instance_name].samples

    def current_weights(self, agent: str) -> tuple[Any, int]:
        """The weights last given for `agent` (the default weights provider)."""
        with self._lock:
            if agent not in self._weights:
                raise ValueError(f"no weights known for agent {agent!r}: pass initial_weights or call "
                                 "update_params before moving an instance to it")
            return self._weights[agent]

    def pending(self) -> int:
        """Requests not yet resolved (queued or dispatched)."""
        with self._lock:
            queued = sum(len(q) for q in self._queues.values())
            live = sum(1 for m in self._members.values() for a in m.inflight.values() if a.job.attempt == a.attempt_id)
            return queued + live

    # ------------------------------------------------------------------ requests
    def submit(self, agent: str, request: RolloutRequest, *, label: str | None = None
               ) -> concurrent.futures.Future[list[SequenceResult]]:
        """Queues `request` for `agent`; the future resolves with one SequenceResult per sample, or fails
        with RequestFailed. The request's own on_done/on_error are called too (exactly one of them)."""
        if agent not in self._queues:
            raise ValueError(f"unknown agent {agent!r}; served agents: {sorted(self._queues)}")
        for member in self._members.values():
            if member.agent == agent:
                member.instance.check_request(request)  # a bad prompt raises here, in the caller's thread
                break
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        job = _Job(label or f"{agent}/{id(future):x}", agent, request, future)
        with self._lock:
            self._queues[agent].append(job)
            self.stats["submitted"] += 1
        self._dispatch([agent])
        return future

    def check_timeouts(self) -> int:
        """Cancels dispatched attempts past their deadline; re-queues or fails them. Returns how many."""
        if self.timeout_s is None:
            return 0
        now = self.clock()
        cancels, failures, agents = [], [], set()
        with self._lock:
            for member in self._members.values():
                for attempt in list(member.inflight.values()):
                    job = attempt.job
                    if job.attempt != attempt.attempt_id or job.deadline is None or now < job.deadline:
                        continue
                    self.stats["timeouts"] += 1
                    job.attempt, job.deadline = None, None
                    cancels.append((member, attempt))
                    reason = f"timed out after {self.timeout_s:g} s on {member.name}"
                    failures.extend(self._retry_or_fail(job, reason, None))
                    agents.add(job.agent)
        for member, attempt in cancels:
            self._cancel(member, attempt)
        self._resolve(failures)
        self._dispatch(agents)
        return len(cancels)

    # ------------------------------------------------------------------ weights
    def update_params(self, agent: str, params: Any, version: int) -> None:
        """New weights for `agent`: recorded for migrations and handed to every instance serving it."""
        with self._lock:
            if agent not in self._queues:
                raise ValueError(f"unknown agent {agent!r}; served agents: {sorted(self._queues)}")
            self._weights[agent] = (params, int(version))
            self._weights_generation[agent] += 1
            targets = [m.instance for m in self._members.values() if m.state == SERVING and m.agent == agent]
        for instance in targets:
            instance.update_params(params, version)

    # ------------------------------------------------------------------ migration
    def add_migration_listener(self, listener: Callable[[RoutableInstance, str, str], None]) -> None:
        """`listener(instance, from_agent, to_agent)` runs when a moved instance starts serving."""
        self._migration_listeners.append(listener)

    def migrate(self, instance_name: str, to_agent: str, *, min_instances: int = 1) -> None:
        """Moves an instance to `to_agent`: it stops taking its agent's requests now, finishes the ones it
        holds, loads `to_agent`'s current weights, then serves `to_agent`.

        Raises ValueError for an unknown instance/agent, an instance already moving, one whose agent would
        keep fewer than `min_instances`, or an instance of another model architecture than `to_agent`'s.
        """
        with self._lock:
            if to_agent not in self._queues:
                raise ValueError(f"unknown agent {to_agent!r}; served agents: {sorted(self._queues)}")
            member = self._members.get(instance_name)
            if member is None:
                raise ValueError(f"unknown instance {instance_name!r}; instances: {sorted(self._members)}")
            if member.state != SERVING:
                raise ValueError(f"instance {instance_name!r} is {member.state}; only a serving instance can move")
            if member.agent == to_agent:
                raise ValueError(f"instance {instance_name!r} already serves {to_agent!r}")
            peers = [m for m in self._members.values() if m.state != BROKEN and m is not member
                     and (m.agent == to_agent or m.target_agent == to_agent)]
            if peers and peers[0].architecture != member.architecture:
                raise ValueError(
                    f"cannot move instance {instance_name!r} from {member.agent!r} to {to_agent!r}: its model "
                    f"architecture {member.architecture!r} differs from {to_agent!r}'s {peers[0].architecture!r}; "
                    "instances only move between agents of the same architecture")
            remaining = len(self.instances_of(member.agent, include_incoming=True)) - 1
            if remaining < min_instances:
                raise ValueError(f"moving {instance_name!r} would leave {member.agent!r} with {remaining} "
                                 f"instance(s); every agent keeps at least {min_instances}")
            self._weights_provider_check(to_agent)
            member.state, member.target_agent = DRAINING, to_agent
            member.version += 1  # its heap entries go stale
            drained = not member.inflight
        if drained:
            self._finish_migration(member)

    def _weights_provider_check(self, agent: str) -> None:
        if self._weights_provider == self.current_weights and agent not in self._weights:
            self.current_weights(agent)  # raises the explanatory ValueError

    def _finish_migration(self, member: _Member) -> None:
        """Loads the receiving agent's current weights (outside the lock), then lets it serve. A weight sync
        that lands meanwhile is caught by comparing generations, and the load is repeated."""
        with self._lock:
            if member.state != DRAINING:
                return
            member.state = LOADING
        to_agent = member.target_agent
        while True:
            with self._lock:
                generation = self._weights_generation[to_agent]
            params, version = self._weights_provider(to_agent)
            member.instance.update_params(params, version)
            with self._lock:
                if self._weights_generation[to_agent] != generation:
                    continue
                from_agent = member.agent
                member.agent, member.target_agent, member.state = to_agent, None, SERVING
                member.migrated_at = self.clock()
                self.stats["migrations"] += 1
                self._push(member)
                break
        logger.info("instance %s moved from %s to %s (policy version %d)", member.name, from_agent, to_agent,
                    version)
        for listener in list(self._migration_listeners):
            listener(member.instance, from_agent, to_agent)
        self._dispatch([to_agent])

    # ------------------------------------------------------------------ internals
    def _push(self, member: _Member) -> None:
        member.version += 1
        heapq.heappush(self._heaps[member.agent], (member.key(), next(self._heap_ties), member.version, member))

    def _pick(self, agent: str, samples: int) -> _Member | None:
        """The least-loaded serving instance of `agent` with room for `samples` (lock held)."""
        heap, skipped, chosen = self._heaps[agent], [], None
        while heap:
            entry = heapq.heappop(heap)
            member = entry[3]
            if entry[2] != member.version or member.state != SERVING or member.agent != agent:
                continue  # stale
            if member.has_room(samples):
                chosen = member
                break
            skipped.append(entry)
        for entry in skipped:
            heapq.heappush(heap, entry)
        if len(heap) > 4 * len(self._members) + 16:  # drop stale entries now and then
            heap[:] = [e for e in heap if e[2] == e[3].version and e[3].state == SERVING and e[3].agent == agent]
            heapq.heapify(heap)
        return chosen

    def _dispatch(self, agents) -> None:
        """Hands queued requests to instances with room; instance.submit runs outside the lock."""
        sends: list[tuple[_Member, _Attempt]] = []
        with self._lock:
            for agent in agents:
                queue = self._queues[agent]
                while queue:
                    member = self._pick(agent, queue[0].request.num_samples)
                    if member is None:
                        break
                    job = queue.popleft()
                    attempt = self._new_attempt(member, job)
                    sends.append((member, attempt))
                    self._push(member)
        for member, attempt in sends:
            try:
                member.instance.submit(attempt.request)
            except ValueError as error:  # the request itself is bad (e.g. its prompt): no retry helps
                with self._lock:
                    self._release(member, attempt.attempt_id)
                    job = attempt.job
                    job.finished, job.attempt, job.deadline = True, None, None
                    self.stats["failed"] += 1
                failure = RequestFailed(job.label, job.attempts, f"{member.name} refused it: {error}")
                failure.__cause__ = error
                self._resolve([(job, None, failure)])
            except Exception as error:  # noqa: BLE001 - the instance is broken: retry elsewhere
                self._on_error(member, attempt.attempt_id, error)

    def _new_attempt(self, member: _Member, job: _Job) -> _Attempt:
        attempt_id = next(self._attempt_ids)
        request = dataclasses.replace(
            job.request,
            on_done=lambda results, m=member, a=attempt_id: self._on_done(m, a, results),
            on_error=lambda error, m=member, a=attempt_id: self._on_error(m, a, error))
        attempt = _Attempt(attempt_id, job, request, job.request.num_samples,
                           job.request.num_samples * job.request.max_new_tokens)
        job.attempts += 1
        job.attempt = attempt_id
        job.deadline = None if self.timeout_s is None else self.clock() + self.timeout_s
        member.inflight[attempt_id] = attempt
        member.samples += attempt.samples
        member.tokens += attempt.tokens
        return attempt

    def _release(self, member: _Member, attempt_id: int) -> _Attempt | None:
        """Removes an attempt from its instance (lock held); None if it was already removed."""
        attempt = member.inflight.pop(attempt_id, None)
        if attempt is not None:
            member.samples -= attempt.samples
            member.tokens -= attempt.tokens
            if member.state == SERVING:
                self._push(member)
        return attempt

    def _on_done(self, member: _Member, attempt_id: int, results: list[SequenceResult]) -> None:
        resolutions = []
        with self._lock:
            attempt = self._release(member, attempt_id)
            if attempt is not None and attempt.job.attempt == attempt_id and not attempt.job.finished:
                job = attempt.job
                job.finished, job.attempt, job.deadline = True, None, None
                self.stats["completed"] += 1
                resolutions.append((job, results, None))
            drained = member.state == DRAINING and not member.inflight
            agent = member.agent
        self._resolve(resolutions)
        if drained:
            self._finish_migration(member)
        else:
            self._dispatch([agent])

    def _on_error(self, member: _Member, attempt_id: int, error: BaseException) -> None:
        """The instance failed this attempt: it is taken out of routing, the request retried elsewhere."""
        resolutions, agents = [], set()
        with self._lock:
            attempt = self._release(member, attempt_id)
            if member.state in (SERVING, DRAINING):
                logger.warning("instance %s failed (%r); no more requests go to it", member.name, error)
                member.state = BROKEN
                member.version += 1
            if attempt is not None and attempt.job.attempt == attempt_id and not attempt.job.finished:
                job = attempt.job
                job.attempt, job.deadline = None, None
                reason = f"instance {member.name} failed: {error!r}"
                resolutions.extend(self._retry_or_fail(job, reason, error))
                agents.add(job.agent)
            for agent in list(agents):
                if not self.instances_of(agent, include_incoming=True):
                    for queued in self._queues[agent]:
                        queued.finished = True
                        self.stats["failed"] += 1
                        resolutions.append((queued, None, RequestFailed(
                            queued.label, queued.attempts, f"agent {agent!r} has no healthy instance left")))
                    self._queues[agent].clear()
        self._resolve(resolutions)
        self._dispatch(agents)

    def _retry_or_fail(self, job: _Job, reason: str, cause: BaseException | None) -> list:
        """Re-queues a job whose attempt ended badly (at the front: it waited longest), or fails it (lock
        held). Returns the resolutions to deliver."""
        if job.attempts <= self.max_retries:
            self.stats["retries"] += 1
            self._queues[job.agent].appendleft(job)
            return []
        job.finished = True
        self.stats["failed"] += 1
        error = RequestFailed(job.label, job.attempts, reason)
        error.__cause__ = cause
        return [(job, None, error)]

    def _cancel(self, member: _Member, attempt: _Attempt) -> None:
        """Frees the slots of a cancelled attempt when the instance can cancel; otherwise its late result is
        ignored when it comes (and its slots count as load until then)."""
        try:
            cancelled = member.instance.cancel(attempt.request)
        except Exception:  # noqa: BLE001 - cancelling is best effort
            logger.exception("instance %s: cancel failed", member.name)
            return
        if cancelled:
            with self._lock:
                self._release(member, attempt.attempt_id)
                drained = member.state == DRAINING and not member.inflight
            if drained:
                self._finish_migration(member)

    @staticmethod
    def _resolve(resolutions) -> None:
        """Delivers results/errors outside the lock: the future, then the request's own callbacks."""
        for job, results, error in resolutions:
            if error is None:
                job.future.set_result(results)
                if job.request.on_done is not None:
                    job.request.on_done(results)
            else:
                job.future.set_exception(error)
                if job.request.on_error is not None:
                    job.request.on_error(error)


class RoutedBackend(EngineBackend):
    """The workflows' GenerationBackend over a RequestRouter (same protocol and results as EngineBackend).

    Args:
      router: routes every agent's requests over its instances.
      tokenizer: our Tokenizer; prompts get a BOS when the tokenizer has one.
      start: start every instance's thread (and stop them in `close()`).
      services: objects with `start()`/`stop()` run alongside (the balancer, the timeout monitor); started
        now when `start`, stopped first in `close()`.
    """

    def __init__(self, router: RequestRouter, tokenizer: Any, *, start: bool = True, services: Sequence[Any] = ()):
        instances = {agent: router.instances_of(agent, include_incoming=True) for agent in router.agents}
        super().__init__(instances, tokenizer, start=start)
        self.router = router
        self.services = list(services)
        if start:
            for service in self.services:
                service.start()

    def _send(self, agent: str, request: RolloutRequest, request_id: str) -> None:
        """Through the router; a request that cannot be served fails its future with RequestFailed (naming
        request_id)."""
        self.router.submit(agent, request, label=request_id)

    def pick_instance(self, agent: str) -> Any:
        raise NotImplementedError("RoutedBackend routes through its RequestRouter; use submit()")

    def update_params(self, agent: str, params: Any, version: int) -> None:
        """New weights for `agent`'s instances, including any that move to it later."""
        self.router.update_params(agent, params, version)

    def close(self) -> None:
        for service in self.services:
            service.stop()
        super().close()
