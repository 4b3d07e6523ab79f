"""Shared tiny model and engines for the rollout tests (module-scoped: compiles are the cost)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

SHARPEN = 3.0  # scale random weights so the tiny model's distributions are peaked and varied


@dataclasses.dataclass
class TinyModel:
    config: object
    graphdef: object
    params: object
    tokenizer: object

    def full_logits(self, ids: list[int]) -> np.ndarray:
        """[len(ids), vocab] logits of the full (cache-free) forward.

        Right-padded to a fixed length so one compile serves every call (causal attention:
        padding after the real tokens changes nothing before it).
        """
        assert len(ids) <= FULL_FORWARD_LENGTH
        tokens = np.zeros((1, FULL_FORWARD_LENGTH), np.int32)
        tokens[0, : len(ids)] = ids
        mask = np.zeros((1, FULL_FORWARD_LENGTH), bool)
        mask[0, : len(ids)] = True
        return np.asarray(_jitted_forward(self.graphdef, self.params, tokens, mask)[0, : len(ids)])


FULL_FORWARD_LENGTH = 64


@functools.partial(jax.jit, static_argnums=0)
def _jitted_forward(graphdef, params, tokens, mask):
    from flexmarl_jax.models import functional

    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return functional.forward(graphdef, params, tokens, positions, mask)


def make_tiny_model(seed: int = 0) -> TinyModel:
    from flexmarl_jax.models import functional
    from flexmarl_jax.models.presets import get_preset
    from flexmarl_jax.models.tokenizer import CharTokenizer

    config = get_preset("tiny")
    graphdef, params = functional.init_params(config, seed=seed)
    params = jax.tree.map(lambda x: x * SHARPEN, params)
    # committed like the params an EngineInstance serves, so every test shares one set of compiles
    params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, params))
    return TinyModel(config, graphdef, params, CharTokenizer())


@pytest.fixture(scope="session")
def tiny_model() -> TinyModel:
    return make_tiny_model()


@pytest.fixture(scope="session")
def engine(tiny_model):
    """8 slots, prompts up to 32 tokens in buckets (8, 16, 32) prefilled 1 or 4 at a time, up to 24 new
    tokens; compiled once for the whole session."""
    from flexmarl_jax.rollout.engine import FlexEngine
    from tests.settings_views import engine_config

    config = engine_config(max_concurrent_decodes=8, max_prefill_length=32, max_decode_length=24,
                           prefill_buckets=(8, 16, 32), prefill_batch_sizes=(1, 4))
    engine = FlexEngine(tiny_model.config, tiny_model.graphdef, config, tiny_model.tokenizer, params=tiny_model.params)
    engine.warm_up(tiny_model.params)
    return engine


@pytest.fixture
def loop(engine, tiny_model):
    from flexmarl_jax.rollout.loop import RolloutLoop

    return RolloutLoop(engine, tiny_model.params)


def prompts_of_mixed_lengths(tokenizer, count: int, seed: int = 0, max_chars: int = 30) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    letters = "abcdefghij klmnop+-=0123456789"
    out = []
    for _ in range(count):
        length = int(rng.integers(1, max_chars + 1))
        out.append(tuple(tokenizer.encode("".join(rng.choice(list(letters), size=length)))))
    return out
