"""The request-handling and balancing rules that the run config checks (`rollout.max_retries`,
`pipeline.balance_*`, `rollout.min_instances_per_agent`) and a directly built `RequestRouter` or
`InstanceBalancer` checks too, one function each. A rule returns why a value is wrong, or None.

Pure Python (no JAX import): config validation imports it when a config loads.
"""

from __future__ import annotations


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def max_retries_problem(max_retries: int) -> str | None:
    """Re-queues allowed per request after a timeout or a failed instance."""
    if not _is_int(max_retries):
        return "must be an int >= 0 (re-queues of a timed-out or failed request)"
    if max_retries < 0:
        return "must be >= 0 (re-queues of a timed-out or failed request)"
    return None


def balance_delta_problem(delta: int) -> str | None:
    """The gap between the longest and the shortest agent queue above which instances move."""
    if _is_int(delta) and delta >= 1:
        return None
    return "must be a positive integer (the queue-length gap that triggers a move)"


def balance_cooldown_problem(cooldown_s: float) -> str | None:
    """How long a moved instance stays with its new agent at least."""
    if _is_number(cooldown_s) and cooldown_s >= 0:  # also rejects NaN
        return None
    return "must be >= 0 seconds"


def balance_poll_problem(poll_interval_s: float) -> str | None:
    """Seconds between the balancer's polls of the queue lengths."""
    if _is_number(poll_interval_s) and poll_interval_s > 0:
        return None
    return "must be > 0 seconds"


def min_instances_problem(min_instances_per_agent: int) -> str | None:
    """Instances balancing leaves every agent: at least one, or an agent's requests would have nowhere to go."""
    if _is_int(min_instances_per_agent) and min_instances_per_agent >= 1:
        return None
    return "must be a positive integer (instances balancing leaves every agent)"


def instances_to_keep_problem(min_instances_per_agent: int, instances_per_agent: int, *, where: str = "") -> str | None:
    """Why agents that start with `instances_per_agent` instances (the fewest any agent has) cannot each keep
    `min_instances_per_agent`, or None; `where` prefixes instances_per_agent's name (the config's path to it)."""
    if min_instances_per_agent > instances_per_agent:
        return (f"min_instances_per_agent={min_instances_per_agent} exceeds {where}instances_per_agent="
                f"{instances_per_agent}: an agent cannot keep more instances than it starts with")
    return None
