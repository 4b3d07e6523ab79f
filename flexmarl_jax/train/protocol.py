"""`Trainer`: what the pipeline and the dispatchers use of an agent's trainer.

Three classes implement it: `AgentTrainer` (train/trainer.py: the real one, on its own mesh), `PooledTrainer`
(orchestrator/shared_training.py: an `AgentTrainer` whose state moves between shared training slices) and
`EmulatedTrainer` (emulation/trainer.py: the cost model's time, no math). The orchestrator types against this,
so any of them can stand in; `isinstance(x, Trainer)` checks the members are there (not their signatures).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from flexmarl_jax.train.batch import MicroBatch
    from flexmarl_jax.train.trainer import TrainerConfig


@runtime_checkable
class Trainer(Protocol):
    agent: str
    config: TrainerConfig  # the dispatchers read max_len and the loss
    policy_version: int  # updates applied so far

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches accumulated since the last `apply`."""

    @property
    def params(self) -> Any:
        """The policy parameters (a LoRA agent's with its adapter merged)."""

    @property
    def rollout_weights(self) -> Any:
        """What a weight sync sends: the policy parameters, or a LoRA agent's `AgentAdapter` alone."""

    def activate(self) -> None:
        """Holds training devices before a micro-batch (a shared slice; nothing for a dedicated mesh)."""

    def release(self) -> None:
        """Lets other agents use the training devices while this one has nothing to train."""

    def accumulate(self, batch: MicroBatch) -> None:
        """Adds the micro-batch's gradient to the accumulator; parameters do not change."""

    def apply(self, *, allow_empty: bool = False) -> dict[str, float]:
        """One optimizer step with the accumulated gradient; policy_version += 1; returns the metrics."""

    def discard_accumulated(self) -> None:
        """Drops the accumulated gradient without an update."""

    def accumulated_gradients(self) -> Any:
        """The float32 gradient sum so far."""

    def values(self, batch: MicroBatch) -> np.ndarray:
        """Critic values of the batch (PPO)."""
