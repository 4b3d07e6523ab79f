"""What every benchmark does with its result object: write it as JSON when `--json PATH` is given."""

from __future__ import annotations

import json
from typing import Any


def write_json(path: str | None, result: Any) -> None:
    """Writes `result` (numpy / JAX scalars and arrays converted) to `path`; does nothing without a path."""
    if not path:
        return
    from flexmarl_jax.metrics import to_jsonable

    with open(path, "w") as handle:
        json.dump(to_jsonable(result), handle, indent=1)
