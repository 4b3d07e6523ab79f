"""`TrainerConfig`: the static settings of one agent's trainer (its view of the run config is built by
`train.from_config.trainer_config_for`); the trainer (trainer.py) and its jitted steps (steps.py) read it.

It has no defaults of its own: every field comes from the builder (a test builds one from `RunConfig()` and
replaces what it needs), and every rule it checks that the config checks too is one function both call
(`train/rules.py`, `models/dtypes.master_weights_problem`).
"""

from __future__ import annotations

import dataclasses

from flexmarl_jax.models.dtypes import PARAM_DTYPES, master_weights_problem
from flexmarl_jax.models.lora import LoraSpec
from flexmarl_jax.train.batch import length_buckets
from flexmarl_jax.train.losses import LossConfig
from flexmarl_jax.train.optim import OptimizerConfig
from flexmarl_jax.train.rules import rows_per_pass_problem, temperature_problem, top_k_problem, top_p_problem


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Static settings of one agent's trainer."""

    micro_batch_size: int  # rows per micro-batch (the static batch dim of every step)
    max_len: int  # longest sequence of a micro-batch (prompt + response - 1 fits in it); the last length bucket
    loss: LossConfig
    optimizer: OptimizerConfig
    # When the KL is on, compute reference log-probs inside the step from a frozen copy of the initial
    # policy; False uses the `ref_logprobs` the micro-batch carries.
    reference_in_step: bool
    # The parameters do not change inside an iteration, so they *are* the old policy: take the PPO
    # ratio's denominator from the same forward pass (exact, no extra pass, ratio == 1), and the truncated
    # IS weight's numerator, the old policy's sampling distribution (below), from the same logits.
    # False uses batch.old_logprobs and batch.old_sampling_logprobs.
    old_logprobs_in_step: bool
    # How the agent's rollouts sample: the engine records behaviour log-probs of this distribution
    # (models/sampling_distribution.py), so the truncated IS weight evaluates the old policy under it too.
    # A top-k or top-p filter sorts the vocabulary at every trained position (with truncated IS only).
    sampling_temperature: float
    sampling_top_k: int  # 0 = no top-k filter
    sampling_top_p: float
    # Donating params saves one parameter copy at apply time, but invalidates arrays anyone else still
    # holds (e.g. a colocated rollout engine that received `trainer.params`), so it is opt-in.
    donate_params: bool
    dtype: str  # parameters and compute: a name in models/dtypes.PARAM_DTYPES
    fp32_master_weights: bool  # bfloat16 only: the optimizer updates a float32 copy of the parameters
    remat: bool  # recompute each decoder layer in the backward pass instead of keeping its activations
    # Rows one forward+backward pass takes (0 = the whole micro-batch): a micro-batch is split into passes of
    # this many rows whose gradients add up in the accumulator, so peak activation memory (the float32
    # logits over a 150k vocabulary above all) follows this, not the micro-batch the pipeline claims.
    rows_per_pass: int
    # Pack each micro-batch's sequences end to end into as few rows as hold them (train/packing.py): the step
    # computes the bins, not the padding of a long-tailed batch; loss and gradients are unchanged.
    pack_rows: bool
    # Leave out of the step the rows whose gradient is exactly 0 (advantage 0 throughout), where that is exact
    # (train/rows_without_signal.py says when): the update and the metrics are the same.
    skip_rows_without_signal: bool
    # rank 0: train the whole model; else a LoRA adapter (float32) on the frozen base parameters, which are
    # `dtype` (train/steps.py)
    lora: LoraSpec

    def __post_init__(self):
        if self.micro_batch_size < 1 or self.max_len < 2:
            raise ValueError(f"micro_batch_size={self.micro_batch_size} must be >= 1 and "
                             f"max_len={self.max_len} >= 2")
        problem = rows_per_pass_problem(self.rows_per_pass, self.micro_batch_size)
        if problem:
            raise ValueError(problem)
        if self.dtype not in PARAM_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not allowed; choose one of: {', '.join(PARAM_DTYPES)}")
        problem = master_weights_problem(self.dtype, self.fp32_master_weights)
        if problem:
            raise ValueError(problem)
        for name, rule in (("sampling_temperature", temperature_problem), ("sampling_top_k", top_k_problem),
                           ("sampling_top_p", top_p_problem)):
            problem = rule(getattr(self, name))
            if problem:
                raise ValueError(f"{name}={getattr(self, name)!r} {problem}")

    @property
    def pass_rows(self) -> int:
        """Rows of one forward+backward pass."""
        return self.rows_per_pass or self.micro_batch_size

    @property
    def length_buckets(self) -> tuple[int, ...]:
        """Sequence lengths a micro-batch may have (one compile of each step per length)."""
        return length_buckets(self.max_len)
