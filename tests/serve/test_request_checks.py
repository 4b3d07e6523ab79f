"""The checks in front of JetStream's Driver: each bad request gets a one-line reason naming its field."""

import pytest
from jetstream.core.proto import jetstream_pb2

from flexmarl_jax.models.tokenizer import CharTokenizer
from flexmarl_jax.serve.request_checks import RequestLimits, decode_request_problem

LIMITS = RequestLimits(max_prefill_length=16, max_tokens=8, vocab_size=104, adds_bos=True)


def text(value, max_tokens=4, **fields):
    return jetstream_pb2.DecodeRequest(text_content=jetstream_pb2.DecodeRequest.TextContent(text=value),
                                       max_tokens=max_tokens, **fields)


def tokens(ids, max_tokens=4):
    return jetstream_pb2.DecodeRequest(token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids),
                                       max_tokens=max_tokens)


@pytest.mark.parametrize("request_, named", [
    (text(""), "text_content.text is empty"),
    (tokens([]), "token_content.token_ids is empty"),
    (jetstream_pb2.DecodeRequest(max_tokens=4), "content: set"),
    (text("abc", max_tokens=0), "max_tokens=0 must be in [1, 8]"),
    (text("abc", max_tokens=9), "max_tokens=9 must be in [1, 8]"),
    (text("abc", max_tokens=-1), "max_tokens=-1"),
    (text("a" * 16), "the prompt is 17 tokens (BOS included), more than this server's max_prefill_length=16"),
    (tokens([5] * 16), "the prompt is 17 tokens"),
    (tokens([5, -1]), "token_content.token_ids: -1 is outside the vocabulary [0, 104)"),
    (tokens([104]), "104 is outside"),
    (text("abc", session_cache="s"), "session_cache"),
])
def test_refused_with_a_reason_naming_the_field(request_, named):
    problem = decode_request_problem(request_, CharTokenizer(), LIMITS)
    assert problem is not None and named in problem and "\n" not in problem


@pytest.mark.parametrize("request_", [text("a" * 15, max_tokens=8), tokens([5] * 15, max_tokens=1), text("x", 1)])
def test_accepted_up_to_the_limits(request_):
    assert decode_request_problem(request_, CharTokenizer(), LIMITS) is None


def test_without_bos_the_whole_length_is_the_prompt():
    limits = RequestLimits(max_prefill_length=16, max_tokens=8, vocab_size=104, adds_bos=False)
    assert decode_request_problem(tokens([5] * 16), CharTokenizer(), limits) is None
    assert "17 tokens, more" in decode_request_problem(tokens([5] * 17), CharTokenizer(), limits)
