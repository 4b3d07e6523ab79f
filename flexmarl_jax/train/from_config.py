"""TrainerConfig for one agent from the run's typed config (`flexmarl_jax.config.RunConfig`).

Reads only: train.{algorithm, learning_rate, micro_batch_size, rows_per_pass, pack_rows, skip_rows_without_signal,
max_staleness, tis_cap, remat, kl_coef},
rollout.{max_prompt_length, max_response_length} and agents.<name>.{learning_rate, dtype, fp32_master_weights,
temperature, top_k, top_p, lora}. `TrainerConfig`, its `OptimizerConfig` and `LossConfig` have no defaults of their own:
what a run does not choose is set here (`OPTIMIZER_SETTINGS`, the in-step flags) and in the algorithm's loss
preset (`algorithms.LOSS_SETTINGS`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flexmarl_jax.models.lora import LoraSpec
from flexmarl_jax.train.algorithms import loss_config_for
from flexmarl_jax.train.losses import LossConfig
from flexmarl_jax.train.optim import OptimizerConfig
from flexmarl_jax.train.trainer import TrainerConfig

if TYPE_CHECKING:
    from flexmarl_jax.config import RunConfig

# The optimizer settings a run does not choose (no `RunConfig` field); the learning rate is the agent's.
OPTIMIZER_SETTINGS = dict(name="adamw", weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, max_grad_norm=1.0)


def run_loss_config(config: RunConfig, **overrides) -> LossConfig:
    """The run's loss: `train.algorithm`'s preset with the run's `train.kl_coef`, then `overrides`. Every place
    that needs the loss (trainers, the pipeline's advantages, the memory estimate's reference model) takes it
    from here."""
    return loss_config_for(config.train.algorithm, **{"kl_coef": config.train.kl_coef, **overrides})


def trainer_config_for(config: RunConfig, agent: str, **loss_overrides) -> TrainerConfig:
    """The TrainerConfig of ``agent``: its own learning rate (or train.learning_rate when -1), dtype and
    master weights, the run's algorithm and remat, micro-batches of ``micro_batch_size`` rows and at most
    ``max_prompt_length + max_response_length - 1`` tokens, and truncated IS capped at ``train.tis_cap`` when
    ``max_staleness > 0`` (rows may then come from an older policy), comparing under the agent's sampling
    distribution (its temperature, top-k, top-p)."""
    if agent not in config.agents:
        raise ValueError(f"unknown agent {agent!r}; configured agents: {sorted(config.agents)}")
    settings = config.agents[agent]
    agent_lr = settings.learning_rate
    learning_rate = agent_lr if agent_lr > 0 else config.train.learning_rate
    if config.train.max_staleness > 0:
        loss_overrides.setdefault("tis_cap", config.train.tis_cap)
    return TrainerConfig(
        micro_batch_size=config.train.micro_batch_size,
        max_len=config.rollout.max_prompt_length + config.rollout.max_response_length - 1,
        loss=run_loss_config(config, **loss_overrides),
        optimizer=OptimizerConfig(learning_rate=learning_rate, **OPTIMIZER_SETTINGS),
        reference_in_step=True,  # the KL's reference log-probs from a frozen copy of the initial policy
        old_logprobs_in_step=True,  # the old policy is the parameters of the iteration (exact, no extra pass)
        donate_params=False,  # a colocated engine may still hold the trainer's parameters
        dtype=settings.dtype,
        fp32_master_weights=settings.fp32_master_weights,
        remat=config.train.remat,
        rows_per_pass=config.train.rows_per_pass,
        pack_rows=config.train.pack_rows,
        skip_rows_without_signal=config.train.skip_rows_without_signal,
        sampling_temperature=settings.temperature,
        sampling_top_k=settings.top_k,
        sampling_top_p=settings.top_p,
        lora=LoraSpec(settings.lora.rank, settings.lora.alpha, settings.lora.target_names),
    )
