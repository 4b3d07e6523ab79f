"""Damaging files on disk the way the integrity tests do: random bytes over a span of a file."""

import numpy as np


def overwrite_with_noise(path, position: int, size: int, rng: np.random.Generator) -> None:
    """Writes `size` random bytes at `position` of `path`, drawn from `rng` until they differ from what was there
    (so every trial really changes the file)."""
    with open(path, "r+b") as handle:
        handle.seek(position)
        before = handle.read(size)
        noise = before
        while noise == before:
            noise = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        handle.seek(position)
        handle.write(noise)
