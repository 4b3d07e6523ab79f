"""The settings of a run's `RequestRouter`, `InstanceHealthMonitor` and `InstanceBalancer`, from its run config:
each function returns its component's keyword arguments, which the component has no defaults for (the config's
are the only ones). Pure Python, like `settings.engine_config_for`.

    router = RequestRouter(instances, **router_settings_for(config), initial_weights=weights)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flexmarl_jax.config import RunConfig


def router_settings_for(config: RunConfig) -> dict[str, Any]:
    """`RequestRouter`'s timeout_s (rollout.request_timeout_s; 0 = None, no timeout) and max_retries."""
    timeout = config.rollout.request_timeout_s
    return {"timeout_s": timeout if timeout > 0 else None, "max_retries": config.rollout.max_retries}


def health_settings_for(config: RunConfig) -> dict[str, Any]:
    """`InstanceHealthMonitor`'s stall_s (rollout.instance_stall_s) and first_step_s: an instance's first step
    compiles (several seconds on a loaded CPU, minutes for a large model), so only the run's own stall bound
    (run.stall_timeout_s) applies to it."""
    return {"stall_s": config.rollout.instance_stall_s, "first_step_s": config.run.stall_timeout_s}


def balancer_settings_for(config: RunConfig) -> dict[str, Any]:
    """`InstanceBalancer`'s delta, cooldown_s, poll_interval_s (pipeline.balance_*) and min_instances_per_agent
    (rollout.min_instances_per_agent). The cooldown and the poll interval are device time: an emulated run
    (`pipeline.emulate`) compresses them by `pipeline.emulate_compression` like every device second, so the
    balancer acts as often per emulated step as it would on the chips."""
    pipeline = config.pipeline
    compression = pipeline.emulate_compression if pipeline.emulate else 1.0
    return {"delta": pipeline.balance_delta, "cooldown_s": pipeline.balance_cooldown_s / compression,
            "poll_interval_s": pipeline.balance_poll_s / compression,
            "min_instances_per_agent": config.rollout.min_instances_per_agent}
