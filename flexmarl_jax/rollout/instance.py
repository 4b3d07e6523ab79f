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

Several LoRA agents on one engine. With `AdaptedParams` (one frozen base and a table of adapters) and
`adapter_agents`, the instance serves every agent of a base group at once: a request names its agent
(`RolloutRequest.agent`) and decodes with that agent's row of the table (`adapter_rows.AdapterRows`).
`update_adapter(agent, adapter, spec, version)` syncs one agent's adapter alone: at the next step boundary it is
written into the agent's spare row, and later requests decode with it. Nothing drains: the agent's sequences
already decoding finish on their old row and version, and the other agents' sequences never stop.

Locks. Two: `_lock` guards the hand-over state (incoming requests, pending weights, the published load figures)
and is only ever held for a few lines; `_step_lock` serialises use of the rollout loop and is held for a
whole engine step. `submit`, `load`, `update_params` and `has_work` take only the first, so a step that hangs
never blocks them; `cancel` waits for the step lock at most `cancel_wait_s` and otherwise reports that it
could not cancel (the router then ignores the late result). Progress (`progress`, a `StepProgress`) is
published without any lock, so a health check can tell a stuck instance from a busy one.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from flexmarl_jax import faults
from flexmarl_jax.models.functional import param_shardings
from flexmarl_jax.models.lora import AdaptedParams, AgentAdapter, LoraSpec
from flexmarl_jax.rollout.adapter_rows import AdapterRows
from flexmarl_jax.rollout.engine import FlexEngine
from flexmarl_jax.rollout.engine_tokenizer import pad_prompt
from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest
from flexmarl_jax.rollout.progress import StepProgress
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
        cancel_wait_s: float = 0.5,
        adapter_agents: tuple[str, ...] = (),
    ):
        self.engine = engine
        self._rows = AdapterRows(adapter_agents) if adapter_agents else None
        if self._rows is not None and (not isinstance(params, AdaptedParams)
                                       or params.adapters != self._rows.table_size):
            raise ValueError(f"{name}: {len(adapter_agents)} adapter agents need AdaptedParams with a table of "
                             f"{2 * len(adapter_agents)} rows (a current and a spare row each)")
        if self._rows is None and isinstance(params, AdaptedParams):
            raise ValueError(f"{name}: AdaptedParams need adapter_agents, the agent of each pair of rows")
        self.name = name
        self.swap_policy = VersionSwapPolicy(swap_policy)
        self._param_shardings = jax.tree.map(lambda x: x.sharding, params)
        self._param_signature = _signature(params)
        # Commit the served params to their devices: swapped-in params are committed too, and
        # jit keys on committedness, so both must match for a swap to reuse the compiled steps.
        params = jax.device_put(params, self._param_shardings)
        self._loop = RolloutLoop(engine, params, policy_version=policy_version, defer_callbacks=True)
        self._cond = threading.Condition(threading.RLock())  # the hand-over state (module docstring, "Locks")
        self._step_lock = threading.RLock()  # the loop: held for a whole step
        self.cancel_wait_s = cancel_wait_s
        self.progress = StepProgress()
        self._incoming: list[RolloutRequest] = []
        self._admitting: list[RolloutRequest] = []  # taken from _incoming by the running step, still counted
        self._submitted = 0  # how many of _admitting the running step has put in the loop
        self._loop_load = self._read_loop_load()  # the loop's figures as of the last step boundary
        self._policy_version = policy_version
        self._pending_params: tuple[Any, int] | None = None
        self._pending_adapters: dict[str, tuple[Any, LoraSpec, int]] = {}  # agent -> its next adapter version
        self.adapter_versions: dict[str, int] = {}  # agent -> the version its new requests get (once synced)
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
        """Builds the engine on `mesh` and places `params` there (sharded by the model's rules; an adapter
        table of `AdaptedParams` replicated)."""
        if isinstance(params, AdaptedParams):
            base = jax.device_put(params.base, param_shardings(params.base, mesh))
            params = AdaptedParams(base, jax.device_put(params.table, NamedSharding(mesh, PartitionSpec())))
        else:
            base = params = jax.device_put(params, param_shardings(params, mesh))
        # The instance serves its own params and swaps them on every sync; an engine that kept these for
        # `load_params` would hold a dead copy of the whole model from the first sync on.
        engine = FlexEngine(model_config, graphdef, engine_config, tokenizer, mesh=mesh,
                            cache_dtype=jax.tree.leaves(base)[0].dtype)
        return cls(engine, params, **kwargs)

    # ------------------------------------------------------------------ requests
    def check_request(self, request: RolloutRequest) -> None:
        """Raises ValueError for a prompt this engine can never take (empty, too long)."""
        pad_prompt(request.prompt_ids, self.engine.config, self.engine.tokenizer.pad_id)

    def submit(self, request: RolloutRequest) -> None:
        """Queues a request. Prompt errors (empty, too long) raise here, in the caller's thread, and so does
        an agent this instance has no adapter for, where it serves several."""
        self.check_request(request)
        if self._rows is not None:
            self._rows.current(request.agent)  # an unknown agent raises
        with self._cond:
            if self._error is not None:
                raise RuntimeError(f"{self.name} failed earlier: {self._error!r}")
            self._incoming.append(request)
            self._cond.notify_all()

    def cancel(self, request: RolloutRequest) -> bool:
        """Withdraws a request submitted here (same object); its callbacks never run. Its slots are
        free for the next step. Returns False when it already finished or was never here, or when the
        running step did not end within `cancel_wait_s` (a stuck step must not hang the caller)."""
        with self._cond:
            for index, queued in enumerate(self._incoming):
                if queued is request:
                    del self._incoming[index]
                    return True
        if not self._step_lock.acquire(timeout=self.cancel_wait_s):
            return False
        try:
            cancelled = self._loop.cancel(request)
            loop_load = self._read_loop_load()
            with self._cond:
                self._loop_load = loop_load
            return cancelled
        finally:
            self._step_lock.release()

    def _read_loop_load(self) -> tuple[int, int, int, bool]:
        """(queued requests, active slots, outstanding tokens, has work) of the loop; call between steps."""
        loop = self._loop
        return loop.queued_requests, loop.active_slots, loop.outstanding_tokens, loop.has_work()

    def load(self) -> InstanceLoad:
        """The load as of the last step boundary plus the requests handed in since (never waits for a step)."""
        with self._cond:
            queued, active, outstanding, _ = self._loop_load
            waiting = self._incoming + self._admitting
            incoming_tokens = sum(r.num_samples * r.max_new_tokens for r in waiting)
            return InstanceLoad(
                queued_requests=queued + len(waiting),
                active_slots=active,
                outstanding_tokens=outstanding + incoming_tokens,
                free_slots=self.engine.max_concurrent_decodes - active,
            )

    @property
    def capacity(self) -> int:
        """Samples decoded at once: the engine's decode slots."""
        return self.engine.max_concurrent_decodes

    @property
    def architecture(self) -> tuple:
        """The model, engine config and tokenizer: an instance can serve another agent only if they match (its
        weights must fit the model, and that agent's prompts are tokenised with that agent's tokenizer)."""
        return (repr(self.engine.model_config), repr(self.engine.config), tokenizer_identity(self.engine.tokenizer),
                self.adapter_agents)  # an instance of a base group serves its group's table, not another model

    @property
    def adapter_agents(self) -> tuple[str, ...]:
        """The LoRA agents this instance serves from its adapter table (none for a plain model)."""
        return () if self._rows is None else self._rows.agents

    @property
    def policy_version(self) -> int:
        return self._policy_version  # published at step boundaries (the loop's own is the step thread's)

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
        on this instance's shardings (a transfer, never a recompile). An instance with an adapter table for a
        single agent takes that agent's `AgentAdapter` here (`update_agent_params` for one of several).
        """
        if isinstance(params, AgentAdapter):
            if self._rows is None or len(self._rows.agents) != 1:
                raise ValueError(f"{self.name}: an AgentAdapter needs its agent named (update_agent_params) on an "
                                 f"instance serving adapter agents {list(self.adapter_agents)}")
            return self.update_agent_params(self._rows.agents[0], params, version)
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

    def wait_for_weights(self) -> None:
        """Blocks until the last `update_params`'s transfer has landed on this instance's devices."""
        with self._cond:
            pending = self._pending_params
        if pending is not None:
            jax.block_until_ready(pending[0])

    def update_agent_params(self, agent: str, params: AgentAdapter, version: int) -> None:
        """A router's weight sync for `agent`, one of the agents this instance serves from its adapter table:
        `params` is the agent's `AgentAdapter` (a LoRA agent's sync sends its adapter only)."""
        if not isinstance(params, AgentAdapter):
            raise ValueError(f"{self.name} serves {agent!r} from an adapter table: its weight sync sends an "
                             f"AgentAdapter, not {type(params).__name__}")
        self.update_adapter(agent, params.adapter, params.spec, version)

    def update_adapter(self, agent: str, adapter: Any, spec: LoraSpec, version: int) -> None:
        """Schedules `agent`'s new adapter for the next step boundary (see the module docstring): only its
        bytes move, and neither the instance nor the other agents' sequences stop. Its rank must fit the table."""
        if self._rows is None:
            raise ValueError(f"{self.name} serves no adapter table; sync the whole params with update_params")
        self._rows.current(agent)  # an unknown agent raises
        with self._cond:
            self._pending_adapters[agent] = (adapter, spec, int(version))
            self._cond.notify_all()

    # ------------------------------------------------------------------ driving
    def has_work(self) -> bool:
        with self._cond:
            return (bool(self._incoming) or bool(self._admitting) or self._loop_load[3]
                    or self._pending_params is not None or bool(self._pending_adapters))

    def step(self) -> None:
        """One admission + generate + bookkeeping round (applies a pending weight swap when legal).

        Finished requests' callbacks run after both locks are released, so they may submit follow-up
        requests to any instance without lock-order deadlocks.
        """
        with self._step_lock:
            with self._cond:
                self._admitting, self._incoming = self._incoming, []
            self.progress.begin()
            self._submitted = 0
            try:
                self._maybe_swap_adapters()  # before admission: the new requests get the new versions
                for request in self._admitting:
                    self._loop.submit(request, 0 if self._rows is None else self._rows.current(request.agent))
                    self._submitted += 1
                self._maybe_swap()
                slow_since = self._injected_faults()
                self._loop.step()
                if slow_since is not None:  # instance_slow: this step takes SLOWDOWN times as long
                    time.sleep((faults.SLOWDOWN - 1) * (time.perf_counter() - slow_since))
                self._maybe_swap()
                self._maybe_swap_adapters()
                deliveries = self._loop.take_deliveries()
            except BaseException as error:
                self._fail(error)
                raise
            loop_load = self._read_loop_load()
            with self._cond:  # the admitted requests now count in the loop's figures instead
                self._admitting, self._loop_load = [], loop_load
                self._policy_version = self._loop.policy_version
            self.progress.end()
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

    def request_stop(self) -> None:
        """Asks the thread to end after its current step (returns at once; `stop` also waits)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def stop(self, timeout: float | None = 30.0) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("%s: its thread did not end within %s s (a step that never returns); left behind",
                               self.name, timeout)
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
    def _injected_faults(self) -> float | None:
        """The instance faults (flexmarl_jax/faults.py; a dict check when none is armed): crash raises, hang
        blocks until the fault is disarmed; returns the step's start time when it is to be slow, else None."""
        faults.raise_if_fired("instance_crash", self.name)
        if faults.fire("instance_hang", self.name):
            faults.hang_release.wait()
        return time.perf_counter() if faults.fire("instance_slow", self.name) else None

    def _maybe_swap(self) -> None:
        with self._cond:
            pending = self._pending_params
        if pending is None:
            return
        loop = self._loop
        if self.swap_policy is VersionSwapPolicy.REQUEUE:
            requeued = loop.abort_active()
            if requeued:
                logger.info("%s: re-queued %d sequences for the new weights", self.name, requeued)
        elif loop.is_decoding():
            loop.admission_open = False  # drain: finish in-flight sequences under the old weights
            return
        params, version = pending
        loop.set_params(params, version)
        loop.admission_open = True
        with self._cond:
            if self._pending_params is pending:  # a newer sync that landed meanwhile applies next
                self._pending_params = None
        self.swaps += 1

    def _maybe_swap_adapters(self) -> None:
        """Writes each pending adapter into its agent's spare row and makes that row current; one whose spare
        row sequences of two versions ago still decode with waits for them."""
        with self._cond:
            pending = dict(self._pending_adapters)
        for agent, update in pending.items():
            spare = self._rows.spare(agent)
            if self._loop.sequences_on(spare):
                continue
            adapter, spec, version = update
            self._loop.set_adapter(spare, adapter, spec, version)
            self._rows.promote(agent)
            with self._cond:
                if self._pending_adapters.get(agent) is update:  # a newer one that landed meanwhile applies next
                    del self._pending_adapters[agent]
                self.adapter_versions[agent] = version
            self.swaps += 1

    def _fail(self, error: BaseException) -> None:
        """Under the step lock: every request here gets `error`, and the instance takes no more."""
        with self._cond:
            self._error = error
            stranded = self._incoming + self._admitting[self._submitted:]  # not in the loop yet
            self._incoming, self._admitting = [], []
            self._loop_load = (0, 0, 0, False)
        callbacks = [r.on_error for r in stranded] + self._loop.pending_error_callbacks()
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
