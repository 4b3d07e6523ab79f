import random

import pytest

from flexmarl_jax.workflows.generation import GenerationBackend, GenerationRequest, SamplingParams
from flexmarl_jax.workflows.scripted import ScriptedAgent, constant_latency, long_tail_latency


def request(prompt="p", samples=3, **sampling):
    return GenerationRequest("r1", "echo", prompt, samples, SamplingParams(**sampling))


def echo(req, sample_index, rng):
    return f"{req.prompt}{sample_index}{rng.randint(0, 9)}\ntail"


@pytest.mark.timeout(30)
def test_completions_are_deterministic_and_truncated(make_backend):
    backend = make_backend({"echo": echo}, policy_versions={"echo": 4})
    assert isinstance(backend, GenerationBackend)
    first = backend.submit(request(stop=("\n",))).result()
    assert first == backend.submit(request(stop=("\n",))).result()
    assert len(first) == 3
    for index, completion in enumerate(first):
        assert completion.text.startswith(f"p{index}") and len(completion.text) == 3
        assert completion.finish_reason == "stop" and completion.policy_version == 4
        assert completion.token_ids == tuple(map(ord, completion.text))
        assert completion.prompt_token_ids == (ord("p"),)
        assert len(completion.logprobs) == 3 and all(lp < 0 for lp in completion.logprobs)
    short = backend.submit(request(max_new_tokens=2)).result()[0]
    assert short.finish_reason == "length" and short.text == "p0" and len(short.token_ids) == 2
    # A stop pattern keeps its match, as the rollout loop does: "p<index><digit>\n" ends at the newline.
    by_pattern = backend.submit(request(stop_pattern=r"\d\n")).result()
    assert [c.text[:2] for c in by_pattern] == ["p0", "p1", "p2"]
    assert all(c.text.endswith("\n") and len(c.text) == 4 and c.finish_reason == "stop" for c in by_pattern)
    backend.set_policy_version("echo", 5)
    assert backend.submit(request()).result()[0].policy_version == 5
    assert [e.request_id for e in backend.events] == ["r1"] * 5


@pytest.mark.timeout(30)
def test_errors(make_backend):
    backend = make_backend({"echo": ScriptedAgent(echo, constant_latency(0.0))})
    with pytest.raises(ValueError, match=r"no policy for agent 'judge'; known agents: \['echo'\]"):
        backend.submit(GenerationRequest("r", "judge", "p", 1, SamplingParams()))
    with pytest.raises(ValueError, match="num_samples=0"):
        backend.submit(request(samples=0))


def test_long_tail_latency_shape():
    latency = long_tail_latency(base_s=0.01, tail_s=1.0, tail_probability=0.1, jitter=0.0)
    rng = random.Random(0)
    draws = [latency(None, 0, rng) for _ in range(2000)]
    assert set(draws) == {0.01, 1.0}
    assert 0.07 < draws.count(1.0) / len(draws) < 0.13
    with pytest.raises(ValueError, match="tail_probability=2"):
        long_tail_latency(0.1, 1.0, 2)
