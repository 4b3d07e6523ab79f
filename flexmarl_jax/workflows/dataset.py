"""Users' own datasets: JSONL lines `{"prompt": ..., "answer": ...}` with an exact or numeric verifier."""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Sequence

from flexmarl_jax.workflows import verifiers
from flexmarl_jax.workflows.tasks import Problem, make_input_id, register_task

logger = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A malformed dataset line; the message names the file and the 1-based line number."""


def read_jsonl_records(
    path: str | os.PathLike, *, skip_malformed: bool = False
) -> list[tuple[int, str, str]]:
    """(line number, prompt, answer) for every usable line; blank lines are ignored.

    A line that is not a JSON object with string-or-number "prompt" and "answer" raises DatasetError naming
    the line, unless `skip_malformed`, in which case it is logged and skipped.
    """
    records, skipped = [], []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                records.append((line_number, *_parse_line(line)))
            except DatasetError as error:
                if not skip_malformed:
                    raise DatasetError(f"{path}:{line_number}: {error}") from None
                skipped.append(line_number)
    if skipped:
        logger.warning("%s: skipped %d malformed lines (first: line %d)", path, len(skipped), skipped[0])
    if not records:
        raise DatasetError(f"{path}: no usable lines (expected JSONL with 'prompt' and 'answer')")
    return records


def _parse_line(line: str) -> tuple[str, str]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        raise DatasetError(f"invalid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(value, dict):
        raise DatasetError(f"expected a JSON object, got {type(value).__name__}")
    missing = [key for key in ("prompt", "answer") if key not in value]
    if missing:
        raise DatasetError(f"missing key(s) {missing}; each line needs 'prompt' and 'answer'")
    fields = []
    for key in ("prompt", "answer"):
        field = value[key]
        if isinstance(field, bool) or not isinstance(field, (str, int, float)):
            raise DatasetError(f"{key!r} must be a string or number, got {type(field).__name__}")
        fields.append(str(field))
    if not fields[0]:
        raise DatasetError("'prompt' is empty")
    return fields[0], fields[1]


@register_task("jsonl")
class JsonlTask:
    """Problems drawn from a JSONL file; `generate` samples lines (without replacement) per seed.

    Args:
      path: the JSONL file.
      verifier: "exact" (first line of the answer, stripped) or "numeric" (first number).
      skip_malformed: skip bad lines with a warning instead of raising.
      name: prefix of input ids (no underscores).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        verifier: str = "exact",
        skip_malformed: bool = False,
        name: str = "jsonl",
    ):
        self.name = name
        self.path = str(path)
        self.verifier_name = verifier
        self._verify = verifiers.get_verifier(verifier)
        self.records: Sequence[tuple[int, str, str]] = read_jsonl_records(path, skip_malformed=skip_malformed)

    def generate(self, count: int, *, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        order: list[int] = []
        while len(order) < count:  # epochs of shuffled lines when count exceeds the file
            epoch = list(range(len(self.records)))
            rng.shuffle(epoch)
            order.extend(epoch)
        problems = []
        for index, record_index in enumerate(order[:count]):
            line_number, prompt, answer = self.records[record_index]
            problems.append(
                Problem(make_input_id(self.name, seed, index), prompt, answer, {"line": line_number})
            )
        return problems

    def verify(self, problem: Problem, answer: str | None) -> bool:
        try:
            return self._verify(answer, problem.answer)
        except Exception:  # a verifier must never take the rollout down
            logger.exception("verifier %s failed on %r", self.verifier_name, answer)
            return False
