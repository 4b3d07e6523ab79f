"""FlexEngine + RolloutLoop against the full (cache-free) forward of the same model."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from flexmarl_jax.rollout.engine import FlexEngine, SlotSampling
from flexmarl_jax.rollout.engine_tokenizer import pad_prompt
from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest
from flexmarl_jax.rollout.sampling import sampling_log_probs
from flexmarl_jax.rollout.settings import validate_sampling
from tests.settings_views import engine_config

from .conftest import prompts_of_mixed_lengths

_jitted_sampling_log_probs = jax.jit(sampling_log_probs)


def greedy_reference(model, prompt: tuple[int, ...], max_new: int, eos: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(max_new):
        token = int(model.full_logits(ids)[-1].argmax())
        out.append(token)
        ids.append(token)
        if token == eos:
            break
    return out


def test_greedy_equals_argmax_of_full_forward_for_mixed_lengths(loop, tiny_model):
    prompts = prompts_of_mixed_lengths(tiny_model.tokenizer, 12, seed=3)
    assert len({len(p) for p in prompts}) > 5 and len(prompts) > loop.engine.max_concurrent_decodes
    results = loop.generate([RolloutRequest(p, max_new_tokens=12) for p in prompts])
    distinct_tokens = set()
    for prompt, (result,) in zip(prompts, results, strict=True):
        want = greedy_reference(tiny_model, prompt, 12, tiny_model.tokenizer.eos_id)
        assert list(result.token_ids) == want
        assert result.finish_reason == ("stop" if want[-1] == tiny_model.tokenizer.eos_id else "length")
        distinct_tokens.update(want)
    assert len(distinct_tokens) > 3  # the check is not vacuous (model does not repeat one token)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 8, 0.9), (0.7, 5, 0.8)])
def test_behaviour_logprobs_equal_full_forward_under_same_mask(loop, tiny_model, temperature, top_k, top_p):
    prompts = prompts_of_mixed_lengths(tiny_model.tokenizer, 4, seed=11)
    sampling = SlotSampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=5)
    results = loop.generate([RolloutRequest(p, num_samples=3, sampling=sampling, max_new_tokens=10) for p in prompts])
    worst = 0.0
    for prompt, samples in zip(prompts, results, strict=True):
        for sample in samples:
            ids = list(prompt) + list(sample.token_ids)
            logits = tiny_model.full_logits(ids)[len(prompt) - 1 : len(ids) - 1]
            n = len(sample.token_ids)
            log_probs = np.asarray(_jitted_sampling_log_probs(
                logits, np.full((n,), temperature, np.float32), np.full((n,), top_k, np.int32),
                np.full((n,), top_p, np.float32)))
            want = log_probs[np.arange(n), list(sample.token_ids)]
            assert np.all(np.isfinite(want)), "engine sampled a token outside the mask"
            worst = max(worst, float(np.max(np.abs(np.asarray(sample.logprobs) - want))))
    assert worst < 1e-4


def test_engine_token_frequencies_match_model_distribution(engine, tiny_model):
    """>= 20k first tokens of one prompt through the engine vs softmax(full forward / T): chi-square."""
    prompt = tuple(tiny_model.tokenizer.encode("3+4="))
    draws, temperature = 20_000, 1.3
    loop = RolloutLoop(engine, tiny_model.params)
    (samples,) = loop.generate([RolloutRequest(prompt, num_samples=draws, max_new_tokens=1,
                                               sampling=SlotSampling(temperature=temperature, seed=1))])
    assert len(samples) == draws and {s.sample_index for s in samples} == set(range(draws))
    counts = np.bincount([s.token_ids[0] for s in samples], minlength=tiny_model.config.vocab_size)
    probs = np.asarray(jax.nn.softmax(tiny_model.full_logits(list(prompt))[-1] / temperature), np.float64)
    expected = probs * draws
    # pool tokens with tiny expected counts into one bin so the chi-square approximation holds
    big = expected >= 5
    observed, expected_binned = counts[big], expected[big]
    if (~big).any():
        observed = np.append(observed, counts[~big].sum())
        expected_binned = np.append(expected_binned, expected[~big].sum())
    assert big.sum() >= 5
    assert stats.chisquare(observed, expected_binned * observed.sum() / expected_binned.sum()).pvalue > 1e-3


def test_samples_share_one_prefill_and_are_reproducible(engine, tiny_model, monkeypatch):
    calls = []
    original = FlexEngine.prefill_batch

    def counting_prefill(self, params, padded_tokens, true_lengths, samplings, adapters=None):
        calls.append(len(true_lengths))
        return original(self, params, padded_tokens, true_lengths, samplings, adapters)

    monkeypatch.setattr(FlexEngine, "prefill_batch", counting_prefill)
    prompt = tuple(tiny_model.tokenizer.encode("hello"))
    request = RolloutRequest(prompt, num_samples=8, max_new_tokens=8, sampling=SlotSampling(temperature=1.0, seed=9))
    (first,) = RolloutLoop(engine, tiny_model.params).generate([request])
    assert calls == [1]  # 8 samples, one prefill of one prompt
    assert len({s.token_ids for s in first}) > 1  # independent random streams per sample
    # same seed, different batch mates and slots -> same tokens
    other = RolloutRequest(tuple(tiny_model.tokenizer.encode("zzz")), num_samples=3, max_new_tokens=5,
                           sampling=SlotSampling(temperature=1.0, seed=2))
    calls.clear()
    _, again = RolloutLoop(engine, tiny_model.params).generate([other, request])
    assert calls[0] == 4  # both prompts (same bucket) in one batched prefill, padded to 4 rows
    assert [s.token_ids for s in again] == [s.token_ids for s in first]
    np.testing.assert_allclose([s.logprobs for s in again], [s.logprobs for s in first], atol=1e-5)


def test_prefill_sharing_off_still_serves_every_sample(engine, tiny_model):
    prompt = tuple(tiny_model.tokenizer.encode("no sharing"))
    request = RolloutRequest(prompt, num_samples=10, max_new_tokens=4, sampling=SlotSampling(temperature=1.0, seed=3))
    (shared,) = RolloutLoop(engine, tiny_model.params).generate([request])
    (separate,) = RolloutLoop(engine, tiny_model.params, share_prefill=False).generate([request])
    assert [s.token_ids for s in separate] == [s.token_ids for s in shared]


def test_stop_tokens_and_stop_strings_end_sequences(loop, tiny_model):
    prompt = tuple(tiny_model.tokenizer.encode("abc"))
    (free,) = loop.generate([RolloutRequest(prompt, max_new_tokens=12)])[0]
    stop_token = free.token_ids[3]
    (stopped,) = loop.generate([RolloutRequest(prompt, max_new_tokens=12, stop_token_ids=(stop_token,))])[0]
    cut = free.token_ids.index(stop_token) + 1
    assert stopped.token_ids == free.token_ids[:cut] and stopped.finish_reason == "stop"
    text = tiny_model.tokenizer.decode(free.token_ids[:5])
    (by_string,) = loop.generate([RolloutRequest(prompt, max_new_tokens=12, stop_strings=(text[-2:],))])[0]
    assert tiny_model.tokenizer.decode(by_string.token_ids).endswith(text[-2:])
    assert len(by_string.token_ids) <= 5 and by_string.finish_reason == "stop"


def test_a_stop_pattern_ends_a_sequence_at_the_token_that_completes_its_first_match(loop, tiny_model):
    prompt = tuple(tiny_model.tokenizer.encode("abc"))
    (free,) = loop.generate([RolloutRequest(prompt, max_new_tokens=12)])[0]
    decode = tiny_model.tokenizer.decode
    # Two characters the free run writes at tokens 4-5 (char-level tokens), anything between them allowed.
    first, second = decode(free.token_ids[3:4]), decode(free.token_ids[4:5])
    pattern = f"{re.escape(first)}.*?{re.escape(second)}"
    (cut,) = loop.generate([RolloutRequest(prompt, max_new_tokens=12, stop_pattern=pattern)])[0]
    ends = [n for n in range(1, 13) if re.search(pattern, decode(free.token_ids[:n]))]
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[:ends[0]]
    assert len(cut.token_ids) <= 5
    (never,) = loop.generate([RolloutRequest(prompt, max_new_tokens=12, stop_pattern="will not appear")])[0]
    assert never.token_ids == free.token_ids and never.finish_reason == free.finish_reason


def test_no_compilation_after_warmup_across_100_varied_requests(engine, tiny_model):
    loop = RolloutLoop(engine, tiny_model.params)
    engine.warm_up(tiny_model.params)  # one prefill + insert per bucket, one generate
    rng = np.random.default_rng(0)
    prompts = prompts_of_mixed_lengths(tiny_model.tokenizer, 100, seed=5, max_chars=31)
    requests = [
        RolloutRequest(
            p, num_samples=int(rng.integers(1, 4)), max_new_tokens=int(rng.integers(1, 25)),
            sampling=SlotSampling(temperature=float(rng.choice([0.0, 0.7, 1.0])), top_k=int(rng.choice([0, 5])),
                                  top_p=float(rng.choice([1.0, 0.9])), seed=int(rng.integers(1 << 30))),
        )
        for p in prompts
    ]
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        sizes_before = engine.compiled_cache_sizes()
        results = loop.generate(requests)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(results) == 100 and all(len(r) == q.num_samples for r, q in zip(results, requests, strict=True))
    assert compiles == []
    assert engine.compiled_cache_sizes() == sizes_before


def test_bad_inputs_are_rejected_with_clear_errors(engine, tiny_model):
    loop = RolloutLoop(engine, tiny_model.params)
    too_long = tuple(range(4, 4 + 33))
    with pytest.raises(ValueError, match="33 tokens, more than max_prefill_length=32"):
        loop.submit(RolloutRequest(too_long))
    with pytest.raises(ValueError, match="empty prompt"):
        RolloutRequest(())
    for bad, match in [
        (dict(temperature=-0.1), "temperature=-0.1"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
    ]:
        kwargs = dict(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=4) | bad
        with pytest.raises(ValueError, match=match):
            validate_sampling(**kwargs, field="agents.solver")
    with pytest.raises(ValueError, match="top_p"):
        SlotSampling(top_p=2.0)
    with pytest.raises(ValueError, match="num_samples=0"):
        RolloutRequest((1, 5), num_samples=0)
    with pytest.raises(ValueError, match="prefill_buckets"):
        engine_config(max_prefill_length=32, prefill_buckets=(8, 16))


def test_truncation_keeps_the_last_tokens_when_configured(engine, tiny_model, monkeypatch):
    config = engine_config(max_concurrent_decodes=2, max_prefill_length=8, max_decode_length=4,
                           truncate_long_prompts=True)
    padded, length = pad_prompt(list(range(10, 22)), config, pad_id=0)
    assert length == 8 and list(padded) == list(range(14, 22))
    # same shapes as the shared engine, only the truncation switch differs (no recompile needed)
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, truncate_long_prompts=True))
    long_prompt = tuple(range(10, 10 + 40))
    (result,) = RolloutLoop(engine, tiny_model.params).generate([RolloutRequest(long_prompt, max_new_tokens=3)])[0]
    assert result.prompt_ids == long_prompt[-32:]
    assert list(result.token_ids) == greedy_reference(tiny_model, result.prompt_ids, 3, -1)


def test_bfloat16_params_give_a_bfloat16_cache_and_the_bfloat16_model_greedy_tokens(tiny_model):
    from .conftest import TinyModel

    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny_model.params)
    model = TinyModel(tiny_model.config, tiny_model.graphdef, params, tiny_model.tokenizer)
    config = engine_config(max_concurrent_decodes=4, max_prefill_length=32, max_decode_length=12)
    engine = FlexEngine(model.config, model.graphdef, config, model.tokenizer, params=params)
    state = engine.init_decode_state()
    assert engine.cache_dtype == jnp.bfloat16
    assert state.cache["k"].dtype == state.cache["v"].dtype == jnp.bfloat16
    assert state.cache["k"].nbytes == 2 * np.prod(state.cache["k"].shape)  # half a float32 cache
    prompts = prompts_of_mixed_lengths(model.tokenizer, 4, seed=21)
    results = RolloutLoop(engine, params).generate([RolloutRequest(p, max_new_tokens=12) for p in prompts])
    for prompt, (result,) in zip(prompts, results, strict=True):
        assert list(result.token_ids) == greedy_reference(model, prompt, 12, model.tokenizer.eos_id)


def test_responses_of_over_a_thousand_tokens_compile_nothing_per_length(tiny_model):
    """A 1100-token response cap: the cache holds prompt + 1100 positions, generate compiles once."""
    config = engine_config(max_concurrent_decodes=2, max_prefill_length=16, max_decode_length=1100)
    engine = FlexEngine(tiny_model.config, tiny_model.graphdef, config, tiny_model.tokenizer,
                        params=tiny_model.params)
    assert engine.init_decode_state().cache["k"].shape[2] == 16 + 1100
    loop = RolloutLoop(engine, tiny_model.params)
    prompts = prompts_of_mixed_lengths(tiny_model.tokenizer, 3, seed=4, max_chars=14)
    lengths = (1100, 700, 1024)
    requests = [RolloutRequest(p, max_new_tokens=n, ignore_eos=True, sampling=SlotSampling(temperature=1.0, seed=i))
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    results = loop.generate(requests)
    for (result,), wanted in zip(results, lengths, strict=True):
        assert len(result.token_ids) == wanted and result.finish_reason == "length"
        assert np.all(np.isfinite(result.logprobs)) and np.all(np.asarray(result.logprobs) <= 0)
    sizes = engine.compiled_cache_sizes()
    assert sizes["generate"] == 1 and sizes["prefill"] <= len(config.prefill_buckets)
