"""Inter-agent load balancing: move engine instances from quiet agents to busy ones.

Every `poll_interval_s` the balancer reads each agent's queue length (requests waiting in the router).
When the longest queue exceeds the shortest by more than `delta`, it moves instances from the least
loaded agents to the most loaded one, as the FlexMARL paper does: as many as the queue-length gap
(in requests), taken from donors whose own gap to the receiver still exceeds `delta`, each donor
keeping `min_instances_per_agent`. The donors' spare instances usually bound the move, not the gap.
The router does the move (router.RequestRouter.migrate): the instance finishes its old agent's
requests, loads the receiving agent's current weights, then serves it.

Against oscillation: an instance that moved stays where it is for `cooldown_s`, and an agent with
instances still on their way gets no more until they arrive.

Queue lengths and instances per agent go on the Timeline as gauges (when they change), and each move
as a migration event on the moved instance's `rollout/<name>` row when it starts serving.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from flexmarl_jax.metrics import INSTANCES, QUEUE_LENGTH, Timeline
from flexmarl_jax.rollout.periodic import PeriodicThread
from flexmarl_jax.rollout.router import RequestRouter
from flexmarl_jax.rollout.routing_rules import (
    balance_cooldown_problem,
    balance_delta_problem,
    balance_poll_problem,
    instances_to_keep_problem,
    min_instances_problem,
)
from flexmarl_jax.rollout.routing_state import DRAINING, LOADING, SERVING

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PlannedMove:
    instance: str
    from_agent: str
    to_agent: str


def check_balancing(*, delta: Any, cooldown_s: Any, poll_interval_s: Any, min_instances_per_agent: Any,
                    instance_counts: dict[str, int], num_instances: int) -> None:
    """The balancing rules, as ValueErrors naming the value: each setting's own rule (routing_rules.py, which the
    run config checks too), then what the router's instances allow (`instance_counts`: agent -> instances it
    starts with; `num_instances`: every instance, each owning its devices): min x agents at most the instances
    there are (the device budget), and every agent starting with at least the minimum."""
    for name, value, problem in (("delta", delta, balance_delta_problem(delta)),
                                 ("cooldown_s", cooldown_s, balance_cooldown_problem(cooldown_s)),
                                 ("poll_interval_s", poll_interval_s, balance_poll_problem(poll_interval_s)),
                                 ("min_instances_per_agent", min_instances_per_agent,
                                  min_instances_problem(min_instances_per_agent))):
        if problem:
            raise ValueError(f"balancing {name}={value!r} {problem}")
    num_agents = len(instance_counts)
    if min_instances_per_agent * num_agents > num_instances:
        raise ValueError(
            f"min_instances_per_agent={min_instances_per_agent} x {num_agents} agents = "
            f"{min_instances_per_agent * num_agents} instances, more than the {num_instances} rollout instances "
            f"(device groups) there are; lower it to at most {num_instances // max(num_agents, 1)}")
    fewest = min(instance_counts.values(), default=min_instances_per_agent)  # no agents: none starts short
    problem = instances_to_keep_problem(min_instances_per_agent, fewest)
    if problem:
        short = {agent: n for agent, n in instance_counts.items() if n < min_instances_per_agent}
        raise ValueError(f"{problem}; agents that start with fewer: {short}")


class InstanceBalancer:
    """Polls a RequestRouter's queues and moves instances between agents (see the module docstring).

    Args:
      router: the router whose instances move (it loads the receiving agent's weights from its weights
        provider).
      delta: a move happens when max - min queue length > delta (>= 1).
      cooldown_s: an instance stays at least this long with the agent it moved to.
      poll_interval_s: seconds between polls when running on a thread (`start()`).
      min_instances_per_agent: instances every agent keeps.
        A run passes these four from its config (`routing_settings.balancer_settings_for`).
      timeline: where queue lengths, instance counts and migrations go (optional).
    """

    def __init__(self, router: RequestRouter, *, delta: int, cooldown_s: float, poll_interval_s: float,
                 min_instances_per_agent: int, timeline: Timeline | None = None):
        # A LoRA base group's agents share their instances (router members serving several agents): the device
        # budget counts the group once, under its first agent.
        followers = {agent for member in router.members() if member.shared for agent in member.serves[1:]}
        counts = {agent: count for agent, count in router.instance_counts().items() if agent not in followers}
        check_balancing(delta=delta, cooldown_s=cooldown_s, poll_interval_s=poll_interval_s,
                        min_instances_per_agent=min_instances_per_agent, instance_counts=counts,
                        num_instances=len(router.members()))
        self.router, self.delta, self.cooldown_s = router, delta, cooldown_s
        self.poll_interval_s, self.min_instances = poll_interval_s, min_instances_per_agent
        self.timeline = timeline
        self.moves: list[PlannedMove] = []
        self._last_recorded: dict[tuple[str, str], int] = {}
        self._poller = PeriodicThread("instance-balancer", poll_interval_s, self._tick)
        if timeline is not None:
            router.add_migration_listener(self._record_migration)
        self.record_gauges()

    # ------------------------------------------------------------------ one poll
    def plan(self) -> list[PlannedMove]:
        """The moves this poll warrants (nothing moves yet)."""
        router = self.router
        lengths = router.queue_lengths()
        members = router.members()
        now = router.clock()
        if len(lengths) < 2:
            return []
        receiver = max(lengths, key=lambda agent: lengths[agent])
        if lengths[receiver] - min(lengths.values()) <= self.delta:
            return []
        if any(m.state in (DRAINING, LOADING) and m.target_agent == receiver for m in members):
            return []  # earlier moves still on their way: judge the queue once they serve
        receiver_arch = next((m.architecture for m in members if m.agent == receiver and m.state == SERVING), None)
        wanted = lengths[receiver] - min(lengths.values())
        counts = router.instance_counts()
        moves: list[PlannedMove] = []
        for donor in sorted(lengths, key=lambda agent: lengths[agent]):
            if donor == receiver or lengths[receiver] - lengths[donor] <= self.delta:
                continue
            candidates = sorted(
                (m for m in members if m.state == SERVING and m.agent == donor and not m.shared
                 and now - m.migrated_at >= self.cooldown_s and m.architecture == receiver_arch),
                key=lambda m: (m.samples, m.name))  # the emptiest drains fastest
            spare = counts[donor] - self.min_instances
            for member in candidates[:max(spare, 0)]:
                if len(moves) == wanted:
                    return moves
                moves.append(PlannedMove(member.name, donor, receiver))
        return moves

    def poll_once(self) -> list[PlannedMove]:
        """Plans and starts this poll's moves; records the gauges. Returns the moves started."""
        started = []
        for move in self.plan():
            try:
                self.router.migrate(move.instance, move.to_agent, min_instances=self.min_instances)
            except ValueError as error:  # the router's state changed since planning; next poll re-plans
                logger.info("balancer skipped a move: %s", error)
                continue
            started.append(move)
            logger.info("balancer: moving %s from %s to %s", move.instance, move.from_agent, move.to_agent)
        self.moves.extend(started)
        self.record_gauges()
        return started

    def record_gauges(self) -> None:
        """Queue length and instances serving each agent (an instance in transit counts for neither side),
        on the timeline when they changed since the last poll."""
        if self.timeline is None:
            return
        serving = {agent: len(self.router.instances_of(agent)) for agent in self.router.agents}
        for series, values in ((QUEUE_LENGTH, self.router.queue_lengths()), (INSTANCES, serving)):
            for agent, value in values.items():
                if self._last_recorded.get((series, agent)) != value:
                    self._last_recorded[(series, agent)] = value
                    self.timeline.sample(series, agent, value)

    def _record_migration(self, instance: Any, from_agent: str, to_agent: str) -> None:
        self.timeline.record_migration(f"rollout/{instance.name}", from_agent=from_agent, to_agent=to_agent)

    # ------------------------------------------------------------------ thread
    def start(self) -> InstanceBalancer:
        self._poller.start()
        return self

    def stop(self) -> None:
        self._poller.stop()
        self.record_gauges()

    def _tick(self) -> None:
        self.poll_once()  # request timeouts and stuck instances are the InstanceHealthMonitor's (health.py)
