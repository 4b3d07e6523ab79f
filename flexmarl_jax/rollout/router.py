"""Intra-agent routing: each agent's request queue, least-loaded dispatch, timeouts, re-queues and the
mechanics of moving an instance to another agent.

The router keeps every agent's waiting requests itself and hands a request to an instance only while
that instance has a free decode slot (admission control). So the agent's queue length is a real signal
for the inter-agent balancer (balancer.py), and an instance can be taken away from an agent without any
request stranded in it: it stops getting that agent's work, finishes what it holds, loads the receiving
agent's weights, and only then takes the receiving agent's requests.

Per agent, the least-loaded instance (outstanding tokens, then samples in flight) with room gets the next
request; that load bookkeeping, per instance and per request, is in routing_state.py.

An instance that holds live requests but finishes no engine step for `stall_s` (`check_progress`, read from
its lock-free `progress`, so a hung step cannot hang the check) is taken out of routing like one that
failed: marked broken, its requests re-queued at the front of their agent's queue (counted as an attempt,
within `max_retries`) for the agent's other instances; a late result from it is ignored.

A dispatched request past `timeout_s` is cancelled (the instance's `cancel(request)`; where that returns
False, its late result is ignored and it keeps its slots until it ends) and re-queued at the
front of its agent's queue, at most `max_retries` times; after that its future fails with
`RequestFailed` naming the request. A request therefore resolves exactly once: with its results, or
with an error — never dropped, never delivered twice.

Instances implement `protocols.RoutableInstance` (name, capacity, architecture, check_request, submit,
update_params, cancel). Instance methods are never called while the router's lock is held (instances
call back into the router from their own threads, sometimes under their own locks).

The workflows reach the router through `routed_backend.RoutedBackend`, a GenerationBackend over it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flexmarl_jax import faults
from flexmarl_jax.rollout.loop import RolloutRequest, SequenceResult
from flexmarl_jax.rollout.protocols import RoutableInstance
from flexmarl_jax.rollout.routing_rules import max_retries_problem
from flexmarl_jax.rollout.routing_state import (
    BROKEN,
    DRAINING,
    LOADING,
    SERVING,
    Attempt,
    Job,
    LoadHeaps,
    Member,
    holds,
    members_of,
    move_problem,
)

logger = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """A request that could not be served: it timed out on `max_retries + 1` attempts, or its instance
    failed on the last attempt. The message names the request."""

    def __init__(self, label: str, attempts: int, reason: str):
        super().__init__(f"request {label!r} failed after {attempts} attempt(s): {reason}")
        self.label, self.attempts, self.reason = label, attempts, reason


class RequestRouter:
    """Per-agent queues and least-loaded dispatch over `instances[agent]`.

    Args:
      instances: agent -> its instances (at least one each; names unique). One instance listed under several
        agents serves them all at once (a LoRA base group's engine, `EngineInstance(adapter_agents=)`): its load
        is shared by their requests, each agent's weight sync reaches it through `update_agent_params`, and it
        never moves between agents.
      timeout_s: a dispatched attempt older than this is cancelled and re-queued (None: never).
      max_retries: re-queues allowed per request after timeouts or instance errors (>= 0).
        A run passes both from its config (`routing_settings.router_settings_for`).
      weights_provider: agent -> (params, policy_version) that agent's instances serve now; a migrated
        instance loads these before it takes the agent's requests. Defaults to the last weights given to
        `update_params` (or `initial_weights`).
      initial_weights: agent -> (params, version) the instances start with (for the default provider).
      on_migrated: (instance, from_agent, to_agent) called when a moved instance starts serving.
      clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, instances: Mapping[str, Sequence[RoutableInstance]], *, timeout_s: float | None,
                 max_retries: int, weights_provider: Callable[[str], tuple[Any, int]] | None = None,
                 initial_weights: Mapping[str, tuple[Any, int]] | None = None,
                 on_migrated: Callable[[RoutableInstance, str, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0 seconds (or None for no timeout)")
        problem = max_retries_problem(max_retries)
        if problem:
            raise ValueError(f"max_retries={max_retries!r} {problem}")
        self.timeout_s, self.max_retries, self.clock = timeout_s, max_retries, clock
        self._migration_listeners = [on_migrated] if on_migrated is not None else []
        self._lock = threading.RLock()
        self._loads = LoadHeaps(instances)
        self._weights: dict[str, tuple[Any, int]] = dict(initial_weights or {})
        self._weights_generation: collections.Counter = collections.Counter()
        self._weights_provider = weights_provider or self.current_weights
        self._attempt_ids = itertools.count()
        # submitted / completed / timeouts / retries / failed / migrations, and migration_s: the seconds moved
        # instances spent between leaving their agent and serving the next (draining, then loading weights)
        self.stats = collections.Counter()
        # agent -> the most requests that waited in its queue at once (none of its instances had room)
        self.queue_peaks: collections.Counter = collections.Counter(dict.fromkeys(instances, 0))
        self._members = members_of(instances)
        self._queues = {agent: collections.deque() for agent in instances}
        for member in self._members.values():
            self._loads.track(member)

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
            return [m.instance for m in self._members.values() if holds(m, agent, include_incoming=include_incoming)]

    def num_instances(self, agent: str) -> int:
        return len(self.instances_of(agent, include_incoming=True))

    def instance_counts(self) -> dict[str, int]:
        return {agent: self.num_instances(agent) for agent in self._queues}

    def members(self) -> list[Member]:
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
            if agent in member.serves:
                member.instance.check_request(request)  # a bad prompt raises here, in the caller's thread
                break
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        job = Job(label or f"{agent}/{id(future):x}", agent, request, future)
        with self._lock:
            self._queues[agent].append(job)
            self.stats["submitted"] += 1
        self._dispatch([agent])
        return future

    def check_progress(self, stall_s: float, first_step_s: float | None = None) -> list[str]:
        """Takes out of routing every instance that holds live requests and finished no step for `stall_s`
        (router clock); their requests go to the agent's other instances. Returns the names taken out.

        first_step_s: the limit for an instance that has not finished a step yet (its first step compiles the
        engine's programs, which on a loaded host takes longer than a step ever should); None: `stall_s`.

        An instance without requests is stuck too when one step has been running that long (a step of a weight
        swap that never returns): otherwise the next request sent to it would wait out the limit first, and
        closing the backend would wait for its thread. Its progress clock is the router's (`time.monotonic`)."""
        with self._lock:
            watched = [m for m in self._members.values() if m.state in (SERVING, DRAINING)]
        # Lock-free reads, outside our lock: (steps finished, when the step now running began).
        progress = {m.name: (m.instance.progress.steps, m.instance.progress.step_started_at) for m in watched}
        now = self.clock()
        stuck = []
        with self._lock:
            for member in watched:
                count, step_started_at = progress[member.name]
                limit = stall_s if count or first_step_s is None else first_step_s
                if member.state not in (SERVING, DRAINING) or not member.live_attempts():
                    member.watch = None
                    if member.state in (SERVING, DRAINING) and step_started_at is not None and \
                            now - step_started_at >= limit:
                        stuck.append((member, limit))
                    continue
                if member.watch is None or member.watch[0] != count:
                    member.watch = (count, now)  # progress (or newly busy): the clock starts again
                    continue
                if now - member.watch[1] >= limit:
                    stuck.append((member, limit))
        for member, limit in stuck:
            self._take_out(member, f"instance {member.name} finished no engine step for {limit:g} s")
        return [member.name for member, _ in stuck]

    def _take_out(self, member: Member, reason: str) -> None:
        """Marks `member` broken and re-queues (or fails) every live request it holds; never calls it."""
        resolutions, agents = [], set(member.serves)
        with self._lock:
            if member.state == BROKEN:
                return
            logger.warning("%s; no more requests go to it, its %d request(s) are re-queued", reason,
                           len(member.live_attempts()))
            faults.detected(reason)
            member.state = BROKEN
            member.version += 1
            self.stats["stuck"] += 1
            for attempt in member.live_attempts():
                job = attempt.job
                member.drop(attempt.attempt_id)
                job.attempt, job.deadline = None, None
                resolutions.extend(self._retry_or_fail(job, reason, None))
                agents.add(job.agent)
            resolutions.extend(self._fail_agents_without_instances(agents))
        self._resolve(resolutions)
        self._dispatch(agents)

    def _fail_agents_without_instances(self, agents) -> list:
        """Fails the queued requests of every agent in `agents` left with no healthy instance (lock held)."""
        resolutions = []
        for agent in list(agents):
            if not self.instances_of(agent, include_incoming=True):
                for queued in self._queues[agent]:
                    queued.finished = True
                    self.stats["failed"] += 1
                    resolutions.append((queued, None, RequestFailed(
                        queued.label, queued.attempts, f"agent {agent!r} has no healthy instance left")))
                self._queues[agent].clear()
        return resolutions

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
                    faults.detected(f"a request timed out on {member.name}")
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
            targets = [m for m in self._members.values() if holds(m, agent)]
        for member in targets:
            if member.shared:
                member.instance.update_agent_params(agent, params, version)
            else:
                member.instance.update_params(params, version)

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
            problem = move_problem(member, to_agent, self._members.values(), min_instances)
            if problem:
                raise ValueError(problem)
            self._weights_provider_check(to_agent)
            member.state, member.target_agent = DRAINING, to_agent
            member.moving_since = self.clock()
            member.version += 1  # its heap entries go stale
            drained = not member.inflight
        if drained:
            self._finish_migration(member)

    def _weights_provider_check(self, agent: str) -> None:
        if self._weights_provider == self.current_weights and agent not in self._weights:
            self.current_weights(agent)  # raises the explanatory ValueError

    def _finish_migration(self, member: Member) -> None:
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
            member.instance.wait_for_weights()  # the move lasts until the weights are on its devices
            with self._lock:
                if self._weights_generation[to_agent] != generation:
                    continue
                from_agent = member.agent
                member.agent, member.target_agent, member.state = to_agent, None, SERVING
                member.serves = (to_agent,)
                member.migrated_at = self.clock()
                self.stats["migrations"] += 1
                self.stats["migration_s"] += member.migrated_at - member.moving_since
                member.moving_since = None
                self._loads.push(member)
                break
        logger.info("instance %s moved from %s to %s (policy version %d)", member.name, from_agent, to_agent,
                    version)
        for listener in list(self._migration_listeners):
            listener(member.instance, from_agent, to_agent)
        self._dispatch([to_agent])

    # ------------------------------------------------------------------ internals
    def _dispatch(self, agents) -> None:
        """Hands queued requests to instances with room; instance.submit runs outside the lock."""
        sends: list[tuple[Member, Attempt]] = []
        with self._lock:
            for agent in agents:
                queue = self._queues[agent]
                while queue:
                    member = self._loads.pick(agent, queue[0].request.num_samples)
                    if member is None:
                        break
                    job = queue.popleft()
                    attempt = self._new_attempt(member, job)
                    sends.append((member, attempt))
                    self._loads.push(member)
                if len(queue) > self.queue_peaks[agent]:
                    self.queue_peaks[agent] = len(queue)
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

    def _new_attempt(self, member: Member, job: Job) -> Attempt:
        attempt_id = next(self._attempt_ids)
        request = dataclasses.replace(
            job.request,
            on_done=lambda results, m=member, a=attempt_id: self._on_done(m, a, results),
            on_error=lambda error, m=member, a=attempt_id: self._on_error(m, a, error))
        attempt = Attempt(attempt_id, job, request, job.request.num_samples,
                           job.request.num_samples * job.request.max_new_tokens)
        job.attempts += 1
        job.attempt = attempt_id
        job.deadline = None if self.timeout_s is None else self.clock() + self.timeout_s
        member.hold(attempt)
        return attempt

    def _release(self, member: Member, attempt_id: int) -> Attempt | None:
        """Removes an attempt from its instance (lock held); None if it was already removed."""
        attempt = member.drop(attempt_id)
        if attempt is not None and member.state == SERVING:
            self._loads.push(member)
        return attempt

    def _on_done(self, member: Member, attempt_id: int, results: list[SequenceResult]) -> None:
        resolutions = []
        with self._lock:
            attempt = self._release(member, attempt_id)
            if attempt is not None and attempt.job.attempt == attempt_id and not attempt.job.finished:
                job = attempt.job
                job.finished, job.attempt, job.deadline = True, None, None
                self.stats["completed"] += 1
                resolutions.append((job, results, None))
            drained = member.state == DRAINING and not member.inflight
            agents = member.serves
        self._resolve(resolutions)
        if drained:
            self._finish_migration(member)
        else:
            self._dispatch(agents)

    def _on_error(self, member: Member, attempt_id: int, error: BaseException) -> None:
        """The instance failed this attempt: it is taken out of routing, the request retried elsewhere."""
        resolutions, agents = [], set()
        with self._lock:
            attempt = self._release(member, attempt_id)
            if member.state in (SERVING, DRAINING):
                logger.warning("instance %s failed (%r); no more requests go to it", member.name, error)
                faults.detected(f"instance {member.name} failed")
                member.state = BROKEN
                member.version += 1
            if attempt is not None and attempt.job.attempt == attempt_id and not attempt.job.finished:
                job = attempt.job
                job.attempt, job.deadline = None, None
                reason = f"instance {member.name} failed: {error!r}"
                resolutions.extend(self._retry_or_fail(job, reason, error))
                agents.add(job.agent)
            resolutions.extend(self._fail_agents_without_instances(agents))
        self._resolve(resolutions)
        self._dispatch(agents)

    def _retry_or_fail(self, job: Job, reason: str, cause: BaseException | None) -> list:
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

    def _cancel(self, member: Member, attempt: Attempt) -> None:
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
