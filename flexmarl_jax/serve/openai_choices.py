"""The choices of one OpenAI answer as the engine's tokens arrive: text, finish reason, log-probs, usage.

Choice `prompt * n + sample` of a request holds one sample's `ChoiceText`. Each token event yields the
`ChoiceUpdate` a stream sends (the released text, the log-prob entries of the tokens that text completes, and a
finish reason once the choice is over); a non-streamed answer reads the same state at the end. Log-probs are
the model's raw log-softmax (before temperature and top-k/top-p), as vLLM reports by default.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flexmarl_jax.rollout.loop import TokenEvent
from flexmarl_jax.serve.choice_text import ChoiceText


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class ChoiceUpdate:
    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None


class Choice:
    """One sample's state."""

    def __init__(self, index: int, tokenizer: Any, stop: tuple[str, ...], stop_ids: frozenset[int]):
        self.index = index
        self.text = ChoiceText(tokenizer, stop=stop, stop_ids=stop_ids)
        self.logprobs: list[TokenLogprob] = []
        self.sent_logprobs = 0
        self.finish_reason: str | None = None
        self.generated = 0  # tokens the engine generated (the usage count), stop token included

    def take(self, event: TokenEvent) -> ChoiceUpdate:
        self.generated += len(event.token_ids)
        if event.raw_logprobs:
            self.logprobs += [TokenLogprob(t, lp, top) for t, lp, top in
                              zip(event.token_ids, event.raw_logprobs, event.top, strict=True)]
        text = self.text.add(event.token_ids)
        if self.finish_reason is None:
            if self.text.stopped:  # a stop string: the text ends before it
                self.finish_reason = "stop"
            elif event.finish_reason is not None:  # a stop token or the token budget
                text += self.text.finish()
                self.finish_reason = "stop" if event.finish_reason == "stop" else "length"
        released = (len(self.kept_logprobs()) if self.finish_reason is not None
                    else min(self.text.released_tokens(), len(self.logprobs)))
        entries = self.logprobs[self.sent_logprobs:released]
        self.sent_logprobs = max(self.sent_logprobs, released)
        return ChoiceUpdate(self.index, text, entries, self.finish_reason)

    def kept_logprobs(self) -> list[TokenLogprob]:
        """The entries of the tokens the answer's text holds (not those past a stop string)."""
        if self.text.stopped:
            return self.logprobs[: self.text.released_tokens()]
        return self.logprobs


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprob], top: int) -> dict:
    """`choices[i].logprobs` of a chat answer: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(e.token_id, e.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in e.top[:top]]} for e in entries]}


def completion_logprobs(tokenizer: Any, entries: list[TokenLogprob], top: int, text_start: int) -> dict:
    """`choices[i].logprobs` of a completion: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [token_text(tokenizer, e.token_id) for e in entries]
    offsets, offset = [], text_start
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [_by_text(tokenizer, e.top[:top]) for e in entries],
            "text_offset": offsets}


def _by_text(tokenizer: Any, top: tuple[tuple[int, float], ...]) -> dict[str, float]:
    """The completions format keys alternatives by text; two ids with one text (partial UTF-8 bytes) keep the
    likelier one's log-prob."""
    alternatives: dict[str, float] = {}
    for token_id, logprob in top:
        alternatives.setdefault(token_text(tokenizer, token_id), logprob)
    return alternatives
