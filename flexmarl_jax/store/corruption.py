"""The error a store raises when bytes it reads back fail their checksum (see layout.py, "Integrity")."""

from __future__ import annotations

from collections.abc import Sequence


class StoreCorrupted(RuntimeError):
    """Stored bytes changed on disk: values of some rows of one agent's table (``sample_ids`` names the rows; empty
    when the damage is in a column that identifies rows, then ``detail`` gives the row numbers), or the schema
    (``agent`` None)."""

    def __init__(self, agent: str | None, sample_ids: Sequence[str], detail: str):
        self.agent, self.sample_ids = agent, tuple(sample_ids)
        shown = ", ".join(repr(s) for s in self.sample_ids[:8])
        more = f" and {len(self.sample_ids) - 8} more" if len(self.sample_ids) > 8 else ""
        rows = f"; rows {shown}{more}" if self.sample_ids else ""
        where = f" in the table of agent {agent!r}" if agent is not None else ""
        super().__init__(f"experience store: corrupted data{where}{rows}: {detail}")


class CorruptedPositions(Exception):
    """Raised inside the store by a read whose rows (positions into the read) failed their checksum."""

    def __init__(self, positions_by_column: dict[str, list[int]], keys: Sequence[str]):
        super().__init__(f"CRC-32 mismatch in {', '.join(keys)}")
        self.positions_by_column = positions_by_column
        self.keys = tuple(keys)

    def positions(self) -> list[int]:
        return sorted({p for positions in self.positions_by_column.values() for p in positions})
