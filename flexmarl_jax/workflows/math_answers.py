"""Math answers: the final answer of a worked solution, and checking it against a reference with math-verify.

math-verify compares answers as mathematics ("42.0", "$42$" and "\\boxed{42}" all equal 42; "\\frac{1}{2}"
equals 0.5), but bounds its own work with `signal.alarm`, which works only on a main thread, and rewards are
computed on rollout threads. So `MathAnswerChecker` runs math-verify in worker processes (on their main threads,
where its alarms do work) and enforces a per-answer deadline from the caller's side as well: an answer stuck in
C code that no alarm interrupts, or one that crashes its worker, is simply wrong.

This module imports only the standard library; math-verify (and sympy) are imported in the workers.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import re
import threading

from flexmarl_jax.workflows.process_pool import PoolCallError, PoolClosed, TimedProcessPool, WorkerLost

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ final answers
_BOXED = re.compile(r"\\boxed\s*\{")
_HASHES = re.compile(r"####\s*(.*)")
_ANSWER_IS = re.compile(r"\banswer(?:\s+is\b|\s*:)[\s:*]*(.*)", re.IGNORECASE)
# A number with thousands separators ("1,234.5") or a plain one; the last one is the fallback answer.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def _boxed_contents(text: str) -> str | None:
    """The contents of the last \\boxed{...}, braces balanced; None if there is none or it is unclosed."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1
    for position in range(start, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start:position].strip()
    return None


def _clean(answer: str) -> str | None:
    """An answer written in prose: markdown/LaTeX dollars and a closing period stripped, "1,234" -> "1234"."""
    answer = answer.strip().strip("*$ ").rstrip(".").strip("*$ ")
    return _THOUSANDS_COMMA.sub("", answer) or None


def extract_final_answer(text: str | None) -> str | None:
    """The final answer of a worked solution; None when the text holds none.

    Chat models write their reasoning first, so the answer is looked for, in order: the last \\boxed{...},
    the text after the last "####" (GSM8K's marker), after the last "answer is" / "answer:", else the last
    number in the text.
    """
    if not isinstance(text, str) or not text.strip():
        return None
    boxed = _boxed_contents(text)
    if boxed:
        return boxed
    for pattern in (_HASHES, _ANSWER_IS):
        for match in reversed(list(pattern.finditer(text))):
            answer = _clean(match.group(1))
            if answer:
                return answer
    numbers = _NUMBER.findall(text)
    return _THOUSANDS_COMMA.sub("", numbers[-1]) if numbers else None


# ------------------------------------------------------------------------------------ checking
def math_verify_check(prediction: str, reference: str, alarm_s: int) -> bool:
    """math-verify's verdict on `prediction` against `reference`. Runs in a worker process.

    `alarm_s` is math-verify's own timeout for each parse and comparison (signal.alarm: whole seconds, and only
    on a main thread, which a worker's is); it ends most slow expressions without losing the worker.
    """
    # lazy: math_verify pulls sympy (0.43 s); only the checker's worker processes call this
    from math_verify import parse, verify

    gold = parse(reference, parsing_timeout=alarm_s)
    answer = parse(prediction, parsing_timeout=alarm_s)
    return bool(gold) and bool(answer) and bool(verify(gold, answer, timeout_seconds=alarm_s))


def require_math_verify() -> None:
    """Raise a one-line error unless the math-verify package is installed (checked at config time)."""
    if importlib.util.find_spec("math_verify") is None:
        raise ValueError("verifier 'math' needs the math-verify package: pip install math-verify")


class MathAnswerChecker:
    """`check(prediction, reference)`: math-verify's verdict, from a pool of worker processes.

    Args:
      workers: answers checked at once (worker processes, started on the first check and reused).
      timeout_s: the most one answer may take in its worker; past it the worker is killed and replaced and the
        answer counts as wrong. A check may also wait for a busy pool, or once for a worker to start.

    Thread-safe. `close()` stops the workers.
    """

    def __init__(self, workers: int = 2, timeout_s: float = 5.0):
        # math-verify's own alarms (whole seconds) fire well inside the caller's deadline: a prediction is
        # parsed and then compared, and the reference is parsed first.
        self.alarm_s = max(1, int(timeout_s / 3))
        self._pool = TimedProcessPool(
            math_verify_check,
            workers=workers,
            timeout_s=timeout_s,
            warm_up_args=("1", "1", self.alarm_s),
            name="math-answer-checker",
        )
        self._reported_errors: set[str] = set()

    @property
    def replaced_workers(self) -> int:
        """Workers killed for a timeout or found dead so far."""
        return self._pool.replaced

    def start(self) -> None:
        """Start the workers now (they warm up in the background) rather than on the first check."""
        self._pool.start()

    def check(self, prediction: str | None, reference: str) -> bool:
        """True iff `prediction` is mathematically `reference`; False for no answer, a timeout or a crash.

        Raises PoolClosed after `close()`.
        """
        if not isinstance(prediction, str) or not prediction.strip():
            return False
        try:
            return bool(self._pool.call(prediction, reference, self.alarm_s))
        except PoolClosed:
            raise
        except WorkerLost as error:
            logger.warning("math answer check of %.80r counted as wrong: %s", prediction, error)
            return False
        except PoolCallError as error:  # math-verify raised, or the workers cannot start: say so once
            if str(error) not in self._reported_errors:
                self._reported_errors.add(str(error))
                logger.error("math answer checks fail (answers count as wrong): %s", error)
            return False

    def close(self) -> None:
        self._pool.close()


_shared_checker: MathAnswerChecker | None = None
_shared_lock = threading.Lock()


def shared_checker() -> MathAnswerChecker:
    """The process-wide checker (default settings), created on first use and closed at exit."""
    global _shared_checker
    with _shared_lock:
        if _shared_checker is None:
            _shared_checker = MathAnswerChecker()
            atexit.register(_shared_checker.close)
        return _shared_checker
