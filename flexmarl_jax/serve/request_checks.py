"""Which gRPC `DecodeRequest`s an engine can serve, checked before JetStream's Driver sees them.

The Driver runs prefill, generate and detokenize on its own threads, and a thread that raises kills the whole
process (JetStream's `JetThread` sends SIGKILL). So everything that would make one of them raise is refused
here, on the gRPC handler, with a one-line reason naming the field: no content, an empty prompt, a token id
outside the vocabulary, a prompt longer than the engine's `max_prefill_length` (JetStream would cut it and
report the uncut length, which prefill rejects), `max_tokens` outside [1, the engine's max_decode_length] (0 is
also what an unset field reads as), and `session_cache` (FlexEngine keeps no prefix cache).

Prompt lengths count the BOS that the Driver itself puts in front of token content (and our tokenizer in front
of text) when the tokenizer has one.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What one engine accepts: prompts up to `max_prefill_length` tokens (BOS included), 1..`max_tokens` new
    tokens, token ids in [0, `vocab_size`); `adds_bos` whether a BOS is put in front of every prompt."""

    max_prefill_length: int
    max_tokens: int
    vocab_size: int
    adds_bos: bool

    @classmethod
    def of(cls, engine: Any) -> RequestLimits:
        """The limits of a `FlexEngine` (its config, model and tokenizer)."""
        return cls(max_prefill_length=engine.max_prefill_length, max_tokens=engine.config.max_decode_length,
                   vocab_size=engine.model_config.vocab_size, adds_bos=engine.tokenizer.bos_id is not None)


def decode_request_problem(request: Any, tokenizer: Any, limits: RequestLimits) -> str | None:
    """None when the Driver can serve ``request`` (a jetstream_pb2.DecodeRequest); otherwise why not, one line."""
    if request.session_cache:
        return "session_cache: not supported (this server keeps no prefix cache); leave it empty"
    content = request.WhichOneof("content")
    if content is None:
        return "content: set text_content.text or token_content.token_ids"
    if content == "text_content":
        text = request.text_content.text
        if not text:
            return "text_content.text is empty"
        prompt_tokens = len(tokenizer.encode(text, add_bos=limits.adds_bos))
    else:
        token_ids = list(request.token_content.token_ids)
        if not token_ids:
            return "token_content.token_ids is empty"
        outside = [token for token in token_ids if not 0 <= token < limits.vocab_size]
        if outside:
            return f"token_content.token_ids: {outside[0]} is outside the vocabulary [0, {limits.vocab_size})"
        prompt_tokens = len(token_ids) + int(limits.adds_bos)
    if prompt_tokens > limits.max_prefill_length:
        bos = " (BOS included)" if limits.adds_bos else ""
        return (f"{content}: the prompt is {prompt_tokens} tokens{bos}, more than this server's max_prefill_length="
                f"{limits.max_prefill_length}")
    if not 1 <= request.max_tokens <= limits.max_tokens:
        return f"max_tokens={request.max_tokens} must be in [1, {limits.max_tokens}] (this server's max_decode_length)"
    return None
