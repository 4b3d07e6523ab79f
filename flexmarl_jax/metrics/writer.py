"""Per-iteration metrics to `<workdir>/metrics.jsonl` and TensorBoard event files in `<workdir>/tensorboard/`.

One JSON object per line. Two kinds of records: one per training iteration (no `kind` key, or
`"kind": "iteration"`), and one per held-out evaluation (`"kind": "eval"`, whose `iteration` is the number of
iterations done, i.e. the policy version evaluated; see orchestrator/evaluation.py). Readers that want one
kind filter with `iteration_records` / `eval_records`. The writer is resume-safe: on open it reads the lines
already there, drops a torn last line (a run killed mid-write leaves one) and never writes a record of one
kind and iteration twice, so a resumed run that repeats an iteration keeps the first record of it.

Paths go through the workdir path layer (`flexmarl_jax/workdir_paths.py`): a `gs://` workdir gets its
`metrics.jsonl` too (rewritten whole on each record, as objects cannot be appended to); TensorBoard event files
are written for local workdirs only.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from flexmarl_jax import workdir_paths
from flexmarl_jax.metrics.jsonable import numeric_items, to_jsonable

logger = logging.getLogger(__name__)

METRICS_FILENAME = "metrics.jsonl"
TENSORBOARD_DIRNAME = "tensorboard"
ITERATION_KIND = "iteration"  # a training iteration's record (records without a `kind` key are these)
EVAL_KIND = "eval"  # a held-out evaluation's record
EVAL_PREFIX = "eval_"  # the metrics of an eval record (`eval_team_accuracy`, `agent/<name>/eval_accuracy`)


def record_kind(record: Mapping[str, Any]) -> str:
    """ITERATION_KIND or EVAL_KIND (or another kind a caller wrote)."""
    return record.get("kind", ITERATION_KIND)


def iteration_records(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The training iterations' records, in file order."""
    return [record for record in records if record_kind(record) == ITERATION_KIND]


def eval_records(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The held-out evaluations' records, in file order."""
    return [record for record in records if record_kind(record) == EVAL_KIND]


def is_eval_metric(tag: str) -> bool:
    """Whether a flattened tag is an eval metric (`eval_pass_at_k`, `agent/solver/eval_accuracy`)."""
    return tag.rsplit("/", 1)[-1].startswith(EVAL_PREFIX)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Records of a `metrics.jsonl` (a file, or a workdir holding one); an unparseable line is skipped."""
    path = workdir_paths.path(path)
    if path.is_dir():
        path = path / METRICS_FILENAME
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("skipping unparseable line %d of %s", number, path)
    return records


class MetricsWriter:
    """Appends one record per iteration (and per evaluation) to `metrics.jsonl` and to TensorBoard. Thread-safe.

    Args:
      workdir: run directory (created if missing).
      tensorboard: also write TensorBoard scalars (flattened tags like `agent/solver/reward`).
      persist: write the files (process 0 of a run); False keeps the records in memory only, reading what the
        file holds already (the other processes of a run: one writer per file).

    Each record must hold an integer `iteration`. Nested dicts are kept nested in the JSONL and flattened
    to `/`-joined tags in TensorBoard (an eval record contributes its eval metrics only, at step `iteration`);
    numpy / JAX scalars and arrays are converted; NaN/inf become null.
    """

    def __init__(self, workdir: str | os.PathLike[str], *, tensorboard: bool = True, persist: bool = True):
        self.workdir = workdir_paths.path(workdir)
        self.persist = persist
        if persist:
            self.workdir.mkdir(parents=True, exist_ok=True)
        self.path = self.workdir / METRICS_FILENAME
        self._lock = threading.Lock()
        if persist:
            self._repair_torn_tail()
        self.records: list[dict[str, Any]] = read_metrics(self.path)
        self._written = {(record_kind(record), record.get("iteration")) for record in self.records}
        self._tensorboard = None
        if tensorboard and persist and workdir_paths.is_local(os.fspath(self.workdir)):
            # lazy: tensorboardX imports torch where installed (1.9 s); only a local run with tensorboard needs it
            from tensorboardX import SummaryWriter

            self._tensorboard = SummaryWriter(logdir=str(self.workdir / TENSORBOARD_DIRNAME), flush_secs=10)

    @property
    def last_iteration(self) -> int | None:
        """The highest training iteration already written (from this run or an earlier one), or None."""
        iterations = [iteration for kind, iteration in self._written
                      if kind == ITERATION_KIND and isinstance(iteration, int)]
        return max(iterations, default=None)

    def has_iteration(self, iteration: int, kind: str = ITERATION_KIND) -> bool:
        """Whether a record of `kind` for `iteration` was written."""
        return (kind, iteration) in self._written

    def write(self, record: Mapping[str, Any]) -> bool:
        """Append `record` (must hold an int `iteration`); False if a record of its kind and iteration was
        already written."""
        plain = to_jsonable(record)
        iteration = plain.get("iteration")
        if isinstance(iteration, bool) or not isinstance(iteration, int):
            raise ValueError(
                f"metrics record needs an integer 'iteration', got {record.get('iteration')!r}; "
                f"keys given: {sorted(plain)}"
            )
        line = json.dumps(plain, separators=(",", ":"), allow_nan=False) + "\n"
        kind = record_kind(plain)
        with self._lock:
            if (kind, iteration) in self._written:
                logger.info(
                    "%s metrics for iteration %d already in %s; not writing them again", kind, iteration, self.path
                )
                return False
            if self.persist:
                workdir_paths.append_line(self.path, line)
            self._written.add((kind, iteration))
            self.records.append(plain)
            if self._tensorboard is not None:
                for tag, value in numeric_items(plain).items():
                    if tag != "iteration" and (kind == ITERATION_KIND or is_eval_metric(tag)):
                        self._tensorboard.add_scalar(tag, value, global_step=iteration)
                self._tensorboard.flush()
        return True

    def close(self) -> None:
        with self._lock:
            if self._tensorboard is not None:
                self._tensorboard.close()
                self._tensorboard = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def forget_from(self, iteration: int) -> int:
        """Removes from `metrics.jsonl` the training records of iterations >= `iteration` and the evaluations
        of policy versions > `iteration`: a resume that went back to version `iteration` redoes those
        iterations, and their records described updates it discarded. Returns the number of records removed.
        (TensorBoard event files are append-only: they keep the old points, beside the redone ones.)"""
        def discarded(record) -> bool:
            step = record.get("iteration")
            if not isinstance(step, int):
                return False
            return step > iteration if record_kind(record) == EVAL_KIND else step >= iteration

        with self._lock:
            kept = [record for record in self.records if not discarded(record)]
            removed = len(self.records) - len(kept)
            if removed:
                temporary = self.path.with_name(self.path.name + ".tmp")
                temporary.write_text("".join(json.dumps(record) + "\n" for record in kept), encoding="utf-8")
                os.replace(temporary, self.path)
                self.records = kept
                self._written = {(record_kind(record), record.get("iteration")) for record in kept}
        return removed

    def _repair_torn_tail(self) -> None:
        """Cut a last line without its newline: appending after it would glue two records together."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        logger.warning("dropping a torn last line (%d bytes) from %s", len(data) - keep, self.path)
        self.path.write_bytes(data[:keep])
