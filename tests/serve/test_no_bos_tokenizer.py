"""A tokenizer without BOS (Qwen's kind) behind JetStream's Driver: the servicer keeps the Driver from putting
the missing BOS id in front of token content, and prompts count without it."""

from __future__ import annotations

import asyncio

import pytest

from flexmarl_jax.models.tokenizer import CharTokenizer
from tests.rollout.conftest import make_tiny_model
from tests.settings_views import engine_config


class NoBosCharTokenizer(CharTokenizer):
    """The character tokenizer as a checkpoint without BOS would have it: bos_id None, nothing prepended."""

    def __init__(self):
        super().__init__()
        self.bos_id = None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return super().encode(text, add_bos=False)


@pytest.mark.timeout(300)
def test_token_and_text_content_without_bos_match_in_process_generation():
    from jetstream.core.proto import jetstream_pb2

    from flexmarl_jax.rollout.engine import FlexEngine
    from flexmarl_jax.rollout.jetstream_compat import driver_engine
    from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest
    from flexmarl_jax.serve.request_checks import RequestLimits
    from flexmarl_jax.serve.servicer import CheckedOrchestrator, orchestrator

    model = make_tiny_model()
    tokenizer = NoBosCharTokenizer()
    engine = FlexEngine(model.config, model.graphdef,
                        engine_config(max_concurrent_decodes=4, max_prefill_length=16, max_decode_length=6),
                        tokenizer, params=model.params)
    limits = RequestLimits.of(engine)
    assert limits.adds_bos is False
    texts = ["rev:abcd=", "1+2=", "a" * 16]  # the last one is exactly max_prefill_length without a BOS
    want = []
    for text in texts:
        (result,) = RolloutLoop(engine, model.params).generate(
            [RolloutRequest(tuple(tokenizer.encode(text)), max_new_tokens=6)])[0]
        want.append([token for token in result.token_ids if token not in tokenizer.stop_ids])
    driven = driver_engine(engine)
    driver = orchestrator.Driver(prefill_engines=[driven], generate_engines=[driven], prefill_params=[model.params],
                                 generate_params=[model.params], interleaved_mode=True)
    servicer = CheckedOrchestrator(driver, tokenizer, limits)

    async def decode(request) -> list[int]:
        tokens = []
        async for response in servicer.Decode(request):
            tokens.extend(response.stream_content.samples[0].token_ids)
        return tokens

    def by_tokens(text):
        return jetstream_pb2.DecodeRequest(max_tokens=6, token_content=jetstream_pb2.DecodeRequest.TokenContent(
            token_ids=tokenizer.encode(text)))

    def by_text(text):
        return jetstream_pb2.DecodeRequest(max_tokens=6, text_content=jetstream_pb2.DecodeRequest.TextContent(
            text=text))

    async def run_all():
        # One event loop for the Driver's whole life: its threads hand results to the loop (JetStream's
        # AsyncMultifuture) and die, taking the process with them, if it is closed before they stop.
        try:
            served = await asyncio.gather(*(decode(make(text)) for make in (by_tokens, by_text) for text in texts))
            with pytest.raises(ValueError, match="17 tokens, more than this server's max_prefill_length=16"):
                await decode(by_text("a" * 17))
            return served
        finally:
            await asyncio.to_thread(driver.stop)

    served = asyncio.run(run_all())
    assert served == want + want
    assert sum(map(len, want)) > 0
