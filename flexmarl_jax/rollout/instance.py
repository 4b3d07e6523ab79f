"""`EngineInstance`: one engine on its own (sub-)mesh with a request queue, load figures and
weight hot-swap. It implements `protocols.RoutableInstance`, so a RequestRouter can serve it.

Driving it. An instance can run its continuous-batching loop on its own thread
(`start()` / `stop()`), or the caller can drive it with `step()`. Threads are the
default for serving several instances at once: JAX releases the GIL while a step
computes, so instances on one CPU (or on different devices) overlap their work and
their host bookkeeping, and a slow instance never stalls a fast one. `step()` is for
tests and for callers that want a deterministic interleaving.

Weight hot-swap. `update_params(params, version)` only records the new weights; they
are applied at the next step boundary, so a compiled step never sees half-updated
weights, and because the new params have the same structure, shapes, dtypes and
shardings (they are placed on this instance's shardings), nothing recompiles. What
happens to sequences in flight is `swap_policy` (settings.VersionSwapPolicy):
DRAIN finishes them under the old weights (their results carry the old
`policy_version`) before swapping; REQUEUE aborts them and restarts them from the
prompt under the new weights. Either way no sequence mixes versions.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import jax

from flexmarl_jax.rollout.engine import FlexEngine, pad_prompt
from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest
from flexmarl_jax.rollout.settings import EngineConfig, VersionSwapPolicy

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class InstanceLoad:
    """What a router needs to pick an instance: queued requests (not yet fully in slots),
    busy decode slots, and an upper bound of tokens still to generate."""

    queued_requests: int
    active_slots: int
    outstanding_tokens: int
    free_slots: int


class EngineInstance:
    """A FlexEngine plus its params, policy version, request queue and (optional) thread."""

    def __init__(
        self,
        engine: FlexEngine,
        params: Any,
        *,
        policy_version: int = 0,
        swap_policy: VersionSwapPolicy | str = VersionSwapPolicy.DRAIN,
        name: str = "instance",
    ):
        self.engine = engine
        self.name = name
        self.swap_policy = VersionSwapPolicy(swap_policy)
        self._param_shardings = jax.tree.map(lambda x: x.sharding, params)
        self._param_signature = _signature(params)
        # Commit the served params to their devices: swapped-in params are committed too, and
        # jit keys on committedness, so both must match for a swap to reuse the compiled steps.
        params = jax.device_put(params, self._param_shardings)
        self._loop = RolloutLoop(engine, params, policy_version=policy_version, defer_callbacks=True)
        self._cond = threading.Condition(threading.RLock())
        self._incoming: list[RolloutRequest] = []
        self._pending_params: tuple[Any, int] | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self.swaps = 0

    @classmethod
    def create(
        cls,
        model_config: Any,
        graphdef: Any,
        params: Any,
        engine_config: EngineConfig,
        tokenizer: Any,
        *,
        mesh: jax.sharding.Mesh,
        **kwargs: Any,
    ) -> EngineInstance:
        """Builds the engine on `mesh` and places `params` there (sharded by the model's rules)."""
        from flexmarl_jax.models.functional import param_shardings

        params = jax.device_put(params, param_shardings(params, mesh))
        engine = FlexEngine(model_config, graphdef, engine_config, tokenizer, mesh=mesh, params=params)
        return cls(engine, params, **kwargs)

    # ------------------------------------------------------------------ requests
    def check_request(self, request: RolloutRequest) -> None:
        """Raises ValueError for a prompt this engine can never take (empty, too long)."""
        pad_prompt(request.prompt_ids, self.engine.config, self.engine.tokenizer.pad_id)

    def submit(self, request: RolloutRequest) -> None:
        """Queues a request. Prompt errors (empty, too long) raise here, in the caller's thread."""
        self.check_request(request)
        with self._cond:
            if self._error is not None:
                raise RuntimeError(f"{self.name} failed earlier: {self._error!r}")
            self._incoming.append(request)
            self._cond.notify_all()

    def cancel(self, request: RolloutRequest) -> bool:
        """Withdraws a request submitted here (same object); its callbacks never run. Its slots are
        free for the next step. Returns False when it already finished or was never here."""
        with self._cond:
            for index, queued in enumerate(self._incoming):
                if queued is request:
                    del self._incoming[index]
                    return True
            return self._loop.cancel(request)

    def load(self) -> InstanceLoad:
        with self._cond:
            loop = self._loop
            incoming_tokens = sum(r.num_samples * r.max_new_tokens for r in self._incoming)
            active = loop.active_slots
            return InstanceLoad(
                queued_requests=loop.queued_requests + len(self._incoming),
                active_slots=active,
                outstanding_tokens=loop.outstanding_tokens + incoming_tokens,
                free_slots=self.engine.max_concurrent_decodes - active,
            )

    @property
    def capacity(self) -> int:
        """Samples decoded at once: the engine's decode slots."""
        return self.engine.max_concurrent_decodes

    @property
    def architecture(self) -> tuple[str, str, str]:
        """The model, engine config and tokenizer: an instance can serve another agent only if they match (its
        weights must fit the model, and that agent's prompts are tokenised with that agent's tokenizer)."""
        return (repr(self.engine.model_config), repr(self.engine.config), tokenizer_identity(self.engine.tokenizer))

    @property
    def policy_version(self) -> int:
        return self._loop.policy_version

    @property
    def generated_tokens(self) -> int:
        return self._loop.generated_tokens

    @property
    def decode_steps(self) -> int:
        """Generate steps run so far."""
        return self._loop.steps

    # ------------------------------------------------------------------ weights
    def update_params(self, params: Any, version: int) -> None:
        """Schedules new weights for the next step boundary (see the module docstring).

        `params` must match the current params' structure, shapes and dtypes; they are placed
        on this instance's shardings (a transfer, never a recompile).
        """
        signature = _signature(params)
        if signature != self._param_signature:
            raise ValueError(
                f"{self.name}: new params differ in structure/shape/dtype from the served ones; "
                "a hot-swap needs the same model"
            )
        params = jax.device_put(params, self._param_shardings)
        with self._cond:
            self._pending_params = (params, int(version))
            self._cond.notify_all()

    # ------------------------------------------------------------------ driving
    def has_work(self) -> bool:
        with self._cond:
            return bool(self._incoming) or self._loop.has_work() or self._pending_params is not None

    def step(self) -> None:
        """One admission + generate + bookkeeping round (applies a pending weight swap when legal).

        Finished requests' callbacks run after the instance lock is released, so they may submit
        follow-up requests to any instance without lock-order deadlocks.
        """
        with self._cond:
            try:
                for request in self._incoming:
                    self._loop.submit(request)
                self._incoming.clear()
                self._maybe_swap()
                self._loop.step()
                self._maybe_swap()
                deliveries = self._loop.take_deliveries()
            except BaseException as error:
                self._fail(error)
                raise
        for on_done, results in deliveries:
            on_done(results)

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise RuntimeError(f"{self.name} still busy after {max_steps} steps")

    def start(self) -> None:
        """Runs the loop on a daemon thread until `stop()`."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"rollout-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self.has_work():
                    self._cond.wait(timeout=0.5)
                if self._stopping:
                    return
            try:
                self.step()
            except BaseException:  # already delivered to the requests by _fail
                logger.exception("%s: rollout step failed; instance stopped", self.name)
                return

    # ------------------------------------------------------------------ internals
    def _maybe_swap(self) -> None:
        if self._pending_params is None:
            return
        loop = self._loop
        if self.swap_policy is VersionSwapPolicy.REQUEUE:
            requeued = loop.abort_active()
            if requeued:
                logger.info("%s: re-queued %d sequences for the new weights", self.name, requeued)
        elif loop.is_decoding():
            loop.admission_open = False  # drain: finish in-flight sequences under the old weights
            return
        params, version = self._pending_params
        loop.set_params(params, version)
        loop.admission_open = True
        self._pending_params = None
        self.swaps += 1

    def _fail(self, error: BaseException) -> None:
        self._error = error
        callbacks = [r.on_error for r in self._incoming] + self._loop.pending_error_callbacks()
        self._incoming.clear()
        for callback in callbacks:
            if callback is not None:
                callback(error)


def _signature(params: Any):
    leaves, treedef = jax.tree.flatten(params)
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


def tokenizer_identity(tokenizer: Any) -> str:
    """What makes two tokenizers interchangeable: their vocabulary and special ids (an HF tokenizer's whole
    definition when it has one)."""
    identity = getattr(tokenizer, "identity", None)
    if identity is not None:
        return identity
    return repr((type(tokenizer).__name__, tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id))
