"""Fixtures for trainer tests: a random iteration of store-like rows and a tiny model config."""

import jax
import numpy as np
import pytest

from flexmarl_jax.models import functional
from flexmarl_jax.train.batch import build_iteration
from flexmarl_jax.train.trainer import AgentTrainer
from tests.settings_views import loss_config, optimizer_config, trainer_config


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


MAX_LEN = 12  # prompts <= 5 + responses <= 8 tokens, minus the last target
FULL = 32  # one micro-batch holds the whole iteration
LOSS = loss_config(aggregation="token_mean", kl_coef=0.05, tis_cap=2.0)  # every term on
# eps=1e-6: with 1e-8 the first Adam step is ~lr*sign(g), which turns summation-order noise on
# coordinates whose gradient is ~1e-9 (k_bias has an analytically zero gradient) into O(lr) changes.
ADAM = optimizer_config(name="adam", learning_rate=1e-2, eps=1e-6, max_grad_norm=None)


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| over all leaves (host numpy, float64)."""
    a = [np.asarray(x, np.float64) for x in jax.device_get(jax.tree.leaves(a))]
    b = [np.asarray(y, np.float64) for y in jax.device_get(jax.tree.leaves(b))]
    num = sum(float(np.sum((x - y) ** 2)) for x, y in zip(a, b, strict=True))
    return (num / sum(float(np.sum(y**2)) for y in b)) ** 0.5


def all_zero(tree) -> bool:
    return all(not np.any(np.asarray(x)) for x in jax.device_get(jax.tree.leaves(tree)))


@pytest.fixture(scope="session")
def initial(tiny_model_config):
    """(graphdef, params) on one device, shared so every trainer starts from the same weights."""
    return functional.init_params(tiny_model_config, seed=0)


def make_trainer(cfg, initial, micro, *, agent="solver", mesh=None, loss=LOSS, optimizer=ADAM):
    config = trainer_config(micro_batch_size=micro, max_len=MAX_LEN, loss=loss, optimizer=optimizer)
    return AgentTrainer(agent, cfg, config, mesh=mesh, initial=initial)


def run_iteration(trainer, rows, micro, aggregation=LOSS.aggregation):
    for batch in build_iteration(agent=trainer.agent, aggregation=aggregation, micro_batch_size=micro,
                                 max_len=MAX_LEN, **rows):
        trainer.accumulate(batch)
