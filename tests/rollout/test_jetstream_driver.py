"""JetStream's own orchestrator.Driver serving FlexEngine; the compat module's import hygiene."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import pytest

from flexmarl_jax.rollout.jetstream_compat import engine_api, jetstream_pb2, orchestrator, token_utils
from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest


async def _decode(server: orchestrator.LLMOrchestrator, text: str, max_tokens: int) -> list[int]:
    request = jetstream_pb2.DecodeRequest(
        text_content=jetstream_pb2.DecodeRequest.TextContent(text=text), max_tokens=max_tokens
    )
    token_ids: list[int] = []
    async for response in server.Decode(request):
        (sample,) = response.stream_content.samples
        token_ids.extend(sample.token_ids)
    return token_ids


@pytest.mark.timeout(60)
def test_driver_returns_the_in_process_loops_greedy_tokens(engine, tiny_model):
    texts = ["hello", "1+2=", "a much longer prompt here"]
    max_tokens = 8
    in_process = RolloutLoop(engine, tiny_model.params).generate(
        [RolloutRequest(tuple(tiny_model.tokenizer.encode(t)), max_new_tokens=max_tokens) for t in texts]
    )
    driver = orchestrator.Driver(
        prefill_engines=[engine], generate_engines=[engine], prefill_params=[tiny_model.params],
        generate_params=[tiny_model.params], interleaved_mode=True,
    )
    try:
        server = orchestrator.LLMOrchestrator(driver=driver)

        async def run_all():
            return await asyncio.gather(*(_decode(server, t, max_tokens) for t in texts))

        served = asyncio.run(run_all())
    finally:
        driver.stop()
    eos = tiny_model.tokenizer.eos_id
    for (result,), tokens in zip(in_process, served, strict=True):
        # JetStream does not stream the stop token itself; our loop keeps it (RL needs its log-prob)
        want = [t for t in result.token_ids if t != eos]
        assert tokens == want
    assert sum(len(t) for t in served) >= 10


def test_result_tokens_with_logprobs_work_with_jetstream_helpers(engine, tiny_model):
    from flexmarl_jax.rollout.engine import pad_prompt

    state = engine.init_decode_state()
    padded, length = pad_prompt(tiny_model.tokenizer.encode("hi"), engine.config, 0)
    prefix = engine.prefill(params=tiny_model.params, padded_tokens=padded, true_length=length)
    state = engine.insert(prefix, state, slot=5)
    state, result = engine.generate(tiny_model.params, state)
    assert isinstance(result, engine_api.ResultTokens)
    host = result.convert_to_numpy()
    slot = host.get_result_at_slot(5)
    samples, complete = token_utils.process_result_tokens(
        tokenizer=engine.build_tokenizer(engine.get_tokenizer()), slot=5, slot_max_length=4, result_tokens=host,
        complete=__import__("numpy").zeros((1,), bool), is_client_side_tokenization=True,
    )
    logits = tiny_model.full_logits(list(padded[:length]))[-1]
    assert int(slot.tokens[0, 0]) == int(logits.argmax()) and int(slot.lengths[0]) == 1
    assert slot.logprobs.dtype.name == "float32" and slot.logprobs[0, 0] <= 0
    assert samples[0].token_ids in ([int(logits.argmax())], [])


def test_compat_restores_root_logger_and_supplies_tree_map(monkeypatch):
    """Re-runs JetStream's orchestrator import (which sets the root logger to DEBUG) through compat."""
    import importlib

    import jax
    import jetstream.core

    from flexmarl_jax.rollout import jetstream_compat

    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.WARNING)
    handlers_before = list(root.handlers)
    monkeypatch.delitem(sys.modules, "jetstream.core.orchestrator")
    monkeypatch.delattr(jetstream.core, "orchestrator")
    monkeypatch.delattr(jax, "tree_map", raising=False)
    monkeypatch.setattr(jetstream_compat, "orchestrator", jetstream_compat.orchestrator)  # restored after
    importlib.reload(jetstream_compat)
    assert jetstream_compat.orchestrator is not orchestrator  # the module really was imported again
    assert root.level == logging.WARNING and root.handlers == handlers_before
    assert jax.tree_map is jax.tree_util.tree_map


def test_importing_the_rollout_package_does_not_import_jetstream_or_tensorflow():
    code = (
        "import sys, flexmarl_jax.rollout, flexmarl_jax.rollout.settings\n"
        "bad = [m for m in ('jetstream', 'tensorflow', 'seqio') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
