"""The Engine API's shape properties, read from an `EngineConfig`: one definition for every engine of ours
(`FlexEngine` on real devices, `EmulatedEngine` on emulated ones), so they cannot drift apart."""

from __future__ import annotations

from flexmarl_jax.rollout.settings import EngineConfig


class EngineShapeFromConfig:
    """Mixin for an `engine_api.Engine` whose `config` is an `EngineConfig`: decode slots, one sample per slot,
    the prefill length, and no co-located CPUs (`mesh` stays each engine's own)."""

    config: EngineConfig

    @property
    def max_concurrent_decodes(self) -> int:
        return self.config.max_concurrent_decodes

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self.config.max_prefill_length

    @property
    def colocated_cpus(self) -> None:
        return None
