"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) checked into plain settings.

Every bad value raises `APIError` with the HTTP status, a message naming the field and what is allowed, and the
field as OpenAI's error object's `param`; nothing reaches an engine before the whole body passed. Fields OpenAI
defines that this server does not implement (penalties, tools, logit bias, echo, best_of > 1) are refused rather
than ignored, so a client never gets an answer that silently lacks what it asked for. Two of vLLM's extensions
are read: `top_k` and `ignore_eos`.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from flexmarl_jax.rollout.settings import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_CHOICES = 128  # n: a bound against one request filling the queue for minutes
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the server's limit
UNSUPPORTED = {  # field -> the value that means "not used"
    "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "tools": None, "functions": None,
    "tool_choice": None, "response_format": None, "suffix": None, "echo": False, "best_of": 1,
}
ROLES = ("system", "user", "assistant", "developer")


class APIError(Exception):
    """An answer other than 200: `status`, a one-line `message`, the `param` it is about and OpenAI's `type`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return {401: "authentication_error", 404: "not_found_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """What both endpoints ask of the engine, checked."""

    model: str
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int | None  # None: the endpoint's default
    stop: tuple[str, ...]
    seed: int  # drawn fresh when the request named none
    stream: bool
    include_usage: bool
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    settings: GenerationSettings
    prompts: tuple[str | tuple[int, ...], ...]  # text, or token ids


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    settings: GenerationSettings
    messages: tuple[dict[str, str], ...]


def parse_completion(body: Any) -> CompletionRequest:
    body = _object(body)
    settings = _settings(body, chat=False)
    return CompletionRequest(settings, _prompts(body.get("prompt")))


def parse_chat(body: Any) -> ChatRequest:
    body = _object(body)
    settings = _settings(body, chat=True)
    return ChatRequest(settings, _messages(body.get("messages")))


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for field, unused in UNSUPPORTED.items():
        value = body.get(field, unused)
        if value not in (unused, None, {}, []):
            raise bad(field, f"{value!r} is not supported by this server")
    return body


def _settings(body: dict, *, chat: bool) -> GenerationSettings:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "required: the name of one of the served agents (GET /v1/models)")
    n = _int(body, "n", 1, low=1, high=MAX_CHOICES)
    temperature = _number(body, "temperature", 1.0, low=0.0, high=2.0)
    top_p = _number(body, "top_p", 1.0, low=0.0, high=1.0)
    if top_p <= 0:
        raise bad("top_p", f"{top_p!r} must be in (0, 1]")
    top_k = _int(body, "top_k", 0, low=-1, high=None)
    token_field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(token_field)
    if max_tokens is not None:
        max_tokens = _int(body, token_field, None, low=1, high=None)
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbelow(2**31)  # a request without a seed gets its own stream, not seed 0's
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise bad("seed", f"{seed!r} must be an integer")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", f"{options!r} must be an object")
    include_usage = bool(options.get("include_usage", False))
    logprobs, top_logprobs = _logprobs(body, chat=chat)
    return GenerationSettings(
        model=model, n=n, temperature=temperature, top_p=top_p, top_k=max(top_k, 0), max_tokens=max_tokens,
        stop=_stop(body.get("stop")), seed=int(seed) % (2**31), stream=stream, include_usage=include_usage,
        ignore_eos=_bool(body, "ignore_eos", False), logprobs=logprobs, top_logprobs=top_logprobs)


def _logprobs(body: dict, *, chat: bool) -> tuple[bool, int]:
    if chat:  # logprobs: bool, top_logprobs: 0..20 alternatives (only with logprobs)
        wanted = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", 0, low=0, high=MAX_TOP_LOGPROBS)
        if top and not wanted:
            raise bad("top_logprobs", "needs logprobs: true")
        return wanted, top
    value = body.get("logprobs")  # completions: an int of alternatives, or null for none
    if value is None:
        return False, 0
    return True, _int(body, "logprobs", 0, low=0, high=MAX_TOP_LOGPROBS)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stops)):
        raise bad("stop", f"{value!r} must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
    return tuple(stops)


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    message = "must be a string, a list of strings, a list of token ids or a list of such lists, not empty"
    if isinstance(value, str):
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        prompts = list(value)
    elif isinstance(value, list) and value and all(_is_ids(p) for p in value):
        prompts = [tuple(value)] if all(isinstance(p, int) for p in value) else [tuple(p) for p in value]
    else:
        raise bad("prompt", message)
    if any(len(p) == 0 for p in prompts):
        raise bad("prompt", "an empty prompt cannot be continued")
    return tuple(prompts)


def _is_ids(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return value >= 0
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    messages = []
    for index, message in enumerate(value):
        field = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad(f"{field}.role", f"must be one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"{field}.content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"{field}.content", "must be a string")
        role = "system" if message["role"] == "developer" else message["role"]
        messages.append({"role": role, "content": content})
    return tuple(messages)


def _int(body: dict, field: str, default: Any, *, low: int, high: int | None) -> Any:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        limit = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
        raise bad(field, f"{value!r} must be {limit}")
    return value


def _number(body: dict, field: str, default: float, *, low: float, high: float) -> float:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise bad(field, f"{value!r} must be a number in [{low:g}, {high:g}]")
    return float(value)


def _bool(body: dict, field: str, default: bool) -> bool:
    value = body.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(field, f"{value!r} must be true or false")
    return value
