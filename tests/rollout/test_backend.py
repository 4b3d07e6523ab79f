"""EngineBackend: GenerationRequest -> future of Completions from engine instances."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from flexmarl_jax.rollout.backend import EngineBackend
from flexmarl_jax.rollout.instance import EngineInstance
from flexmarl_jax.workflows.generation import GenerationBackend, GenerationRequest, PromptTooLong, SamplingParams

from .test_engine import greedy_reference


@pytest.mark.timeout(60)
def test_backend_resolves_completions_per_agent(engine, tiny_model):
    tokenizer = tiny_model.tokenizer
    instances = {"solver": [EngineInstance(engine, tiny_model.params, name="s0"),
                            EngineInstance(engine, tiny_model.params, name="s1")],
                 "verifier": [EngineInstance(engine, tiny_model.params, policy_version=3, name="v0")]}
    with EngineBackend(instances, tokenizer) as backend:
        assert isinstance(backend, GenerationBackend)
        greedy = backend.submit(GenerationRequest("q0", "solver", "2+2=", 1, SamplingParams(temperature=0.0,
                                                                                             max_new_tokens=7)))
        sampled = backend.submit(GenerationRequest("q1", "verifier", "check 2+2=4", 5,
                                                   SamplingParams(temperature=0.8, top_k=20, max_new_tokens=6)))
        futures = [backend.submit(GenerationRequest(f"q{k}", "solver", f"{k}*{k}=", 2, SamplingParams(seed=k)))
                   for k in range(2, 8)]
        (completion,) = greedy.result(timeout=50)
        samples = sampled.result(timeout=50)
        concurrent.futures.wait(futures, timeout=50)
    prompt_ids = tuple(tokenizer.encode("2+2="))
    assert completion.prompt_token_ids == prompt_ids
    assert list(completion.token_ids) == greedy_reference(tiny_model, prompt_ids, 7, tokenizer.eos_id)
    assert completion.text == tokenizer.decode(completion.token_ids)
    assert completion.policy_version == 0 and completion.finish_reason in ("stop", "length")
    assert len(samples) == 5 and all(s.policy_version == 3 for s in samples)
    assert all(len(s.logprobs) == len(s.token_ids) and np.all(np.asarray(s.logprobs) <= 0) for s in samples)
    assert all(len(f.result()) == 2 for f in futures)
    assert sum(i.generated_tokens > 0 for i in instances["solver"]) == 2  # least-loaded spreads the work


def test_backend_rejects_bad_requests(engine, tiny_model):
    backend = EngineBackend({"solver": [EngineInstance(engine, tiny_model.params)]}, tiny_model.tokenizer,
                            start=False)
    with pytest.raises(ValueError, match="unknown agent 'critic'"):
        backend.submit(GenerationRequest("r", "critic", "hi", 1, SamplingParams()))
    with pytest.raises(ValueError, match="empty prompt"):
        backend.submit(GenerationRequest("r", "solver", "", 1, SamplingParams()))
    with pytest.raises(PromptTooLong, match="41 tokens, more than rollout.max_prompt_length=32"):
        backend.submit(GenerationRequest("r", "solver", "x" * 40, 1, SamplingParams()))
    with pytest.raises(ValueError, match="temperature=-1"):
        backend.submit(GenerationRequest("r", "solver", "hi", 1, SamplingParams(temperature=-1.0)))
    with pytest.raises(ValueError, match="no engine instance"):
        EngineBackend({"solver": []}, tiny_model.tokenizer, start=False)
