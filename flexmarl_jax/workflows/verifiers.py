"""Lenient answer parsing and exact verifiers. Nothing here raises on model output.

A tiny model's completions are often malformed ("", "1 9", "19=", "abc"); a verifier must say "wrong",
never crash the rollout.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from fractions import Fraction

from flexmarl_jax.workflows import math_answers

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
# Longest expression a verifier will even look at: bounds the work a pathological completion can cause.
MAX_EXPRESSION_CHARS = 64


def first_line(text: str | None) -> str | None:
    """The first non-empty line, stripped; None when there is none."""
    if not isinstance(text, str):
        return None
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return None


def parse_number(text: str | None) -> float | int | None:
    """The first number in the first line ("answer: 19." -> 19); None when there is none."""
    line = first_line(text)
    if line is None:
        return None
    match = _NUMBER.search(line)
    if match is None:
        return None
    token = match.group(0)
    try:
        if re.fullmatch(r"[-+]?\d+", token):
            return int(token)
        value = float(token)
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def numeric_match(answer: str | None, reference: str, *, rel_tol: float = 1e-6) -> bool:
    """True iff the first number in `answer` equals the reference number (ints exactly)."""
    got, want = parse_number(answer), parse_number(reference)
    if got is None or want is None:
        return False
    if isinstance(got, int) and isinstance(want, int):
        return got == want
    return math.isclose(float(got), float(want), rel_tol=rel_tol, abs_tol=1e-9)


def exact_match(answer: str | None, reference: str, *, case_sensitive: bool = True) -> bool:
    """True iff the first line of `answer`, stripped, equals the stripped reference."""
    got = first_line(answer)
    if got is None:
        return False
    want = reference.strip()
    return got == want if case_sensitive else got.lower() == want.lower()


def math_match(answer: str | None, reference: str) -> bool:
    """True iff math-verify finds `answer` equal to `reference` ("42.0", "$42$", "\\boxed{42}" all match "42").

    Runs in the process-wide `math_answers.shared_checker()`; a timeout or a crash there is a wrong answer.
    """
    return math_answers.shared_checker().check(answer, reference)


VERIFIERS: dict[str, Callable[[str | None, str], bool]] = {
    "exact": exact_match,
    "numeric": numeric_match,
    "math": math_match,
}


def get_verifier(name: str) -> Callable[[str | None, str], bool]:
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; allowed: {sorted(VERIFIERS)}")
    if name == "math":  # fail at config time, not on the first reward
        math_answers.require_math_verify()
    return VERIFIERS[name]


# ----------------------------------------------------------------------------------------------------------
# Arithmetic expressions (Countdown): a tiny recursive-descent parser over exact fractions.
# ----------------------------------------------------------------------------------------------------------
_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")


class _ExpressionError(Exception):
    pass


def _tokenize(text: str) -> list[str]:
    tokens = []
    for number, symbol in _TOKEN.findall(text):
        token = number or symbol
        if token.strip():
            tokens.append(token)
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ; factor := int | '(' expr ')'."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.position, self.numbers = tokens, 0, []

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise _ExpressionError("unexpected end")
        self.position += 1
        return token

    def expression(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/", "x", "×", "÷"):
            operator = self.take()
            right = self.factor()
            if operator in ("/", "÷"):
                if right == 0:
                    raise _ExpressionError("division by zero")
                value = value / right
            else:
                value = value * right
        return value

    def factor(self) -> Fraction:
        token = self.take()
        if token == "(":
            value = self.expression()
            if self.take() != ")":
                raise _ExpressionError("missing )")
            return value
        if token.isdigit():
            self.numbers.append(int(token))
            return Fraction(int(token))
        raise _ExpressionError(f"unexpected {token!r}")


def evaluate_expression(text: str | None) -> tuple[Fraction, list[int]] | None:
    """(exact value, the integer literals used) of an arithmetic expression; None if malformed.

    Accepts + - * / (also x × ÷) and parentheses, with or without a trailing "=...".
    """
    line = first_line(text)
    if line is None or len(line) > MAX_EXPRESSION_CHARS:
        return None
    line = line.split("=")[0]
    try:
        parser = _Parser(_tokenize(line))
        value = parser.expression()
        if parser.peek() is not None:
            return None
        return value, parser.numbers
    except (_ExpressionError, RecursionError, ZeroDivisionError, ValueError):
        return None


def countdown_match(answer: str | None, numbers: Sequence[int], target: int, *, use_all: bool = True) -> bool:
    """True iff `answer` is an expression over `numbers` (each at most once; all when `use_all`) = target."""
    evaluated = evaluate_expression(answer)
    if evaluated is None:
        return False
    value, used = evaluated
    available = sorted(numbers)
    if use_all:
        if sorted(used) != available:
            return False
    else:
        remaining = list(available)
        for number in used:
            if number not in remaining:
                return False
            remaining.remove(number)
    return value == target
