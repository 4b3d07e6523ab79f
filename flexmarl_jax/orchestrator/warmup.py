"""A short supervised warm-up before RL: each agent is fitted to (prompt -> completion) examples.

The examples come from `workflows.warmup_data.warmup_examples`: a scripted run of the workflow on training
problems only, whose answers teach the output format alone (`format`) or right answers (`sft`); see there.
The start-of-RL eval (orchestrator/evaluation.py) measures what the warm-up left.

The supervised step reuses the agent's trainer: a policy-gradient step with advantage 1 on the current
policy's own log-probs is exactly the gradient of the mean log-likelihood.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from flexmarl_jax.train.batch import build_micro_batch
from flexmarl_jax.train.normalizers import IterationNormalizers
from flexmarl_jax.train.trainer import AgentTrainer
from flexmarl_jax.workflows.warmup_data import warmup_examples

if TYPE_CHECKING:
    from flexmarl_jax.orchestrator.agents import AgentRuntime

logger = logging.getLogger(__name__)

__all__ = ["run_warmup", "supervised_step", "warmup_examples"]


def supervised_step(trainer: AgentTrainer, pairs: list[tuple[list[int], list[int]]], *, pad_id: int) -> dict:
    """One update that raises the log-likelihood of `pairs` ([(prompt ids, completion ids)])."""
    rows = len(pairs)
    normalizers = IterationNormalizers(total_tokens=sum(len(c) for _, c in pairs), num_sequences=rows,
                                       norm_length=max(len(c) for _, c in pairs))
    batch = build_micro_batch(
        agent=trainer.agent, prompt_ids=[p for p, _ in pairs], response_ids=[c for _, c in pairs],
        behaviour_logprobs=[np.zeros(len(c), np.float32) for _, c in pairs], advantages=[1.0] * rows,
        normalizers=normalizers, aggregation="token_mean", batch_size=trainer.config.micro_batch_size,
        max_len=trainer.config.max_len, pad_id=pad_id)
    config = trainer.config
    if not config.old_logprobs_in_step or config.loss.tis_cap is not None:
        # Only then does the loss read these; otherwise the step computes its own old log-probs and the IS
        # weight is 1, so a separate forward pass would be wasted. Behaviour = the old sampling log-probs: weight 1.
        current, sampling = trainer.logprobs(batch), trainer.logprobs(batch, which="sampling")
        batch = batch.replace(old_logprobs=current, old_sampling_logprobs=sampling, behaviour_logprobs=sampling)
    trainer.accumulate(batch)
    return trainer.apply()


def run_warmup(agents: Mapping[str, AgentRuntime], examples: Mapping[str, list[tuple[str, str]]],
               *, steps: int, seed: int, learning_rate: float | None = None) -> dict[str, float]:
    """`steps` supervised updates per agent, each on its own tokenizer's ids; returns agent -> final loss.

    The warm-up is its own training: it runs with a fresh optimizer at `learning_rate` (None: the agent's own),
    and RL then starts from another fresh optimizer at the agent's learning rate (`AgentTrainer.reset_optimizer`
    says why); the KL's reference, when kept, is the warmed-up policy. Versions are reset to 0 after, so policy
    versions count RL updates only."""
    rng = random.Random(seed)  # one stream over the agents in order
    losses = {}
    for agent, runtime in agents.items():
        trainer, tokenizer = runtime.trainer, runtime.tokenizer
        encoded = [(tokenizer.encode(prompt), tokenizer.encode(text, add_bos=False) + [tokenizer.eos_id])
                   for prompt, text in examples[agent]]
        if not encoded:
            continue
        size = trainer.config.micro_batch_size
        rl_optimizer = trainer.config.optimizer
        warmup_optimizer = (rl_optimizer if learning_rate is None
                            else dataclasses.replace(rl_optimizer, learning_rate=learning_rate))
        trainer.reset_optimizer(warmup_optimizer)
        for _ in range(steps):
            metrics = supervised_step(trainer, [rng.choice(encoded) for _ in range(size)], pad_id=tokenizer.pad_id)
        trainer.reset_optimizer(rl_optimizer)
        trainer.reset_reference()  # the KL (train.kl_coef) holds RL to the warmed-up policy, not the initial one
        losses[agent] = float(metrics.get("loss", float("nan")))
        trainer.policy_version = 0  # the warm-up precedes RL's first policy
        logger.info("warm-up of %s: %d steps on %d examples, final loss %.3f", agent, steps, len(encoded),
                    losses[agent])
    return losses
