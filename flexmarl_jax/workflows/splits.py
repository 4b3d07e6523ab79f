"""Train and eval problems that never share content: a task's held-out split.

A problem belongs to the eval split by its *content*, never by its input id, so the same question drawn twice,
by two seeds or from two files, lands on the same side. Content is the task's own `content_key` where it has
one (`tasks.CanonicalContent`: "4+3=" is "3+4=", Countdown's numbers in any order are one puzzle), else the
prompt text with whitespace collapsed, casefolded:

- generated tasks and a JSONL file alone: a stable hash of the content puts a fixed `eval_fraction` of all
  possible contents in the eval split (the same contents on every machine, seed and run);
- a JSONL task with an eval file: the eval file's problems are the eval split, and the training file's lines
  whose content also appears in the eval file are held out of training (with a warning saying how many).

`TrainEvalSplit` wraps a task: its `generate` draws training problems only (the wrapped task's draws, with
eval-split contents rejected), so everything that draws problems from it (rollouts, warm-up) trains on the
train split; `eval_problems(count, seed)` is the fixed list of distinct eval problems the team is evaluated on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import zlib
from collections.abc import Iterator

from flexmarl_jax.workflows.dataset import read_jsonl_dataset
from flexmarl_jax.workflows.tasks import CanonicalContent, Problem, Task

logger = logging.getLogger(__name__)

# Draws of the wrapped task that stand for its whole problem space when a split is searched for members (a
# space smaller than this is covered several times over; an eval share that finds nothing here is empty).
SEARCH_DRAWS = 8192
_CHUNK = 1024  # draws per seed when eval problems are searched for
# The seed of a run's eval list: one list for every run seed, so that runs of one config with different seeds
# are evaluated on the same problems.
EVAL_PROBLEMS_SEED = 0


def content_key(problem: Problem | str, task: Task | None = None) -> str:
    """What makes two problems the same: `task.content_key` (a `CanonicalContent` task), else the prompt; with
    whitespace collapsed, casefolded."""
    if isinstance(problem, Problem) and isinstance(task, CanonicalContent):
        text = task.content_key(problem)
    else:
        text = problem.prompt if isinstance(problem, Problem) else problem
    return " ".join(text.split()).casefold()


def hash_share(key: str) -> float:
    """A stable, uniform number in [0, 1) for a content key (sha256; the same everywhere, unlike hash())."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0**64


class EmptySplit(ValueError):
    """One side of a split has no problem: `side` is "eval" or "train"."""

    def __init__(self, side: str, message: str):
        super().__init__(message)
        self.side = side


class TrainEvalSplit:
    """A task whose `generate` yields only training problems, plus its fixed list of eval problems.

    Args:
      task: the wrapped task (generated, or a JSONL file); it verifies both splits.
      eval_fraction: the share of all problem contents held out for eval (by `hash_share`); ignored with
        `eval_file`.
      eval_file: a JSONL file of eval problems (the formats `dataset.read_jsonl_dataset` reads); training drops
        the wrapped task's problems whose content is in it.

    Raises `EmptySplit` when either side would have no problem.
    """

    def __init__(self, task: Task, *, eval_fraction: float = 0.0, eval_file: str | None = None):
        if not eval_file and not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={eval_fraction} must be in [0, 1)")
        self.task, self.name = task, task.name
        self.eval_fraction, self.eval_file = eval_fraction, eval_file or None
        self._file_problems: list[Problem] | None = None
        self._file_keys: frozenset[str] = frozenset()
        if self.eval_file:
            self._file_problems = _read_eval_file(self.eval_file, task.name)
            self._file_keys = frozenset(self.content_key(problem) for problem in self._file_problems)
            self._warn_about_overlap()
        self.generate(1, seed=0)  # raises EmptySplit when nothing is left to train on
        if self._file_problems is None and not self.eval_problems(1, seed=0):
            raise EmptySplit("eval", f"none of the {self._distinct_seen()} distinct problems of task {task.name!r} "
                             f"(in {SEARCH_DRAWS} draws) is held out")

    # ------------------------------------------------------------------------------------------ membership
    def content_key(self, problem: Problem) -> str:
        """The problem's content, as this split compares problems (`content_key` with the wrapped task)."""
        return content_key(problem, self.task)

    def is_eval(self, problem: Problem) -> bool:
        """Whether the problem's content belongs to the eval split."""
        key = self.content_key(problem)
        if self.eval_file:
            return key in self._file_keys
        return hash_share(key) < self.eval_fraction

    # ------------------------------------------------------------------------------------------ the Task API
    def generate(self, count: int, *, seed: int) -> list[Problem]:
        """`count` training problems: the wrapped task's draws for `seed` with eval contents left out (with no
        eval content among them, exactly `task.generate(count, seed=seed)`)."""
        draws = count
        while True:
            kept = [problem for problem in self.task.generate(draws, seed=seed) if not self.is_eval(problem)]
            if len(kept) >= count:
                return kept[:count]
            if draws >= count + SEARCH_DRAWS:
                raise EmptySplit("train", f"all {self._distinct_seen()} distinct problems of task {self.name!r} "
                                 f"(in {SEARCH_DRAWS} draws) are held out; {len(kept)} of {draws} draws are left")
            draws = min(2 * draws, count + SEARCH_DRAWS)

    def verify(self, problem: Problem, answer: str | None) -> bool:
        return self.task.verify(problem, answer)

    # ------------------------------------------------------------------------------------------ eval side
    def eval_problems(self, count: int, *, seed: int) -> list[Problem]:
        """Up to `count` distinct eval problems, the same list for the same (count, seed); fewer when the eval
        split has fewer distinct problems. Input ids are `<task>-eval-<index>`."""
        if self._file_problems is not None:
            found = self._distinct(self._file_problems)
            # A seeded shuffle, so a count below the file's size takes a sample of it, not its head.
            order = sorted(range(len(found)), key=lambda index: zlib.crc32(f"{seed}/{index}".encode()))
            chosen = [found[index] for index in order[:count]]
        else:
            chosen = []
            seen: set[str] = set()
            for problem in self._draws(seed, count):
                key = self.content_key(problem)
                if key not in seen and hash_share(key) < self.eval_fraction:
                    seen.add(key)
                    chosen.append(problem)
                    if len(chosen) == count:
                        break
        prefix = self.name.replace("_", "-")  # sample ids split on "_"
        return [dataclasses.replace(problem, input_id=f"{prefix}-eval-{index}")
                for index, problem in enumerate(chosen)]

    def _draws(self, seed: int, count: int) -> Iterator[Problem]:
        """The wrapped task's problems for eval seed `seed`, chunk after chunk: SEARCH_DRAWS, or (up to 16 times
        that) enough to meet `count` distinct eval problems about 8 times over in a large problem space."""
        if self.eval_fraction <= 0:
            return
        draws = min(max(SEARCH_DRAWS, math.ceil(8 * count / self.eval_fraction)), 16 * SEARCH_DRAWS)
        for chunk in range(math.ceil(draws / _CHUNK)):
            yield from self.task.generate(_CHUNK, seed=zlib.crc32(f"eval/{seed}/{chunk}".encode()))

    # ------------------------------------------------------------------------------------------ checks
    def _distinct_seen(self) -> int:
        return len({self.content_key(problem) for problem in self.task.generate(SEARCH_DRAWS, seed=0)})

    def _distinct(self, problems: list[Problem]) -> list[Problem]:
        """The first problem of each content, in order."""
        seen: set[str] = set()
        kept = []
        for problem in problems:
            key = self.content_key(problem)
            if key not in seen:
                seen.add(key)
                kept.append(problem)
        return kept

    def _warn_about_overlap(self) -> None:
        records = getattr(self.task, "records", None)
        if records is None:
            return
        # A file task's problems are their prompts: its lines compare by prompt.
        overlap = sum(content_key(record.prompt) in self._file_keys for record in records)
        if overlap:
            logger.warning("%d of %d lines of %s also appear in the eval file %s; they are held out of training",
                           overlap, len(records), getattr(self.task, "path", self.name), self.eval_file)


def _read_eval_file(path: str, task_name: str) -> list[Problem]:
    """Every usable line of an eval file as a problem (meta: its line, and the file)."""
    dataset = read_jsonl_dataset(path)
    return [Problem(f"{task_name.replace('_', '-')}-evalfile-{index}", record.prompt, record.answer,
                    {"line": record.line, "file": path, **record.meta})
            for index, record in enumerate(dataset.records)]
