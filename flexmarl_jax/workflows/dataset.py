"""Users' own datasets: JSONL files of `{"prompt", "answer"}` lines or of GSM8K `{"question", "answer"}` lines.

A GSM8K answer is the worked solution followed by "#### <final answer>"; the reference answer is what follows
the marker (thousands commas removed: GSM8K writes "1,234"), and the solution is kept in `Problem.meta`. All
lines of one file have one format; GSM8K files are checked with math-verify by default.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
from collections.abc import Mapping, Sequence

from flexmarl_jax.workflows import verifiers
from flexmarl_jax.workflows.tasks import Problem, make_input_id, register_task

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LineFormat:
    """What tells the JSONL line formats apart."""

    query_key: str  # the key holding the query
    description: str  # how messages name the format
    default_verifier: str  # the verifier of `JsonlTask(verifier="auto")`


LINE_FORMATS = {
    "prompt": LineFormat("prompt", "{prompt, answer}", "exact"),
    "gsm8k": LineFormat("question", "GSM8K {question, answer}", "math"),
}
GSM8K_MARKER = "####"


class DatasetError(ValueError):
    """A malformed dataset line; the message names the file and the 1-based line number."""


@dataclasses.dataclass(frozen=True)
class DatasetRecord:
    """One usable line: its 1-based number, the query, the reference answer and extra fields for `meta`."""

    line: int
    prompt: str
    answer: str
    meta: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class JsonlDataset:
    """A JSONL file's records and its line format ("prompt" or "gsm8k", see LINE_FORMATS)."""

    path: str
    line_format: str
    records: tuple[DatasetRecord, ...]


def read_jsonl_dataset(path: str | os.PathLike, *, skip_malformed: bool = False) -> JsonlDataset:
    """Every usable line of a JSONL file; blank lines are ignored.

    A malformed line (not a JSON object, no query, no answer, a GSM8K answer without "####") raises
    DatasetError naming the file and line, unless `skip_malformed`, in which case it is logged and skipped.
    A line of the other format than the file's first usable line always raises.
    """
    records, skipped = [], []
    line_format = None
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                this_format, record = _parse_line(line_number, line)
            except DatasetError as error:
                if not skip_malformed:
                    raise DatasetError(f"{path}:{line_number}: {error}") from None
                skipped.append(line_number)
                continue
            if line_format is None:
                line_format = this_format
            elif this_format != line_format:
                this, first = LINE_FORMATS[this_format].description, LINE_FORMATS[line_format].description
                raise DatasetError(
                    f"{path}:{line_number}: a {this} line, but line {records[0].line} is {first}; "
                    "all lines of a file must have one format"
                )
            records.append(record)
    if skipped:
        logger.warning("%s: skipped %d malformed lines (first: line %d)", path, len(skipped), skipped[0])
    if not records:
        raise DatasetError(
            f"{path}: no usable lines (expected JSONL lines {{prompt, answer}} or GSM8K {{question, answer}})"
        )
    return JsonlDataset(str(path), line_format, tuple(records))


def read_jsonl_records(
    path: str | os.PathLike, *, skip_malformed: bool = False
) -> list[tuple[int, str, str]]:
    """(line number, prompt, answer) for every usable line (see `read_jsonl_dataset`)."""
    dataset = read_jsonl_dataset(path, skip_malformed=skip_malformed)
    return [(record.line, record.prompt, record.answer) for record in dataset.records]


def _parse_line(line_number: int, line: str) -> tuple[str, DatasetRecord]:
    """(line format, record) of one line; DatasetError (without the file and line) when it is unusable."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        raise DatasetError(f"invalid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(value, dict):
        raise DatasetError(f"expected a JSON object, got {type(value).__name__}")
    if "prompt" in value and "question" in value:
        raise DatasetError("has both 'prompt' and 'question'; a line is {prompt, answer} or GSM8K {question, answer}")
    line_format = "gsm8k" if "question" in value else "prompt"
    query_key = LINE_FORMATS[line_format].query_key
    missing = [key for key in (query_key, "answer") if key not in value]
    if missing:
        raise DatasetError(
            f"missing key(s) {missing}; each line needs 'prompt' and 'answer' (or GSM8K's 'question' and 'answer')"
        )
    prompt, answer = _text_field(value, query_key), _text_field(value, "answer")
    if not prompt:
        raise DatasetError(f"{query_key!r} is empty")
    if not answer.strip():
        raise DatasetError("'answer' is empty")
    if line_format == "prompt":
        return line_format, DatasetRecord(line_number, prompt, answer)
    reasoning, marker, final = answer.rpartition(GSM8K_MARKER)
    final = final.strip().replace(",", "")
    if not marker or not final:
        raise DatasetError(f"GSM8K 'answer' needs '{GSM8K_MARKER} <final answer>' at its end")
    return line_format, DatasetRecord(line_number, prompt, final, {"reasoning": reasoning.strip()})


def _text_field(value: dict, key: str) -> str:
    field = value[key]
    if isinstance(field, bool) or not isinstance(field, (str, int, float)):
        raise DatasetError(f"{key!r} must be a string or number, got {type(field).__name__}")
    return str(field)


@register_task("jsonl")
class JsonlTask:
    """Problems drawn from a JSONL file; `generate` samples lines (without replacement) per seed.

    Args:
      path: the JSONL file: `{"prompt", "answer"}` lines or GSM8K `{"question", "answer": "... #### 42"}` lines.
      verifier: "exact" (first line of the answer, stripped), "numeric" (first number), "math" (math-verify:
        "42.0", "$42$", "\\boxed{42}" all match 42), or "auto": "math" for GSM8K files, else "exact".
      skip_malformed: skip bad lines with a warning instead of raising.
      name: prefix of input ids (no underscores).

    A problem's `meta` holds its line number ("line") and, for GSM8K, the worked solution ("reasoning").
    """

    def __init__(
        self,
        path: str | os.PathLike,
        verifier: str = "auto",
        skip_malformed: bool = False,
        name: str = "jsonl",
    ):
        if verifier != "auto" and verifier not in verifiers.VERIFIERS:
            raise ValueError(f"unknown verifier {verifier!r}; allowed: {['auto', *sorted(verifiers.VERIFIERS)]}")
        self.name = name
        self.path = str(path)
        dataset = read_jsonl_dataset(path, skip_malformed=skip_malformed)
        self.line_format = dataset.line_format
        self.records: Sequence[DatasetRecord] = dataset.records
        file_default = LINE_FORMATS[dataset.line_format].default_verifier
        self.verifier_name = file_default if verifier == "auto" else verifier
        self._verify = verifiers.get_verifier(self.verifier_name)

    def generate(self, count: int, *, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        order: list[int] = []
        while len(order) < count:  # epochs of shuffled lines when count exceeds the file
            epoch = list(range(len(self.records)))
            rng.shuffle(epoch)
            order.extend(epoch)
        problems = []
        for index, record_index in enumerate(order[:count]):
            record = self.records[record_index]
            meta = {"line": record.line, **record.meta}
            problems.append(Problem(make_input_id(self.name, seed, index), record.prompt, record.answer, meta))
        return problems

    def verify(self, problem: Problem, answer: str | None) -> bool:
        try:
            return self._verify(answer, problem.answer)
        except Exception:  # a verifier must never take the rollout down
            logger.exception("verifier %s failed on %r", self.verifier_name, answer)
            return False
