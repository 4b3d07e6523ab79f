"""The one generation interface every workflow talks to.

Pure Python on purpose: the workflow executor must not know whether text comes from the rollout engine
(a JAX model behind continuous batching) or from scripted policies in tests and benchmarks.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one agent samples; `stop` strings, or a match of `stop_pattern` (a regex, '' for none) in the
    completion's last 64 tokens, end a completion early (finish_reason "stop"; the stop text is kept)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 32
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_pattern: str = ""


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """A prompt for a chat model: a system and a user message. The rollout backend renders it with the
    agent's own chat template (models/chat_template.py), so one workflow serves agents whose templates differ.
    """

    system: str
    user: str

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user}]

    def __str__(self) -> str:
        """A readable form for logs and records (the exact prompt is in the record's token ids)."""
        return f"[system] {self.system}\n[user] {self.user}"


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """`num_samples` independent completions of one prompt for one agent's policy. `prompt` is plain text
    (tokenised as is) or a `ChatPrompt` (rendered with the agent's chat template first)."""

    request_id: str
    agent: str
    prompt: str | ChatPrompt
    num_samples: int
    sampling: SamplingParams


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled continuation.

    `prompt_token_ids` [prompt_len] and `token_ids`/`logprobs` [response_len] are what the behaviour policy
    saw and produced; `policy_version` is the version of the agent's weights that generated it.
    """

    text: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" | "length" | "aborted"
    policy_version: int


class PromptTooLong(ValueError):
    """A rendered prompt has more tokens than the agent's engines take (`rollout.max_prompt_length`). The
    backend raises it from `submit`; the executor skips that call (a later turn grown by quoted responses)."""


@runtime_checkable
class GenerationBackend(Protocol):
    """Anything that turns a request into a future of exactly `request.num_samples` completions."""

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[list[Completion]]: ...
