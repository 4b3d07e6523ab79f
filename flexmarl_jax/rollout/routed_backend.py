"""`RoutedBackend`: the workflows' GenerationBackend over a RequestRouter (router.py).

It is `EngineBackend` (backend.py) with the sending step swapped: a request goes into its agent's queue in
the router rather than straight to the least-loaded instance, so the router's admission control, timeouts,
retries and migrations apply. Besides the instances it starts and stops the services that steer the
router (the InstanceBalancer, which also checks its timeouts), so that one `close()` ends the rollout side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flexmarl_jax.rollout.backend import EngineBackend
from flexmarl_jax.rollout.loop import RolloutRequest
from flexmarl_jax.rollout.router import RequestRouter
from flexmarl_jax.rollout.routing_state import BROKEN


class RoutedBackend(EngineBackend):
    """The workflows' GenerationBackend over a RequestRouter (same protocol and results as EngineBackend).

    Args:
      router: routes every agent's requests over its instances.
      tokenizers: agent -> its Tokenizer, or one for every agent (as EngineBackend).
      start: start every instance's thread (and stop them in `close()`).
      services: objects with `start()`/`stop()` run alongside (the balancer, the timeout monitor); started
        now when `start`, stopped first in `close()`.
    """

    def __init__(self, router: RequestRouter, tokenizers: Any, *, start: bool = True,
                 services: Sequence[Any] = ()):
        instances = {agent: router.instances_of(agent, include_incoming=True) for agent in router.agents}
        super().__init__(instances, tokenizers, start=start)
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
        """Stops the services, then the instances; one the router took out of routing (a step that raised or
        never returned) is not waited for: a hung step would hold the run's exit for the whole join timeout."""
        for service in self.services:
            service.stop()
        super().close(abandon=[member.instance for member in self.router.members() if member.state == BROKEN])
