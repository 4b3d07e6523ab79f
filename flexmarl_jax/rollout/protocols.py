"""`RoutableInstance`: what the RequestRouter (router.py) needs from an engine instance.

The router used to probe instances with getattr/hasattr (a capacity here, an engine there, a cancel hook
if present); spelling the interface out as a Protocol makes every instance type state what it supports,
so a missing member is an AttributeError at the call site rather than a silently different code path.
`EngineInstance` (instance.py) is the real implementation; the tests' fakes implement it too.

Threading contract: the router never calls these methods while holding its own lock, and an instance may
call a request's `on_done` / `on_error` from any thread, at most one of them, once.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

from flexmarl_jax.rollout.loop import RolloutRequest
from flexmarl_jax.rollout.progress import StepProgress


class RoutableInstance(Protocol):
    """An engine instance the router can dispatch to, cancel on, re-weight and move between agents."""

    @property
    def name(self) -> str:
        """Unique among the router's instances; used in logs, errors and `migrate`."""
        ...

    @property
    def capacity(self) -> int:
        """Samples it decodes at once (>= 1); the router dispatches no more than this (an idle instance
        takes one request of any size)."""
        ...

    @property
    def architecture(self) -> Hashable:
        """Equal for instances that can serve each other's weights; migrations across different ones
        are refused."""
        ...

    @property
    def progress(self) -> StepProgress:
        """Its engine steps so far, readable without any lock of the instance (the router's health check reads
        it while a step may hang)."""
        ...

    def check_request(self, request: RolloutRequest) -> None:
        """Raises ValueError for a request it can never serve (e.g. an empty or too long prompt); called by
        `RequestRouter.submit` so the error reaches the caller's thread. A no-op where anything goes."""
        ...

    def submit(self, request: RolloutRequest) -> None:
        """Starts serving `request`; its results go to `request.on_done`, a failure to `request.on_error`.
        A ValueError raised here means the request itself is bad (the router fails it without retrying);
        any other exception marks the instance broken."""
        ...

    def update_params(self, params: Any, version: int) -> None:
        """Serve these weights (policy `version`) from its next step boundary on."""
        ...

    def wait_for_weights(self) -> None:
        """Returns once the weights of its last `update_params` are on its devices (their transfer done): a
        moved instance's move lasts until then (`RequestRouter.stats["migration_s"]`)."""
        ...

    def update_agent_params(self, agent: str, params: Any, version: int) -> None:
        """Serve these weights for `agent`, one of several agents it serves at once (a LoRA base group's
        engine: `params` is the agent's `AgentAdapter`). Only called on an instance listed under several agents."""
        ...

    def cancel(self, request: RolloutRequest) -> bool:
        """Withdraws a submitted request (the same object) so that its callbacks never run and its slots
        free up. Returns False when it cannot: already finished, unknown, or cancelling unsupported, in
        which case the router ignores the late result and counts the slots as busy until it comes."""
        ...
