"""Emulated accelerators: our real control plane (orchestrator, store, router, balancer, dispatchers) with
device time that follows a cost model of real models on real chips.

`chips` (published chip peaks, cited), `model_shapes` (a preset or HF config -> `ModelConfig`), `cost_model`
(device seconds of prefill, decode, training, optimizer, collectives, transfers), `timescale` (compressed
wall time and the host-overhead bound), `spec` (`CHIP:MODEL`), `rules` (the `pipeline.emulate_*` rules the
config and the components share). Pure Python: importing it starts no JAX.
Under the Engine API and the trainer's interface (these import JAX, so they are imported by module):
`engine` (EmulatedEngine), `trainer` (EmulatedTrainer), `training_pool` (shared slices), `scripts` (response
lengths); `orchestrator/emulated_setup.py` builds them for `pipeline.emulate`.
"""

from flexmarl_jax.emulation.chips import CHIPS, LINKS, Chip, Link, get_chip, get_link
from flexmarl_jax.emulation.cost_model import CostModel, transfer_s
from flexmarl_jax.emulation.model_shapes import resolve_model_shape
from flexmarl_jax.emulation.spec import EmulatedDevice, parse_emulate
from flexmarl_jax.emulation.timescale import MAX_HOST_OVERHEAD_SHARE, TimeScale

__all__ = ["CHIPS", "LINKS", "MAX_HOST_OVERHEAD_SHARE", "Chip", "CostModel", "EmulatedDevice", "Link", "TimeScale",
           "get_chip", "get_link", "parse_emulate", "resolve_model_shape", "transfer_s"]
