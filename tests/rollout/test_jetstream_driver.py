"""JetStream's own orchestrator.Driver serving FlexEngine; the compat module's import hygiene."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from flexmarl_jax.rollout.jetstream_compat import (
    driver_engine,
    engine_api,
    jetstream_pb2,
    load_orchestrator,
    token_utils,
)
from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest

orchestrator = load_orchestrator()


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
    driven = driver_engine(engine)
    driver = orchestrator.Driver(
        prefill_engines=[driven], generate_engines=[driven], prefill_params=[tiny_model.params],
        generate_params=[tiny_model.params], interleaved_mode=True,
    )
    server = orchestrator.LLMOrchestrator(driver=driver)

    async def run_all():
        # The Driver is stopped while the loop still runs: its detokenize thread hands the end of each stream
        # to the loop in two calls, and one after the loop closed raises there, which SIGKILLs the process.
        try:
            return await asyncio.gather(*(_decode(server, t, max_tokens) for t in texts))
        finally:
            await asyncio.to_thread(driver.stop)

    served = asyncio.run(run_all())
    eos = tiny_model.tokenizer.eos_id
    for (result,), tokens in zip(in_process, served, strict=True):
        # JetStream does not stream the stop token itself; our loop keeps it (RL needs its log-prob)
        want = [t for t in result.token_ids if t != eos]
        assert tokens == want
    assert sum(len(t) for t in served) >= 10


def test_result_tokens_with_logprobs_work_with_jetstream_helpers(engine, tiny_model):
    from flexmarl_jax.rollout.engine_tokenizer import pad_prompt

    padded, length = pad_prompt(tiny_model.tokenizer.encode("hi"), engine.config, 0)

    def one_step(engine):
        prefix = engine.prefill(params=tiny_model.params, padded_tokens=padded, true_length=length)
        state = engine.insert(prefix, engine.init_decode_state(), slot=5)
        return engine.generate(tiny_model.params, state)[1]

    slot = one_step(engine).convert_to_numpy().get_result_at_slot(5)  # ours: with the log-probs
    result = one_step(driver_engine(engine))  # the Driver's: JetStream's own type, which its threads check for
    assert isinstance(result, engine_api.ResultTokens)
    assert driver_engine(engine).max_concurrent_decodes == engine.max_concurrent_decodes  # delegated properties
    host = result.convert_to_numpy()
    samples, complete = token_utils.process_result_tokens(
        tokenizer=engine.build_tokenizer(engine.get_tokenizer()), slot=5, slot_max_length=4, result_tokens=host,
        complete=__import__("numpy").zeros((1,), bool), is_client_side_tokenization=True,
    )
    logits = tiny_model.full_logits(list(padded[:length]))[-1]
    assert int(slot.tokens[0, 0]) == int(logits.argmax()) and int(slot.lengths[0]) == 1
    assert slot.logprobs.dtype.name == "float32" and slot.logprobs[0, 0] <= 0
    assert samples[0].token_ids in ([int(logits.argmax())], [])


HYGIENE = """
import logging, sys
import jax, jax.numpy as jnp
root = logging.getLogger()
root.setLevel(logging.WARNING)
before = (root.level, list(root.handlers))
from flexmarl_jax.rollout import jetstream_compat
assert not hasattr(jax, "tree_map"), "importing the compat module changed jax"
assert "jetstream.core.orchestrator" not in sys.modules, "the orchestrator is imported only on demand"
orchestrator = jetstream_compat.load_orchestrator()
assert jetstream_compat.load_orchestrator() is orchestrator
assert (root.level, list(root.handlers)) == before, "the orchestrator's import reconfigured the root logger"
assert not hasattr(jax, "tree_map"), "the tree_map fix leaked into jax"
leaves = {"a": jnp.ones(3), "b": [jnp.zeros(2)]}
orchestrator.delete_pytree(leaves)  # JetStream's own call of jax.tree_map, as its Driver makes it after insert
assert leaves["a"].is_deleted() and leaves["b"][0].is_deleted()
print("ok")
"""


@pytest.mark.timeout(240)
def test_compat_fixes_jetstream_for_current_jax_without_changing_jax_or_the_root_logger():
    done = subprocess.run([sys.executable, "-c", HYGIENE], capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "ok"


def test_insert_does_not_alias_the_prefill_buffers_the_driver_deletes(engine, tiny_model):
    """JetStream's generate thread deletes every array of a prefill result right after `insert`."""
    import jax
    import numpy as np

    from flexmarl_jax.rollout.engine_tokenizer import pad_prompt

    def first_tokens(delete_prefix: bool) -> list[int]:
        state = engine.init_decode_state()
        padded, length = pad_prompt(tiny_model.tokenizer.encode("rev:abcd="), engine.config, 0)
        prefix = engine.prefill(params=tiny_model.params, padded_tokens=padded, true_length=length)
        state = engine.insert(prefix, state, slot=3)
        if delete_prefix:
            orchestrator.delete_pytree(prefix)
            assert all(leaf.is_deleted() for leaf in jax.tree.leaves(prefix))
        tokens = []
        for _ in range(4):
            state, result = engine.generate(tiny_model.params, state)
            tokens.append(int(np.asarray(result.data)[3, 0]))
        return tokens

    assert first_tokens(delete_prefix=True) == first_tokens(delete_prefix=False)


def test_importing_the_rollout_package_does_not_import_jetstream_or_tensorflow():
    code = (
        "import sys, flexmarl_jax.rollout, flexmarl_jax.rollout.settings\n"
        "bad = [m for m in ('jetstream', 'tensorflow', 'seqio') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
