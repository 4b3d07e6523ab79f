"""Run-time checks of the consistency model (docs/architecture.md), used in debug mode and by the tests.

- No sample is trained under the wrong version: every policy version a sample depends on is within
  `max_staleness` of that agent's version when the sample's gradients are computed (0: exactly equal).
- Every sample is consumed exactly once.
- New weights reach rollout before rollout uses the new version: a completion never carries a version its
  engine instance had not been synced to.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Mapping


class InvariantViolation(AssertionError):
    """A broken consistency invariant; the message names the sample, agent and versions involved."""


class ConsistencyChecker:
    """Thread-safe ledger of generations, weight syncs and training of samples."""

    def __init__(self, max_staleness: int = 0):
        self.max_staleness = max_staleness
        self._lock = threading.Lock()
        self._synced_version: dict[str, int] = {}
        # Keyed by (agent, sample_id): agents of one workflow may share sample ids (e.g. mixture proposers).
        self._generated: dict[tuple[str, str], dict[str, int]] = {}
        self._trained_count: collections.Counter[tuple[str, str]] = collections.Counter()
        self.checks = 0

    def weights_synced(self, agent: str, version: int) -> None:
        """An agent's rollout instances now serve `version`."""
        with self._lock:
            if version < self._synced_version.get(agent, -1):
                raise InvariantViolation(f"{agent}: weight sync went back from version "
                                         f"{self._synced_version[agent]} to {version}")
            self._synced_version[agent] = version

    def generated(self, sample_id: str, agent: str, versions: Mapping[str, int]) -> None:
        """A sample exists; `versions` holds the version of every agent it depends on (its own included)."""
        with self._lock:
            self.checks += 1
            for dependency, version in versions.items():
                synced = self._synced_version.get(dependency)
                if synced is None or version > synced:
                    raise InvariantViolation(
                        f"sample {sample_id} ({agent}) used {dependency} version {version} before that version "
                        f"reached rollout (synced: {synced})")
            self._generated[(agent, sample_id)] = dict(versions)

    def trained(self, sample_ids: Iterable[str], agent: str, current_versions: Mapping[str, int]) -> None:
        """Gradients of these samples are being computed while agents are at `current_versions`."""
        with self._lock:
            for sample_id in sample_ids:
                self.checks += 1
                versions = self._generated.get((agent, sample_id))
                if versions is None:
                    raise InvariantViolation(f"{agent} trained on unknown sample {sample_id}")
                for dependency, version in versions.items():
                    lag = current_versions[dependency] - version
                    if lag < 0 or lag > self.max_staleness:
                        raise InvariantViolation(
                            f"{agent} trained sample {sample_id} generated under {dependency} version {version} "
                            f"at version {current_versions[dependency]} (max_staleness={self.max_staleness})")
                self._trained_count[(agent, sample_id)] += 1
                if self._trained_count[(agent, sample_id)] > 1:
                    raise InvariantViolation(f"sample {sample_id} of {agent} trained "
                                             f"{self._trained_count[(agent, sample_id)]} times")

    def dropped(self, sample_ids: Iterable[str], agent: str) -> None:
        """Samples discarded as too stale: they must never be trained afterwards."""
        with self._lock:
            for sample_id in sample_ids:
                key = (agent, sample_id)
                if self._trained_count[key]:
                    raise InvariantViolation(f"sample {sample_id} of {agent} was dropped after being trained")
                self._trained_count[key] = 1  # accounted for: never trainable again
                self._generated.pop(key, None)

    def training_discarded(self, sample_ids: Iterable[str], agent: str) -> None:
        """A failed iteration dropped these samples' gradients before any update: they count as untrained."""
        with self._lock:
            for sample_id in sample_ids:
                self._trained_count.pop((agent, sample_id), None)

    def drop_untrained(self) -> int:
        """Every sample not trained yet is dropped (a failed iteration's rows before its retry); returns how many."""
        with self._lock:
            keys = [key for key in self._generated if not self._trained_count[key]]
        for agent, sample_id in keys:
            self.dropped([sample_id], agent)
        return len(keys)

    def untrained(self) -> list[str]:
        """Generated samples ("agent/sample_id") not yet trained or dropped."""
        with self._lock:
            return sorted(f"{a}/{s}" for a, s in self._generated if not self._trained_count[(a, s)])

    def check_all_consumed(self) -> None:
        """At the end of a strict iteration every generated sample has been trained exactly once."""
        missing = self.untrained()
        if missing:
            raise InvariantViolation(f"{len(missing)} samples were never trained, e.g. {missing[:3]}")
