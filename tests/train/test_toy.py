"""The trainer learns: single-agent GRPO on the toy repeat-the-char task (short version of the bench)."""

import jax
import numpy as np
import pytest

from flexmarl_jax.models.presets import get_preset
from flexmarl_jax.models.tokenizer import CharTokenizer
from flexmarl_jax.train.algorithms import loss_config_for
from flexmarl_jax.train.batch import build_iteration
from flexmarl_jax.train.toy import RepeatCharTask, run_grpo, sample
from flexmarl_jax.train.trainer import AgentTrainer
from tests.settings_views import optimizer_config, trainer_config


def test_task_reward():
    tok = CharTokenizer()
    task = RepeatCharTask(response_length=4)
    assert task.reward("a", tok.encode("abaa", add_bos=False), tok) == 0.75
    assert task.reward("b", [tok.eos_id] * 4, tok) == 0.0


# One config for both trainer tests so they share compiled steps.
CONFIG = trainer_config(micro_batch_size=16, max_len=10, loss=loss_config_for("grpo"),
                        optimizer=optimizer_config(learning_rate=1e-2))


def test_sampler_logprobs_match_trainer_scoring():
    trainer = AgentTrainer("solver", get_preset("tiny"), CONFIG, seed=3)
    tok = CharTokenizer()
    prompts = np.asarray([tok.encode("a:")] * 16, np.int32)
    tokens, logprobs = sample(trainer.graphdef, trainer.params, prompts, jax.random.key(0), 8)
    assert tokens.shape == (16, 8) and logprobs.shape == (16, 8)
    batch = build_iteration(agent="solver", prompt_ids=prompts.tolist(), response_ids=np.asarray(tokens).tolist(),
                            behaviour_logprobs=np.asarray(logprobs).tolist(), advantages=[0.0] * 16,
                            aggregation="seq_mean", micro_batch_size=16, max_len=10)[0]
    scored = trainer.logprobs(batch)
    np.testing.assert_allclose(scored[batch.loss_mask], batch.behaviour_logprobs[batch.loss_mask], atol=1e-4)


@pytest.mark.timeout(120)
def test_grpo_raises_mean_reward():
    trainer = AgentTrainer("solver", get_preset("tiny"), CONFIG, seed=0)
    rewards = run_grpo(trainer, iterations=12, prompts_per_iteration=8, group_size=8, seed=0)
    before, after = np.mean(rewards[:3]), np.mean(rewards[-3:])
    assert trainer.policy_version == 12
    assert after > 0.05 and after > 3 * before, rewards
