"""Joining the run's processes with JAX's distributed runtime, from `config.distributed`.

    processes = join_processes(config.distributed)   # before any other JAX call of the process
    check_devices(config, processes.global_devices)  # placement against every host's devices

One process per host. After joining, `jax.devices()` is the global device set (every process's devices, in
one order on every process) and `jax.local_devices()` this process's; meshes are placed on the global set.
On a CPU host the processes exchange collectives over gloo (JAX's CPU default has none across processes).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from absl import flags

from flexmarl_jax.distributed.coordinator_probe import CoordinatorUnreachable, wait_for_coordinator

if TYPE_CHECKING:
    from flexmarl_jax.config.schema import DistributedConfig

logger = logging.getLogger(__name__)
ORBAX_BARRIER_FLAG = "experimental_orbax_use_distributed_barrier"  # see use_orbax_key_value_barriers


class JoinFailed(RuntimeError):
    """The processes could not join (an unreachable coordinator, a process that never came); one line, which
    `flexmarl train` reports as a config error (the coordinator and timeouts are `config.distributed`'s)."""


@dataclasses.dataclass(frozen=True)
class Processes:
    """Where this process stands in the run."""

    process_index: int
    process_count: int
    local_devices: int
    global_devices: int

    @property
    def is_leader(self) -> bool:
        """Process 0 writes the run's shared files (docs/architecture.md, "One writer per file")."""
        return self.process_index == 0


def join_processes(settings: DistributedConfig) -> Processes:
    """Joins the other processes (`settings.enabled`) or stays alone; returns this process's place.

    With an explicit coordinator, every process but 0 first waits for its port (`wait_for_coordinator`), so
    an unreachable coordinator is a `JoinFailed` naming it within `init_timeout_s`. JAX's runtime then joins
    them with the config's timeouts; a process that never comes is a `JoinFailed` on the others."""
    if settings.enabled and settings.coordinator_address and settings.process_id != 0:
        try:
            waited = wait_for_coordinator(settings.coordinator_address, settings.init_timeout_s,
                                          process_id=settings.process_id)
        except CoordinatorUnreachable as error:
            raise JoinFailed(str(error)) from None
        logger.info("coordinator %s answered after %.1f s", settings.coordinator_address, waited)
    # lazy: cli/main.py imports this module and `flexmarl --help` must not load JAX (import jax costs ~1 s)
    import jax

    if settings.enabled:
        # Before any backend starts (asking for the platform would start one): gloo carries the CPU devices'
        # collectives between processes; it changes nothing for TPU or GPU devices.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # JAX's CPU client may run two independent computations at once; two spanning ones would then exchange
        # their collectives in either order, differently on each process (measured: a warm-up's two log-prob
        # passes aborted gloo with "collective mismatch"). Synchronous dispatch runs them in issue order, on the
        # calling thread's device; a computation's parts on other local devices can still be running when the
        # call returns, which distributed/cpu_completion.py waits for.
        jax.config.update("jax_cpu_enable_async_dispatch", False)
        explicit = settings.coordinator_address != ""
        try:
            jax.distributed.initialize(
                coordinator_address=settings.coordinator_address if explicit else None,
                num_processes=settings.num_processes if explicit else None,
                process_id=settings.process_id if explicit else None,
                initialization_timeout=max(1, round(settings.init_timeout_s)),
                heartbeat_timeout_seconds=max(1, round(settings.heartbeat_timeout_s)))
        except Exception as error:  # JAX raises XlaRuntimeError/ValueError with multi-line texts
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            where = settings.coordinator_address or "the auto-detected coordinator"
            raise JoinFailed(f"process {settings.process_id if explicit else '?'} could not join the run through "
                             f"{where} within distributed.init_timeout_s={settings.init_timeout_s:g} s: "
                             f"{first_line}") from None
        use_orbax_key_value_barriers()
        logger.info("joined as process %d of %d (%d local devices, %d in all)", jax.process_index(),
                    jax.process_count(), jax.local_device_count(), jax.device_count())
    return Processes(jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())


def use_orbax_key_value_barriers() -> None:
    """Has Orbax wait at its barriers through the runtime's key-value service instead of its default, a
    computation over every device of every process (`multihost_utils.sync_global_devices`). Such a computation
    shares gloo communicators with the training slice's, and can still be running on the slice's device when
    the next training step starts there (transfer/across_processes.py says how that aborted runs).

    The switch is an absl flag of Orbax's; our command line parses its own flags, not absl's global ones, so
    the flag is set and marked present (absl reads an unparsed flag only if it is present)."""
    # lazy: Orbax imports JAX, which `flexmarl --help` must not load (via cli/main.py)
    import orbax.checkpoint  # noqa: F401 - defines the flag

    flag = flags.FLAGS[ORBAX_BARRIER_FLAG]
    flag.value = True
    flag.present = max(flag.present, 1)
