"""`EngineBackend`: the workflows' `GenerationBackend` served by engine instances.

`submit` tokenises the prompt with the request's agent's tokenizer (a `ChatPrompt` is first rendered with
that tokenizer's chat template), picks the instance of the request's agent with the
least outstanding work (`routed_backend.RoutedBackend` sends it through a RequestRouter instead),
enqueues one `RolloutRequest` (all samples share one prefill) and returns a future that
resolves with one `Completion` per sample, in sample order.
"""

from __future__ import annotations

import concurrent.futures
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from flexmarl_jax.rollout.engine import SlotSampling
from flexmarl_jax.rollout.instance import EngineInstance
from flexmarl_jax.rollout.loop import RolloutRequest, SequenceResult
from flexmarl_jax.workflows.generation import ChatPrompt, Completion, GenerationRequest, PromptTooLong


class EngineBackend:
    """GenerationBackend over `instances[agent]` (each agent's engine instances).

    Args:
      instances: agent name -> its EngineInstances (at least one each).
      tokenizers: agent name -> its Tokenizer, or one Tokenizer for every agent; plain prompts get a BOS
        when the tokenizer has one, chat prompts whatever the agent's chat template writes.
      start: start every instance's thread now (and stop them in `close()`); with False the
        caller drives the instances with `step()`.
    """

    def __init__(self, instances: Mapping[str, Sequence[EngineInstance]], tokenizers: Any, *, start: bool = True):
        for agent, agent_instances in instances.items():
            if not agent_instances:
                raise ValueError(f"agent {agent!r} has no engine instance; every agent needs at least one")
        self.instances = {agent: list(agent_instances) for agent, agent_instances in instances.items()}
        if not isinstance(tokenizers, Mapping):
            tokenizers = {agent: tokenizers for agent in self.instances}
        missing = sorted(set(self.instances) - set(tokenizers))
        if missing:
            raise ValueError(f"agents {missing} have instances but no tokenizer")
        self.tokenizers = dict(tokenizers)
        self._started = start
        if start:
            for agent_instances in self.instances.values():
                for instance in agent_instances:
                    instance.start()

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[list[Completion]]:
        """Raises ValueError at once for an unknown agent, an empty or too long prompt, or bad sampling."""
        if request.agent not in self.instances:
            raise ValueError(f"request {request.request_id!r}: unknown agent {request.agent!r}; "
                             f"served agents: {sorted(self.instances)}")
        if not request.prompt:
            raise ValueError(f"request {request.request_id!r}: empty prompt")
        sampling = request.sampling
        # A request without a seed still gets a reproducible one, derived from its id.
        seed = sampling.seed if sampling.seed is not None else zlib.crc32(request.request_id.encode())
        future: concurrent.futures.Future[list[Completion]] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        tokenizer = self.tokenizers[request.agent]
        prompt_ids = tuple(encode_prompt(tokenizer, request.prompt, request.request_id))
        limit = self.max_prompt_length(request.agent)
        if limit is not None and len(prompt_ids) > limit:
            raise PromptTooLong(f"request {request.request_id!r}: the prompt has {len(prompt_ids)} tokens, more than "
                                f"rollout.max_prompt_length={limit}")

        def on_done(results: list[SequenceResult]) -> None:
            future.set_result([self._completion(r, tokenizer) for r in results])

        rollout_request = RolloutRequest(
            prompt_ids=prompt_ids,
            num_samples=request.num_samples,
            sampling=SlotSampling(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                  seed=seed),
            max_new_tokens=sampling.max_new_tokens,
            stop_strings=tuple(sampling.stop),
            stop_pattern=sampling.stop_pattern,
            on_done=on_done,
            on_error=future.set_exception,
            agent=request.agent,  # an instance serving several LoRA agents decodes it with this agent's adapter
        )
        self._send(request.agent, rollout_request, request.request_id)
        return future

    def _send(self, agent: str, request: RolloutRequest, request_id: str) -> None:
        """Hands a request to an instance of `agent` (its on_done/on_error resolve the caller's future)."""
        self.pick_instance(agent).submit(request)

    def pick_instance(self, agent: str) -> EngineInstance:
        """Least outstanding tokens first, then fewest queued requests."""
        def key(instance: EngineInstance):
            load = instance.load()
            return (load.outstanding_tokens, load.queued_requests)

        return min(self.instances[agent], key=key)

    def max_prompt_length(self, agent: str) -> int | None:
        """The longest prompt, in tokens, `agent`'s engines take (None when they keep the tail of longer ones)."""
        configs = [instance.engine.config for instance in self.instances[agent]]
        if any(config.truncate_long_prompts for config in configs):
            return None
        return min(config.max_prefill_length for config in configs)

    def decode_tokens(self, agent: str, token_ids: Sequence[int]) -> str:
        """Text of `token_ids` in `agent`'s tokenizer (the workflow cuts quoted responses with it)."""
        return self.tokenizers[agent].decode(token_ids)

    def update_params(self, agent: str, params: Any, version: int) -> None:
        """Hands new weights to every instance of `agent` (applied at each one's next step boundary)."""
        for instance in self.instances[agent]:
            instance.update_params(params, version)

    def close(self, timeout_s: float = 30.0, *, abandon: Sequence[Any] = ()) -> None:
        """Stops every instance's thread: all are asked at once, then joined within one shared `timeout_s` (an
        instance whose step never returns is left behind rather than holding up the others). Instances in
        `abandon` (known to be stuck) are asked, never waited for: the run's exit is not delayed by them."""
        if self._started:
            every = [instance for agent_instances in self.instances.values() for instance in agent_instances]
            for instance in every:
                instance.request_stop()
            deadline = time.monotonic() + timeout_s
            for instance in every:
                if not any(instance is stuck for stuck in abandon):
                    instance.stop(timeout=max(0.1, deadline - time.monotonic()))
            self._started = False

    def __enter__(self) -> EngineBackend:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @staticmethod
    def _completion(result: SequenceResult, tokenizer: Any) -> Completion:
        return Completion(
            text=tokenizer.decode(result.token_ids),
            prompt_token_ids=result.prompt_ids,
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            finish_reason=result.finish_reason,
            policy_version=result.policy_version,
        )


def encode_prompt(tokenizer: Any, prompt: str | ChatPrompt, request_id: str = "") -> list[int]:
    """Token ids of a plain prompt (BOS first when the tokenizer has one) or of a `ChatPrompt` rendered with the
    tokenizer's chat template (which writes its own BOS, if any). ValueError for a chat prompt to a tokenizer
    without a chat template."""
    if not isinstance(prompt, ChatPrompt):
        return tokenizer.encode(prompt, add_bos=True)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"request {request_id!r}: a chat prompt needs a tokenizer with a chat template; "
                         f"{type(tokenizer).__name__} has none (use plain prompts: workflow.options.chat=False)")
    return tokenizer.encode(tokenizer.render_chat(prompt.messages, add_generation_prompt=True), add_bos=False)
