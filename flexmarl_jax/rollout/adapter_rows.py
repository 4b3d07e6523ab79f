"""`AdapterRows`: which row of an engine's adapter table each LoRA agent of a base group decodes with.

Each agent owns two rows. New requests name its current row; a new version of its adapter goes into the other
(the spare), which then becomes current. Sequences that started before keep decoding on the old row, under the
version their behaviour log-probs were recorded with, so a sync never drains the instance or stops another
agent. A spare that old sequences still use is not written until they finish (rollout/instance.py waits).
"""

from __future__ import annotations

from collections.abc import Sequence


class AdapterRows:
    """Agents -> rows of an adapter table of `table_size` = 2 x agents rows: agent i owns rows 2i and 2i + 1."""

    def __init__(self, agents: Sequence[str]):
        agents = tuple(agents)
        if not agents or len(set(agents)) != len(agents) or not all(isinstance(a, str) and a for a in agents):
            raise ValueError(f"adapter agents {list(agents)} must be distinct non-empty names, at least one")
        self.agents = agents
        self._current = {agent: 2 * index for index, agent in enumerate(agents)}

    @property
    def table_size(self) -> int:
        return 2 * len(self.agents)

    def current(self, agent: str) -> int:
        """The row `agent`'s new requests decode with."""
        return self._current[self._known(agent)]

    def spare(self, agent: str) -> int:
        """The row `agent`'s next version goes into."""
        return self.current(agent) ^ 1

    def promote(self, agent: str) -> None:
        """The spare becomes current (its new version has been written)."""
        self._current[self._known(agent)] ^= 1

    def _known(self, agent: str) -> str:
        if agent not in self._current:
            raise ValueError(f"agent {agent!r} has no adapter on this engine; it serves {list(self.agents)}")
        return agent
