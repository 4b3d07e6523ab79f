"""`EmulatedTrainer`: an agent's trainer that does no math; each call takes the cost model's device time.

It answers what the orchestrator and the dispatchers ask of an `AgentTrainer` (`accumulate`, `apply`,
`policy_version`, `pending_micro_batches`, `params`, `activate` / `release`, `accumulated_gradients`,
`discard_accumulated`, `values`, `config`), so the real pipeline, store and allocation run above it.

What a call costs (device seconds, see cost_model.py), waited out on the trainer's own `DeviceQueue`:
* `accumulate(batch)`: `train_micro_batch_s(rows, length)`: rows = the micro-batch's real rows (padding rows
  carry no tokens), length = its longest real row (a static-shape trainer pads every row to it);
* `apply()`: `optimizer_apply_s()` when something was accumulated (an empty apply only advances the version);
* `values(batch)` (PPO's critic): one forward pass = a third of a training step, values all zero.
The call blocks until its work is done, so a dispatcher's "train" interval is the emulated step.

`charges` keeps one `Charge` per call: what a run, or a test, compares the timeline with.

Shared training slices: with a `slices` pool (`EmulatedSharedTraining.make_pool`) `activate` leases a slice
(blocking while all are held) and `release` hands it back. A lease of a slice that does not still hold the
agent's state is charged the state's move ("swap": `CostModel.state_move_s` over `HOST_LINK`, twice when
another agent's state parked there goes out first).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from flexmarl_jax.emulation.chips import LINKS
from flexmarl_jax.emulation.cost_model import CostModel
from flexmarl_jax.emulation.engine import DeviceQueue, placeholder_params
from flexmarl_jax.emulation.timescale import TimeScale
from flexmarl_jax.train.packing import packed_bin_counts, packed_shape

# How a training slice's chips reach the host, for state swaps (a stated assumption, not a spec sheet's: PCIe
# 5.0 x16 per chip, as on current accelerator hosts).
HOST_LINK = LINKS["pcie5"]


@dataclasses.dataclass(frozen=True)
class Charge:
    """One emulated trainer call: its kind ("micro_batch", "apply", "empty_apply", "values"), the shape it was
    charged for (rows x length: the padded or packed tokens the step computes), its device seconds, and the
    real tokens in it (attended positions; a micro-batch's only)."""

    kind: str
    rows: int
    length: int
    device_s: float
    real_tokens: int = 0


def micro_batch_shape(batch: Any) -> tuple[int, int]:
    """(real rows, longest real row) of a MicroBatch: rows with any attended position, and their length."""
    mask = np.asarray(batch.attention_mask)
    lengths = mask.reshape(mask.shape[0], -1).sum(axis=1)
    real = lengths[lengths > 0]
    return int(real.size), int(real.max()) if real.size else 0


class EmulatedTrainer:
    """One agent's trainer on emulated chips (`cost_model` is its training mesh: model, chip, chips, mfu).

    config: the agent's real `TrainerConfig` (dispatchers read `max_len` and the loss from it).
    slices: the shared training pool it leases from, or None (a dedicated mesh: activate/release are no-ops).
    """

    def __init__(self, agent: str, cost_model: CostModel, config: Any, *, timescale: TimeScale,
                 slices: Any = None, clock: Callable[[], float] = time.perf_counter, device: DeviceQueue | None = None):
        self.agent, self.cost_model, self.config = agent, cost_model, config
        self.device = device if device is not None else DeviceQueue(timescale, clock)
        self.slices = slices
        self.policy_version = 0
        self.pending_micro_batches = 0
        self.params = placeholder_params()  # what a weight sync sends (its cost is the sync's own)
        self.rollout_weights = self.params
        self.charges: list[Charge] = []
        self._lease = None
        self._lock = threading.RLock()

    # ----------------------------------------------------------------------------------- residency
    @property
    def active(self) -> bool:
        return self.slices is None or self._lease is not None

    def activate(self) -> None:
        """Holds a training slice (blocks until one is free); no-op on a dedicated mesh or when held. Unless the
        slice still holds this agent's state (it was the last to use it), the state moves: another agent's
        state parked on the slice goes to the host first, then this agent's comes in, each over every chip's
        host link (`HOST_LINK`), charged as "swap" on this trainer's device (as `SharedTraining` moves it)."""
        with self._lock:
            if self.slices is not None and self._lease is None:
                lease = self._lease = self.slices.acquire(self.agent)
                if not (lease.reused and lease.previous_agent == self.agent):
                    moves = 1 + (lease.previous_agent is not None)  # in, after the parked state goes out
                    self._run("swap", 0, 0, moves * self.cost_model.state_move_s(HOST_LINK))

    def release(self) -> None:
        """Frees the slice (no-op on a dedicated mesh or when none is held)."""
        with self._lock:
            if self._lease is not None:
                self._lease = None
                self.slices.release(self.agent)

    # ----------------------------------------------------------------------------------- the calls
    def _run(self, kind: str, rows: int, length: int, device_s: float, real_tokens: int = 0) -> None:
        self.device.run(device_s)
        self.charges.append(Charge(kind, rows, length, device_s, real_tokens))

    def _charged_shape(self, batch: Any) -> tuple[int, int]:
        """What the real trainer's step computes: (real rows, longest row), or with `pack_rows` (bins, the
        batch's length), the bins packed as train/packing.py packs them, attention dense over each bin."""
        if not self.config.pack_rows:
            return micro_batch_shape(batch)
        return packed_shape(batch, packed_bin_counts(self.config.micro_batch_size, self.config.pass_rows))

    def accumulate(self, batch: Any) -> None:
        with self._lock:
            self.activate()
            rows, length = self._charged_shape(batch)
            self._run("micro_batch", rows, length, self.cost_model.train_micro_batch_s(rows, length) if rows else 0.0,
                      real_tokens=int(np.asarray(batch.attention_mask).sum()))
            self.pending_micro_batches += 1

    def values(self, batch: Any) -> np.ndarray:
        """PPO: the critic's values (zeros) after a forward pass's time."""
        with self._lock:
            self.activate()
            rows, length = micro_batch_shape(batch)
            self._run("values", rows, length, self.cost_model.train_micro_batch_s(rows, length) / 3 if rows else 0.0)
            return np.zeros(np.asarray(batch.attention_mask).shape, np.float32)

    def accumulated_gradients(self) -> dict:
        """Nothing to wait for: `accumulate` returns once its step is done."""
        return {}

    def apply(self, *, allow_empty: bool = False) -> dict[str, float]:
        with self._lock:
            if self.pending_micro_batches == 0:
                if not allow_empty:
                    raise RuntimeError(f"agent {self.agent!r}: apply() with no accumulated micro-batch "
                                       "(pass allow_empty=True to only advance policy_version)")
                self.charges.append(Charge("empty_apply", 0, 0, 0.0))
                self.policy_version += 1
                return {}
            self.activate()
            try:
                self._run("apply", 0, 0, self.cost_model.optimizer_apply_s())
                self.policy_version += 1
                self.pending_micro_batches = 0
                return {}
            finally:
                self.release()

    def discard_accumulated(self) -> None:
        with self._lock:
            self.pending_micro_batches = 0
            self.release()

    def busy_device_s(self, kind: str | None = None) -> float:
        """Device seconds charged so far (of one kind, or all)."""
        return sum(charge.device_s for charge in self.charges if kind is None or charge.kind == kind)
