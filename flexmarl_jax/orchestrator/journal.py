"""The run journal: the side files in a workdir that let a killed run resume with nothing lost or repeated.

Invariant: **an iteration's checkpoint is written before the rows it trained count as consumed.** So a run
killed at any moment either has the iteration's update in a checkpoint (and its trained rows are marked
consumed on resume, if the kill came before `mark_consumed`), or has no checkpoint of it (and the iteration
is redone from the previous checkpoint; the first attempt's rows are dropped). A resume may also go back further
than the last checkpoint, when that one fails verification (`orchestrator/resume.py`): every iteration after the
version resumed from is then redone, and the rows those iterations trained — consumed by updates that no
surviving checkpoint holds — are dropped, never counted as trained. The files that serve this:

- `pending_trained.json`: the sample ids the iteration being checkpointed trained on, written before its
  checkpoint and removed once its metrics line is written.
- `pending_record.json`: that iteration's metrics record, kept with the checkpoint so that a kill between
  the checkpoint and `metrics.jsonl` loses no record.
- `trained/<iteration>.json`: the same sample ids, kept for the iterations whose checkpoints a resume may still
  go back past (`CHECKPOINTS_KEPT`); older ones are removed.
- `attempts.json`: how often each iteration was started, so a redone iteration gets fresh input ids and
  its first attempt's rows (in a durable store) are dropped.
- `stops.jsonl`: one line per run that ended early (a stall, a signal, an error): why, when, at which
  iteration; what `flexmarl train` on the workdir will resume from. Informational: resuming never needs it.

Every file is written atomically (a temporary file, then `os.replace`; one object write on an object store),
through the workdir path layer (`flexmarl_jax/workdir_paths.py`), so a `gs://` workdir journals too. In a run of
several processes only process 0 keeps the journal (docs/architecture.md, "One writer per file").
"""

from __future__ import annotations

import json
import logging
import os
import time

from etils import epath

from flexmarl_jax import workdir_paths

logger = logging.getLogger(__name__)

PENDING_RECORD = "pending_record.json"
PENDING_TRAINED = "pending_trained.json"
ATTEMPTS = "attempts.json"
STOPS = "stops.jsonl"
TRAINED_DIR = "trained"
CHECKPOINTS_KEPT = 2  # versions a run keeps per agent (Orbax max_to_keep): a resume can go back to the oldest


def read_json(path: str | epath.Path):
    """The JSON value in `path`, or None when there is no such file."""
    path = epath.Path(path)
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def write_json_atomically(path: str | epath.Path, payload) -> None:
    workdir_paths.write_atomically(epath.Path(path), json.dumps(payload))


class RunJournal:
    """The journal files of one workdir (see the module docstring for the invariant they keep)."""

    def __init__(self, workdir: str, *, writer: bool = True):
        """writer: whether this process keeps the journal (process 0 of a run); the others only read it."""
        self.workdir = workdir
        self.writer = writer

    def _path(self, name: str) -> epath.Path:
        return workdir_paths.path(self.workdir, name)

    # --------------------------------------------------------------------------- during an iteration
    def begin_attempt(self, iteration: int) -> int:
        """Records that `iteration` starts; returns how often it was started before."""
        if not self.writer:
            raise RuntimeError("only the journal's writer (process 0) records attempts; the others receive its "
                               "count (run.py broadcasts it)")
        attempts = read_json(self._path(ATTEMPTS)) or {}
        previous = int(attempts.get(str(iteration), 0))
        attempts[str(iteration)] = previous + 1
        write_json_atomically(self._path(ATTEMPTS), attempts)
        return previous

    def before_checkpoint(self, record: dict, trained: dict[str, list[str]]) -> None:
        """Keeps the iteration's trained sample ids and metrics record; call right before its checkpoint."""
        if not self.writer:
            return
        iteration = record["iteration"]
        payload = {"iteration": iteration, "sample_ids": trained}
        self._path(TRAINED_DIR).mkdir(parents=True, exist_ok=True)
        write_json_atomically(self._trained_path(iteration), payload)
        for older in self._trained_iterations():
            # Versions on disk from now on: iteration + 1 - CHECKPOINTS_KEPT and newer (or one fewer, if the
            # save of version iteration + 1 is cut short). A resume never goes back before the oldest of them,
            # so it never redoes an iteration before it: those trained ids are no longer needed.
            if older < iteration - (CHECKPOINTS_KEPT - 1):
                self._trained_path(older).unlink()
        write_json_atomically(self._path(PENDING_TRAINED), payload)
        write_json_atomically(self._path(PENDING_RECORD), record)

    def _trained_path(self, iteration: int) -> epath.Path:
        return self._path(TRAINED_DIR) / f"{iteration}.json"

    def _trained_iterations(self) -> list[int]:
        directory = self._path(TRAINED_DIR)
        if not directory.is_dir():
            return []
        return sorted(int(path.stem) for path in directory.iterdir()
                      if path.name.endswith(".json") and path.stem.isdigit())

    def iteration_logged(self) -> None:
        """The iteration's metrics line is written and its rows are consumed: nothing is pending any more."""
        if not self.writer:
            return
        for name in (PENDING_RECORD, PENDING_TRAINED):
            self._path(name).unlink()

    def record_stop(self, reason: str, *, iteration: int | None, detail: str) -> None:
        """Marks that the run ends early (`reason`: stalled, signal, error); one appended line, flushed to disk,
        since the process may be about to exit hard."""
        if not self.writer:
            return
        line = json.dumps({"time": time.time(), "reason": reason, "iteration": iteration, "detail": detail,
                           "pid": os.getpid()})
        workdir_paths.append_line(self._path(STOPS), line + "\n")

    def stops(self) -> list[dict]:
        """Every stop recorded so far, oldest first."""
        path = self._path(STOPS)
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]

    # ------------------------------------------------------------------------------------- on resume
    def settle(self, store, writer, start: int) -> None:
        """Finishes what a killed run left pending, given `start`, the first iteration to (re)do.

        An iteration before `start` was checkpointed: its record is written if its metrics line was lost,
        and its trained rows are marked consumed if the kill came before `mark_consumed`. A pending
        iteration at or after `start` has no checkpoint: it is redone, so its pending files are discarded.
        Every iteration from `start` on is redone: the rows it trained are dropped (`discard_trained_since`) and
        its metrics records removed (after a fallback past a checkpoint that failed verification, they describe
        updates that were discarded).
        Only the journal's writer settles (the other processes' stores start empty: they redo from `start`).
        """
        if not self.writer:
            return
        record = read_json(self._path(PENDING_RECORD))
        if record is not None:
            if record["iteration"] < start:
                writer.write(record)
            self._path(PENDING_RECORD).unlink()
        pending = read_json(self._path(PENDING_TRAINED))
        if pending is not None:
            if pending["iteration"] < start:
                settled = sum(store.consume_rows(agent, ids) for agent, ids in pending["sample_ids"].items())
                if settled:
                    logger.info("marked %d rows of checkpointed iteration %d consumed", settled,
                                pending["iteration"])
            self._path(PENDING_TRAINED).unlink()
        self.discard_trained_since(store, start)
        if writer is not None:
            forgotten = writer.forget_from(start)  # records of updates a fallback discarded; redone now
            if forgotten:
                logger.warning("removed %d metrics records of iterations from %d on, which are redone", forgotten,
                               start)

    def discard_trained_since(self, store, start: int) -> int:
        """Drops the rows that iterations >= `start` trained: the resume redoes those iterations from the
        checkpoint of version `start`, so no surviving policy holds their training (consumed rows, after a
        fallback past a checkpoint that failed verification) or ever will (rows of an iteration killed before
        its checkpoint). Returns the number of rows dropped."""
        dropped = 0
        for iteration in self._trained_iterations():
            if iteration < start:
                continue
            payload = read_json(self._trained_path(iteration))
            rows = sum(store.drop_rows(agent, ids) for agent, ids in payload["sample_ids"].items())
            if rows:
                logger.warning("iteration %d is redone from policy version %d: the %d rows its discarded update "
                               "trained are dropped", iteration, start, rows)
            dropped += rows
            self._trained_path(iteration).unlink()
        return dropped
