"""A toy verifiable task and a minimal sampler, to check that a trainer actually learns.

Task "repeat-the-char": the prompt is ``"<c>:"`` for a target character ``c``; the reward of a
response is the fraction of its characters equal to ``c``. A tiny char model starts near 1/vocab and
GRPO drives it up within tens of iterations. The sampler runs full-sequence `forward` over a fixed
``[batch, prompt + new]`` buffer (no KV cache: the rollout engine is the production path), all inside
one jitted ``fori_loop``, and records behaviour log-probs as an engine would.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from flexmarl_jax.models import functional
from flexmarl_jax.models.tokenizer import CharTokenizer
from flexmarl_jax.train.advantages import group_advantages
from flexmarl_jax.train.batch import build_iteration
from flexmarl_jax.train.trainer import AgentTrainer


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def sample(graphdef, params, prompts, key, max_new_tokens: int, temperature: float = 1.0):
    """Samples ``max_new_tokens`` tokens after equal-length ``prompts`` [B, P] int32.

    Returns (tokens [B, N] int32, behaviour log-probs [B, N] float32 of the sampled tokens under the
    tempered distribution).
    """
    batch, prompt_len = prompts.shape
    total = prompt_len + max_new_tokens
    buffer = jnp.zeros((batch, total), jnp.int32).at[:, :prompt_len].set(prompts)
    positions = jnp.broadcast_to(jnp.arange(total, dtype=jnp.int32), (batch, total))
    logprobs = jnp.zeros((batch, max_new_tokens), jnp.float32)

    def step(i, carry):
        buffer, logprobs, key = carry
        key, sub = jax.random.split(key)
        length = prompt_len + i
        mask = positions < length  # right padding: only the tokens produced so far are real
        logits = functional.forward(graphdef, params, buffer, positions, mask)
        last = jax.lax.dynamic_index_in_dim(logits, length - 1, axis=1, keepdims=False) / temperature
        token = jax.random.categorical(sub, last).astype(jnp.int32)
        picked = jnp.take_along_axis(jax.nn.log_softmax(last), token[:, None], axis=-1)[:, 0]
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, token, length, axis=1)
        logprobs = jax.lax.dynamic_update_index_in_dim(logprobs, picked, i, axis=1)
        return buffer, logprobs, key

    buffer, logprobs, _ = jax.lax.fori_loop(0, max_new_tokens, step, (buffer, logprobs, key))
    return buffer[:, prompt_len:], logprobs


@dataclasses.dataclass(frozen=True)
class RepeatCharTask:
    """Prompts ``"<c>:"``; reward = fraction of response characters equal to ``c``."""

    targets: str = "abcd"
    response_length: int = 8

    def prompt(self, target: str, tokenizer: CharTokenizer) -> list[int]:
        return tokenizer.encode(f"{target}:")

    def reward(self, target: str, response_ids, tokenizer: CharTokenizer) -> float:
        text = tokenizer.decode(list(response_ids))
        return sum(ch == target for ch in text) / self.response_length


def run_grpo(trainer: AgentTrainer, *, iterations: int, prompts_per_iteration: int, group_size: int,
             seed: int = 0, task: RepeatCharTask = RepeatCharTask()) -> list[float]:
    """Single-agent GRPO on the toy task; returns the mean reward of every iteration's rollouts.

    Each iteration: sample ``prompts_per_iteration x group_size`` responses with the current params,
    score them, compute group advantages over the whole iteration, accumulate all micro-batches,
    apply once. The trainer's ``micro_batch_size`` must divide ``prompts_per_iteration * group_size``.
    """
    tokenizer = CharTokenizer()
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    mean_rewards = []
    for _ in range(iterations):
        targets = [task.targets[i] for i in rng.integers(len(task.targets), size=prompts_per_iteration)]
        targets = [t for t in targets for _ in range(group_size)]
        prompts = np.asarray([task.prompt(t, tokenizer) for t in targets], np.int32)
        key, sub = jax.random.split(key)
        responses, logprobs = jax.device_get(sample(trainer.graphdef, trainer.params, prompts, sub,
                                                    task.response_length))
        rewards = [task.reward(t, r, tokenizer) for t, r in zip(targets, responses, strict=True)]
        mean_rewards.append(float(np.mean(rewards)))
        group_ids = [i // group_size for i in range(len(targets))]
        advantages = group_advantages(rewards, group_ids, trainer.config.loss.advantage_estimator)
        batches = build_iteration(
            agent=trainer.agent, prompt_ids=prompts.tolist(), response_ids=responses.tolist(),
            behaviour_logprobs=logprobs.tolist(), advantages=list(advantages),
            aggregation=trainer.config.loss.aggregation, micro_batch_size=trainer.config.micro_batch_size,
            max_len=trainer.config.max_len, pad_id=tokenizer.pad_id)
        for batch in batches:
            trainer.accumulate(batch)
        trainer.apply()
    return mean_rewards
