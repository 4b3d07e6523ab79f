"""The OpenAI-compatible HTTP API over a run's agents, as a Starlette app.

    GET  /v1/models              every agent, by name, with its policy version
    POST /v1/chat/completions    messages rendered with that agent's own chat template
    POST /v1/completions         text or token-id prompts
    GET  /health                 per agent: busy decode slots and queued requests

Answers are OpenAI's objects, streamed as server-sent events (`data: {chunk}` ... `data: [DONE]`) when the
request says `stream`. A client that goes away frees its decode slots at once: a stream's generator is closed
by the server when a send fails, and a non-streamed answer watches for the disconnect while it waits. Errors are
OpenAI error objects (`openai_requests.APIError`), and the server keeps serving. With an API key every `/v1`
request needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from flexmarl_jax.serve.openai_choices import Choice, ChoiceUpdate, chat_logprobs, completion_logprobs
from flexmarl_jax.serve.openai_models import Generation, ServedModel, ServedModels, ShutDown, Tokens
from flexmarl_jax.serve.openai_requests import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    APIError,
    GenerationSettings,
    bad,
    parse_chat,
    parse_completion,
)


def build_app(models: ServedModels, *, api_key: str | None = None) -> Starlette:
    """The app; `models.shut_down()` ends every stream in flight (the server calls it on SIGTERM)."""
    api = OpenAIEndpoints(models, api_key)
    return Starlette(routes=[
        Route("/v1/models", api.list_models, methods=["GET"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/health", api.health, methods=["GET"]),
    ])


def error_response(error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class OpenAIEndpoints:
    def __init__(self, models: ServedModels, api_key: str | None):
        self.models, self.api_key = models, api_key
        self.created = int(time.time())

    # ------------------------------------------------------------------ endpoints
    async def list_models(self, request: Request) -> Response:
        return await self._answer(request, self._models)

    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(request, self._chat)

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, self._completion)

    async def health(self, request: Request) -> Response:
        figures = {}
        for name, model in self.models.models.items():
            load = model.instance.load()
            figures[name] = {"active_slots": load.active_slots, "queued_requests": load.queued_requests,
                             "slots": model.instance.capacity, "policy_version": model.policy_version}
        return JSONResponse({"status": "ok", "models": figures})

    async def _answer(self, request: Request, handler) -> Response:
        try:
            self._authorize(request)
            return await handler(request)
        except APIError as error:
            return error_response(error)

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), self.api_key):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "flexmarl",
             "policy_version": model.policy_version} for name, model in self.models.models.items()]})

    async def _chat(self, request: Request) -> Response:
        parsed = parse_chat(await _json(request))
        model = self.models.get(parsed.settings.model)
        if not model.has_chat_template:
            raise bad("model", f"'{model.name}' has no chat template; use /v1/completions")
        rendered = model.tokenizer.render_chat([dict(m) for m in parsed.messages], add_generation_prompt=True)
        prompt = model.tokenizer.encode(rendered, add_bos=False)  # the template writes any BOS itself
        return await self._generate(request, model, parsed.settings, [prompt], chat=True,
                                    default_max_tokens=model.max_tokens, prompt_field="messages")

    async def _completion(self, request: Request) -> Response:
        parsed = parse_completion(await _json(request))
        model = self.models.get(parsed.settings.model)
        vocabulary = getattr(model.tokenizer, "vocab_size", None)
        prompts = []
        for prompt in parsed.prompts:
            if isinstance(prompt, str):
                prompts.append(model.tokenizer.encode(prompt, add_bos=True))
            else:
                if vocabulary is not None and max(prompt) >= vocabulary:
                    raise bad("prompt", f"token id {max(prompt)} is outside the vocabulary (size {vocabulary})")
                prompts.append(list(prompt))
        return await self._generate(request, model, parsed.settings, prompts, chat=False,
                                    default_max_tokens=min(COMPLETIONS_DEFAULT_MAX_TOKENS, model.max_tokens),
                                    prompt_field="prompt")

    # ------------------------------------------------------------------ generation
    async def _generate(self, request: Request, model: ServedModel, settings: GenerationSettings,
                        prompts: list[list[int]], *, chat: bool, default_max_tokens: int,
                        prompt_field: str) -> Response:
        max_tokens = settings.max_tokens if settings.max_tokens is not None else default_max_tokens
        if max_tokens > model.max_tokens:
            raise bad("max_tokens", f"{max_tokens} is more than this server generates: at most {model.max_tokens} "
                                   f"tokens for model '{model.name}'")
        for prompt in prompts:
            if not prompt:
                raise bad(prompt_field, "the prompt encodes to no tokens")
            if len(prompt) > model.max_prompt_tokens:
                raise bad(prompt_field, f"the prompt has {len(prompt)} tokens; model '{model.name}' takes at most "
                                        f"{model.max_prompt_tokens}")
        if settings.logprobs and not model.instance.engine.config.top_logprobs:
            raise bad("logprobs", "this server's engine reports no log-probs")
        generation = self.models.start(model, settings, prompts, max_tokens, asyncio.get_running_loop())
        answer = Answer(model, settings, prompts, chat=chat)
        if settings.stream:
            return StreamingResponse(answer.stream(generation), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await answer.collect(generation, request)


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None


class Answer:
    """One request's choices, as a whole response or as a stream of chunks."""

    def __init__(self, model: ServedModel, settings: GenerationSettings, prompts: list[list[int]], *, chat: bool):
        self.model, self.settings, self.chat = model, settings, chat
        self.prompt_tokens = sum(len(p) for p in prompts)
        self.choices = [Choice(index, model.tokenizer, settings.stop, model.stop_ids)
                        for index in range(len(prompts) * settings.n)]
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _update(self, item: Tokens) -> ChoiceUpdate:
        return self.choices[item.prompt * self.settings.n + item.event.sample_index].take(item.event)

    # ------------------------------------------------------------------ whole
    async def collect(self, generation: Generation, request: Request) -> Response:
        gone = asyncio.ensure_future(_disconnected(request))
        work = asyncio.ensure_future(self._drain(generation))
        try:
            await asyncio.wait({gone, work}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client went away: its slots are freed now, nobody reads the answer
                work.cancel()
                generation.close()
                return Response(status_code=499)
            work.result()
        except ShutDown as error:
            raise APIError(503, str(error)) from None
        finally:
            gone.cancel()
            generation.close()
        return JSONResponse(self._whole())

    async def _drain(self, generation: Generation) -> None:
        async for item in generation.events():
            if isinstance(item, Tokens):
                self._update(item)

    def _whole(self) -> dict:
        choices = []
        for choice in self.choices:
            entry: dict[str, Any] = {"index": choice.index, "finish_reason": choice.finish_reason or "length"}
            text = choice.text.released
            if self.chat:
                entry["message"] = {"role": "assistant", "content": text}
                entry["logprobs"] = (chat_logprobs(self.model.tokenizer, choice.kept_logprobs(),
                                                   self.settings.top_logprobs) if self.settings.logprobs else None)
            else:
                entry["text"] = text
                entry["logprobs"] = (completion_logprobs(self.model.tokenizer, choice.kept_logprobs(),
                                                         self.settings.top_logprobs, 0)
                                     if self.settings.logprobs else None)
            choices.append(entry)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model.name,
                "system_fingerprint": f"policy-v{self.model.policy_version}", "choices": choices,
                "usage": self._usage()}

    def _usage(self) -> dict:
        completion = sum(c.generated for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    # ------------------------------------------------------------------ stream
    async def stream(self, generation: Generation) -> AsyncIterator[str]:
        try:
            if self.chat:
                for choice in self.choices:
                    yield self._event([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}])
            async for item in generation.events():
                if not isinstance(item, Tokens):
                    continue
                update = self._update(item)
                if update.text or update.logprobs or update.finish_reason:
                    yield self._event([self._chunk_choice(update)])
            if self.settings.include_usage:
                yield self._event([], usage=self._usage())
            yield "data: [DONE]\n\n"
        except ShutDown:
            return  # the stream ends here; the client sees it close
        finally:
            generation.close()

    def _chunk_choice(self, update: ChoiceUpdate) -> dict:
        choice = self.choices[update.index]
        tokenizer, top = self.model.tokenizer, self.settings.top_logprobs
        if self.chat:
            delta = {"content": update.text} if update.text else {}
            logprobs = chat_logprobs(tokenizer, update.logprobs, top) if self.settings.logprobs else None
            return {"index": update.index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": update.finish_reason}
        start = len(choice.text.released) - len(update.text)
        logprobs = completion_logprobs(tokenizer, update.logprobs, top, start) if self.settings.logprobs else None
        return {"index": update.index, "text": update.text, "logprobs": logprobs,
                "finish_reason": update.finish_reason}

    def _event(self, choices: list[dict], usage: dict | None = None) -> str:
        chunk: dict[str, Any] = {"id": self.id, "object": self.object + ".chunk" if self.chat else self.object,
                                 "created": self.created, "model": self.model.name, "choices": choices}
        if self.settings.include_usage:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read, so the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
