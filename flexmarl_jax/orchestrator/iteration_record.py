"""What one pipeline iteration writes to metrics.jsonl about each agent and about the training pool, built from
the iteration's rollout result, dispatch stats and the trainers' metrics."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from flexmarl_jax.metrics import Timeline
from flexmarl_jax.orchestrator.dispatch import DispatchStats
from flexmarl_jax.orchestrator.shared_training import TrainingPool
from flexmarl_jax.workflows import RunResult


def train_pool_record(timeline: Timeline, agents: Iterable[str], training: TrainingPool, t0: float, t1: float,
                      pool_t0: float) -> dict:
    """Training-pool utilization over [t0, t1]: gradient/update seconds of every agent / (slices x wall).

    Slices: the shared pool's S, or one dedicated mesh per agent (static binding); a shared pool adds ``held``,
    the fraction of slice time leased to some agent, and its move counts.
    """
    agents = list(agents)
    resources = {f"train/{agent}" for agent in agents}
    compute = sum(max(0.0, min(i.end, t1) - max(i.start, t0))
                  for i in timeline.intervals(include_open=True, overlapping=(t0, t1))
                  if i.kind == "train" and i.resource in resources)
    slices = training.num_slices
    return {"slices": slices, "agents": len(agents), "busy_s": compute,
            "utilization": compute / (slices * max(t1 - t0, 1e-9)), **training.usage(pool_t0)}


def agent_records(agents: Iterable[str], result: RunResult, stats: Mapping[str, DispatchStats],
                  train_metrics: Mapping[str, dict], consumed: Mapping[str, int]) -> dict[str, dict]:
    """Per agent: its rollout (reward, the team accuracy of the trajectories it served, requests), what it
    trained (samples, micro-batches, entropy of the trained tokens) and its trainer's metrics."""
    agents = list(agents)
    served: dict[str, list[float]] = {agent: [] for agent in agents}
    for trajectory in result.trajectories:
        for output in trajectory.outputs.values():
            served[output.agent].append(trajectory.team_reward)
    records = {}
    for agent in agents:
        metrics = train_metrics.get(agent, {})
        rewards = stats[agent].rewards
        records[agent] = {
            "reward": float(np.mean(rewards)) if rewards else None,
            "accuracy": float(np.mean(served[agent])) if served[agent] else None,
            "samples": consumed[agent],
            "micro_batches": stats[agent].micro_batches,
            "first_claim_s": stats[agent].first_claim_s,
            "requests": result.load[agent].requests if agent in result.load else 0,
            # later turns skipped because quoted responses pushed their prompt past rollout.max_prompt_length
            "overflowed": result.load[agent].overflowed if agent in result.load else 0,
            "entropy": stats[agent].neg_logprob_sum / stats[agent].tokens if stats[agent].tokens else None,
            "kl": metrics.get("kl"),
            "clip_frac": metrics.get("clip_fraction"),
            # truncated importance sampling (max_staleness > 0), over the iteration's tokens; None when off
            "is_weight_mean": metrics.get("is_weight_mean"),
            "is_weight_max": metrics.get("is_weight_max"),
            "is_clip_fraction": metrics.get("is_clip_fraction"),
            "loss": metrics.get("loss"),
            "value_loss": metrics.get("value_loss"),  # ppo: the critic's
            "grad_norm": metrics.get("grad_norm"),
            # rows whose advantage was 0 throughout, not computed: they add nothing (train/rows_without_signal.py)
            "skipped_rows": metrics.get("skipped_rows"),
        }
    return records
