"""Per-step token events (`RolloutRequest.on_tokens`), raw log-probs, and stop strings that end inside a token."""

from __future__ import annotations

import numpy as np
import pytest

from flexmarl_jax.rollout.engine import FlexEngine, SlotSampling
from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest
from tests.settings_views import engine_config

TOP = 5


@pytest.fixture(scope="module")
def reporting_engine(tiny_model):
    """The tiny model's engine with the raw top-5 log-probs reported, as the OpenAI server asks."""
    config = engine_config(max_concurrent_decodes=4, max_prefill_length=16, max_decode_length=12,
                           prefill_buckets=(16,), top_logprobs=TOP)
    return FlexEngine(tiny_model.config, tiny_model.graphdef, config, tiny_model.tokenizer)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


@pytest.mark.parametrize("temperature", [0.0, 0.6])
def test_events_carry_every_token_once_in_order_and_end_before_on_done(reporting_engine, tiny_model, temperature):
    log: list = []
    prompt = tuple(tiny_model.tokenizer.encode("abc"))
    request = RolloutRequest(prompt, num_samples=2, max_new_tokens=10, sampling=SlotSampling(temperature, seed=4),
                             on_tokens=lambda event: log.append(("tokens", event)),
                             on_done=lambda results: log.append(("done", results)))
    RolloutLoop(reporting_engine, tiny_model.params).generate([request])
    assert log[-1][0] == "done" and [kind for kind, _ in log].count("done") == 1
    events = [event for kind, event in log if kind == "tokens"]
    for result in log[-1][1]:
        mine = [e for e in events if e.sample_index == result.sample_index]
        assert sum((e.token_ids for e in mine), ()) == result.token_ids
        assert sum((e.logprobs for e in mine), ()) == result.logprobs
        assert [e.finish_reason for e in mine] == [None] * (len(mine) - 1) + [result.finish_reason]
        ids = list(prompt)
        for event in mine:  # the raw log-probs are the model's own log-softmax, whatever the temperature
            (token,), (raw,), (top,) = event.token_ids, event.raw_logprobs, event.top
            expected = _log_softmax(tiny_model.full_logits(ids)[-1].astype(np.float64))
            assert abs(raw - expected[token]) < 1e-4
            assert [t for t, _ in top] == list(np.argsort(-expected)[:TOP])
            assert np.allclose([lp for _, lp in top], np.sort(expected)[::-1][:TOP], atol=1e-4)
            ids.append(token)


class TwoCharacterTokens:
    """The tiny tokenizer with every token written as two characters (its own, then '_'), so a stop string
    can end inside a token."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.eos_id, self.pad_id, self.bos_id = tokenizer.eos_id, tokenizer.pad_id, tokenizer.bos_id

    def decode(self, ids) -> str:
        return "".join(self._tokenizer.decode([i]) + "_" for i in ids)


def test_a_stop_string_that_ends_inside_a_token_stops_at_that_token(reporting_engine, tiny_model):
    prompt = tuple(tiny_model.tokenizer.encode("abc"))
    tokenizer = TwoCharacterTokens(tiny_model.tokenizer)
    loop = RolloutLoop(reporting_engine, tiny_model.params, tokenizer=tokenizer)
    (free,) = loop.generate([RolloutRequest(prompt, max_new_tokens=12, ignore_eos=True)])[0]
    text = tokenizer.decode(free.token_ids)
    stop = text[7:9]  # '_' + the first character of token 4: it ends inside token 4
    first = text.index(stop)
    (cut,) = loop.generate([RolloutRequest(prompt, max_new_tokens=12, ignore_eos=True, stop_strings=(stop,))])[0]
    assert cut.finish_reason == "stop"
    assert len(tokenizer.decode(cut.token_ids)) >= first + len(stop) > len(tokenizer.decode(cut.token_ids[:-1]))
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]
