"""A short supervised warm-up that teaches each agent its output format, not the task.

Randomly initialised tiny models emit noise, so RL would first spend many iterations discovering that an
answer is a few digits followed by EOS. The warm-up runs the workflow with scripted policies that answer
in the right format but are right only `accuracy` of the time, and fits every agent to what it said there
(prompt -> completion) for a few steps. The policy that RL starts from is thus well-formed and not already
good; the first RL iteration's accuracy is the baseline that training must improve on.

The supervised step reuses the agent's trainer: a policy-gradient step with advantage 1 on the current
policy's own log-probs is exactly the gradient of the mean log-likelihood.
"""

from __future__ import annotations

import logging
import random
import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from flexmarl_jax.train.batch import build_micro_batch
from flexmarl_jax.train.normalizers import IterationNormalizers
from flexmarl_jax.train.trainer import AgentTrainer
from flexmarl_jax.workflows import InMemorySink, SamplingParams, ScriptedBackend, Task, Workflow, WorkflowExecutor
from flexmarl_jax.workflows.oracles import PromptOracle, answer_policy, chain_policies

if TYPE_CHECKING:
    from flexmarl_jax.orchestrator.agents import AgentRuntime

logger = logging.getLogger(__name__)


def warmup_examples(workflow: Workflow, task: Task, *, queries: int, samples_per_query: int, accuracy: float,
                    seed: int) -> dict[str, list[tuple[str, str]]]:
    """agent -> [(prompt, completion)] from a scripted run of the workflow with format-correct answers."""
    problems = task.generate(queries, seed=zlib.crc32(f"warmup/{seed}".encode()))
    if workflow.name == "chain":
        roles = [workflow.nodes[name].agent for name in ("solver", "verifier", "corrector")]
        by_role = chain_policies(problems, task.verify, solver_accuracy=accuracy, verifier_accuracy=0.5,
                                 corrector_accuracy=accuracy)
        policies = dict(zip(roles, by_role.values(), strict=True))
    else:
        policy = answer_policy(PromptOracle(problems), accuracy)
        policies = {agent: policy for agent in workflow.agents}
    sink = InMemorySink()
    with ScriptedBackend(policies, seed=seed) as backend:
        executor = WorkflowExecutor(workflow, backend, task, samples_per_query=samples_per_query,
                                    sampling=SamplingParams(max_new_tokens=64))
        executor.run(problems, sink)
    examples: dict[str, list[tuple[str, str]]] = {agent: [] for agent in workflow.agents}
    for (agent, _), record in sorted(sink.records.items()):
        examples[agent].append((record.prompt, record.text))
    return examples


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
               *, steps: int, seed: int) -> dict[str, float]:
    """`steps` supervised updates per agent, each on its own tokenizer's ids; returns agent -> final loss.
    Versions are reset to 0 after, so policy versions count RL updates only."""
    rng = random.Random(seed)  # one stream over the agents in order
    losses = {}
    for agent, runtime in agents.items():
        trainer, tokenizer = runtime.trainer, runtime.tokenizer
        encoded = [(tokenizer.encode(prompt), tokenizer.encode(text, add_bos=False) + [tokenizer.eos_id])
                   for prompt, text in examples[agent]]
        if not encoded:
            continue
        size = trainer.config.micro_batch_size
        for _ in range(steps):
            metrics = supervised_step(trainer, [rng.choice(encoded) for _ in range(size)], pad_id=tokenizer.pad_id)
        losses[agent] = float(metrics.get("loss", float("nan")))
        trainer.policy_version = 0  # the warm-up precedes RL's first policy
        logger.info("warm-up of %s: %d steps on %d examples, final loss %.3f", agent, steps, len(encoded),
                    losses[agent])
    return losses
