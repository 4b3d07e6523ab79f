"""The agents an OpenAI-compatible server answers for, and one request's generation on an agent's engine.

Each agent is one `EngineInstance` (continuous batching on its own thread). A request becomes one
`RolloutRequest` per prompt with `num_samples = n`; the engine thread reports every step's tokens
(`on_tokens`) and the end (`on_done`, `on_error`), and `Generation` hands them to the asyncio loop with
`call_soon_threadsafe`, so the loop never waits on an engine lock. Withdrawing a request (a client that went
away, a shutdown) runs `EngineInstance.cancel` on a worker thread without awaiting it: cancel may wait up to
`cancel_wait_s` for a running step, and the loop must keep serving meanwhile.

    models = ServedModels({"solver": ServedModel("solver", 3, instance, tokenizer)})
    generation = models.start(settings, [prompt_ids], asyncio.get_running_loop())
    async for event in generation.events(): ...
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any

from flexmarl_jax.rollout.engine import SlotSampling
from flexmarl_jax.rollout.instance import EngineInstance
from flexmarl_jax.rollout.loop import RolloutRequest, TokenEvent
from flexmarl_jax.serve.openai_requests import APIError, GenerationSettings, bad


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """One agent: its name (the OpenAI model id), policy version, engine instance and tokenizer."""

    name: str
    policy_version: int
    instance: EngineInstance
    tokenizer: Any

    @property
    def max_prompt_tokens(self) -> int:
        return self.instance.engine.config.max_prefill_length

    @property
    def max_tokens(self) -> int:
        return self.instance.engine.config.max_decode_length

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset(getattr(self.tokenizer, "stop_ids", None) or (self.tokenizer.eos_id,))

    @property
    def has_chat_template(self) -> bool:
        return getattr(self.tokenizer, "chat_template", None) is not None


@dataclasses.dataclass(frozen=True)
class Tokens:
    """A step's tokens of one prompt's samples (`event.sample_index`)."""

    prompt: int
    event: TokenEvent


@dataclasses.dataclass(frozen=True)
class PromptDone:
    prompt: int


class ShutDown(Exception):
    """The server is stopping: the generation ends without its remaining tokens."""


class Generation:
    """One request's prompts decoding on one agent; `events()` yields `Tokens` and `PromptDone` in order."""

    def __init__(self, model: ServedModel, requests: Sequence[RolloutRequest], queue: asyncio.Queue,
                 loop: asyncio.AbstractEventLoop, registry: set):
        self.model, self._requests, self._queue, self._loop = model, list(requests), queue, loop
        self._registry = registry
        self._open = len(self._requests)
        self.finished = False

    async def events(self) -> AsyncIterator[Tokens | PromptDone]:
        try:
            while self._open:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, PromptDone):
                    self._open -= 1
                yield item
            self.finished = True
        finally:
            self.close()

    def close(self) -> None:
        """Frees the decode slots of whatever has not finished (at once: the cancel runs on a worker thread)."""
        self._registry.discard(self)
        if self.finished:
            return
        self.finished = True
        for request in self._requests:
            self._loop.run_in_executor(None, self.model.instance.cancel, request)

    def shut_down(self) -> None:
        """Ends `events()` with ShutDown (called on the loop's thread)."""
        self._queue.put_nowait(ShutDown("the server is shutting down"))


class ServedModels:
    """The agents by name, and every generation in flight (so a shutdown can end them)."""

    def __init__(self, models: dict[str, ServedModel]):
        self.models = dict(models)
        self._live: set[Generation] = set()

    def get(self, name: str) -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise APIError(404, f"The model '{name}' does not exist; this server has: {', '.join(self.models)}",
                           param="model", code="model_not_found")
        return model

    def start(self, model: ServedModel, settings: GenerationSettings, prompts: Sequence[Sequence[int]],
              max_tokens: int, loop: asyncio.AbstractEventLoop) -> Generation:
        """Submits every prompt with `settings.n` samples; prompts must already fit the engine."""
        queue: asyncio.Queue = asyncio.Queue()

        def hand_over(item: Any) -> None:  # engine thread -> loop thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop closed: the server is gone, nobody listens
                pass

        sampling = SlotSampling(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                                seed=settings.seed)
        requests = [RolloutRequest(
            tuple(ids), num_samples=settings.n, sampling=sampling, max_new_tokens=max_tokens,
            stop_strings=settings.stop, ignore_eos=settings.ignore_eos, agent=model.name,
            on_tokens=lambda event, index=index: hand_over(Tokens(index, event)),
            on_done=lambda results, index=index: hand_over(PromptDone(index)),
            on_error=hand_over) for index, ids in enumerate(prompts)]
        generation = Generation(model, requests, queue, loop, self._live)
        self._live.add(generation)
        try:
            for request in requests:
                model.instance.submit(request)
        except (ValueError, RuntimeError) as error:
            generation.close()
            raise bad("prompt", str(error)) if isinstance(error, ValueError) else APIError(500, str(error)) from None
        return generation

    def shut_down(self) -> None:
        for generation in list(self._live):
            generation.shut_down()

    def stop(self) -> None:
        for model in self.models.values():
            model.instance.request_stop()
