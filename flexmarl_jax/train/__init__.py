"""Training: GRPO/PPO losses, advantage estimators and per-agent trainers.

Public names are imported lazily (this package is JAX-heavy; `import flexmarl_jax.train` stays cheap):

    AgentTrainer                       trainer.py   sharded params/opt state, accumulate(), apply() (steps.py)
    TrainerConfig                      trainer_config.py  a trainer's static settings
    MicroBatch, build_micro_batch,     batch.py     static-shape micro-batches from store rows
    build_iteration, validate_micro_batch
    IterationNormalizers               normalizers.py  iteration-wide counts fixed before dispatch
    LossConfig, LOSSES                 losses.py    "grpo" (GRPO/Dr.GRPO/DAPO, k3 KL, TIS), "ppo"
    ALGORITHMS, loss_config_for        algorithms.py   "grpo" | "drgrpo" | "dapo" | "ppo"
    ADVANTAGES, group_advantages, gae, advantages.py
    gae_from_rewards
    OptimizerConfig, make_optimizer    optim.py
    save_trainer, restore_trainer,     checkpoint.py   Orbax checkpoints, restore onto any mesh
    save_all, restore_all
    trainer_config_for                 from_config.py  an agent's TrainerConfig from the run config
"""

import importlib

_EXPORTS = {
    "AgentTrainer": "trainer", "TrainerConfig": "trainer_config",
    "MicroBatch": "batch", "build_micro_batch": "batch", "build_iteration": "batch",
    "validate_micro_batch": "batch",
    "IterationNormalizers": "normalizers",
    "LossConfig": "losses", "LOSSES": "losses",
    "ALGORITHMS": "algorithms", "loss_config_for": "algorithms",
    "ADVANTAGES": "advantages", "group_advantages": "advantages", "gae": "advantages",
    "gae_from_rewards": "advantages",
    "OptimizerConfig": "optim", "make_optimizer": "optim",
    "save_trainer": "checkpoint", "restore_trainer": "checkpoint", "save_all": "checkpoint",
    "restore_all": "checkpoint", "trainer_config_for": "from_config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flexmarl_jax.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"flexmarl_jax.train.{_EXPORTS[name]}"), name)
