"""Fixtures for trainer tests: a random iteration of store-like rows and a tiny model config."""

import numpy as np
import pytest


def random_rows(num_samples: int, seed: int = 0, max_prompt: int = 5, max_response: int = 8, vocab=(3, 100)):
    """Store-like rows with uneven prompt/response lengths: dict of per-row lists."""
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(*vocab, size=rng.integers(1, max_prompt + 1))))
               for _ in range(num_samples)]
    responses = [list(map(int, rng.integers(*vocab, size=rng.integers(1, max_response + 1))))
                 for _ in range(num_samples)]
    return dict(
        prompt_ids=prompts,
        response_ids=responses,
        behaviour_logprobs=[list(-4.6 + 0.1 * rng.normal(size=len(r))) for r in responses],
        advantages=list(rng.normal(size=num_samples)),
    )


@pytest.fixture(scope="session")
def tiny_model_config():
    """The "tiny" preset cut to one layer: same code paths, half the compile time."""
    import dataclasses

    from flexmarl_jax.models.presets import get_preset

    return dataclasses.replace(get_preset("tiny"), num_layers=1)
