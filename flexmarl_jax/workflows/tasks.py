"""Embedded tasks with exact verifiers, generated deterministically from a seed.

Prompts and answers are short on purpose: they must suit a tiny character-level model trained from
scratch on a CPU in minutes, and the workflow templates append upstream answers to them (the tiny config's
max prompt length is ~64 characters).

Every task exposes `generate(count, seed=...) -> list[Problem]` and `verify(problem, answer) -> bool`;
`answer` is the parsed text of a completion (may be None or garbage; `verify` never raises).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import string
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any, Protocol, runtime_checkable

from flexmarl_jax.workflows import verifiers


@dataclasses.dataclass(frozen=True)
class Problem:
    """One query. `input_id` has no underscore (sample ids are `{input_id}_{turn}_{trajectory_id}`)."""

    input_id: str
    prompt: str
    answer: str  # a reference answer (for Countdown one valid expression among possibly many)
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Task(Protocol):
    name: str

    def generate(self, count: int, *, seed: int) -> list[Problem]: ...

    def verify(self, problem: Problem, answer: str | None) -> bool: ...


@runtime_checkable
class CanonicalContent(Protocol):
    """A task whose problems can be one problem under several prompts ("3+4=" and "4+3="): `content_key` names
    the problem itself, so that a held-out split (splits.py) keeps every prompt of it on one side."""

    def content_key(self, problem: Problem) -> str: ...


def make_input_id(task_name: str, seed: int, index: int) -> str:
    """Ids differ across seeds so problems of different iterations never share sample ids."""
    return f"{task_name}-s{seed}-{index}".replace("_", "-")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """ "12+7=" -> "19". Difficulty: operand digits, operators, answer range.

    Args:
      min_digits/max_digits: digits per operand.
      operators: subset of "+-*".
      max_answer: resample until |answer| <= max_answer (keeps answers 1-3 digits by default).
      allow_negative: otherwise "a-b" is generated with a >= b.
    """

    min_digits: int = 1
    max_digits: int = 2
    operators: str = "+-"
    max_answer: int = 999
    allow_negative: bool = False
    name: str = "arithmetic"

    def __post_init__(self):
        _check_positive("min_digits", self.min_digits)
        _check_positive("max_digits", self.max_digits)
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits={self.min_digits} must be <= max_digits={self.max_digits}")
        if not self.operators or set(self.operators) - set("+-*"):
            raise ValueError(f"operators={self.operators!r} must be a non-empty subset of '+-*'")
        _check_positive("max_answer", self.max_answer)

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    def generate(self, count: int, *, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        problems = []
        for index in range(count):
            for _ in range(10_000):
                left, right, operator = self._operand(rng), self._operand(rng), rng.choice(self.operators)
                if operator == "-" and not self.allow_negative and left < right:
                    left, right = right, left
                value = {"+": left + right, "-": left - right, "*": left * right}[operator]
                if abs(value) <= self.max_answer:
                    break
            else:
                raise ValueError(
                    f"ArithmeticTask{self} cannot produce an answer <= max_answer={self.max_answer}"
                )
            problems.append(
                Problem(
                    make_input_id(self.name, seed, index),
                    f"{left}{operator}{right}=",
                    str(value),
                    {"left": left, "right": right, "operator": operator},
                )
            )
        return problems

    def verify(self, problem: Problem, answer: str | None) -> bool:
        return verifiers.numeric_match(answer, problem.answer)

    def content_key(self, problem: Problem) -> str:
        """The sum or product with its operands in order ("4+3=" is "3+4="); a difference as written."""
        meta = problem.meta
        if {"left", "right", "operator"} - set(meta):
            return problem.prompt  # not one of this task's problems
        left, right, operator = meta["left"], meta["right"], meta["operator"]
        if operator in "+*":
            left, right = sorted((left, right))
        return f"{left}{operator}{right}="


@dataclasses.dataclass(frozen=True)
class CountdownTask:
    """ "3 5 7>22:" -> an expression using each number once that equals the target, e.g. "3*5+7".

    Args:
      count_numbers: how many numbers (all must be used).
      max_number: numbers are drawn from 1..max_number.
      operators: subset of "+-*/"; division only where exact.
      max_target: targets are 1..max_target.
    """

    count_numbers: int = 3
    max_number: int = 9
    operators: str = "+-*"
    max_target: int = 99
    name: str = "countdown"

    def __post_init__(self):
        if not 2 <= self.count_numbers <= 5:
            raise ValueError(f"count_numbers={self.count_numbers} must be in [2, 5]")
        _check_positive("max_number", self.max_number)
        _check_positive("max_target", self.max_target)
        if not self.operators or set(self.operators) - set("+-*/"):
            raise ValueError(f"operators={self.operators!r} must be a non-empty subset of '+-*/'")

    def _random_expression(self, numbers: list[int], rng: random.Random) -> tuple[str, Fraction] | None:
        """Left-to-right combination of the numbers in a random order with random operators."""
        order = list(numbers)
        rng.shuffle(order)
        text, value = str(order[0]), Fraction(order[0])
        for number in order[1:]:
            operator = rng.choice(self.operators)
            if operator == "/" and (number == 0 or (value / number).denominator != 1):
                return None
            value = {
                "+": value + number,
                "-": value - number,
                "*": value * number,
                "/": value / number if number else value,
            }[operator]
            # Parenthesise so the left-to-right value is also the standard-precedence value.
            needs_parens = operator in "*/" and any(symbol in text for symbol in "+-")
            text = f"({text}){operator}{number}" if needs_parens else f"{text}{operator}{number}"
        return text, value

    def generate(self, count: int, *, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        problems = []
        for index in range(count):
            for _ in range(10_000):
                numbers = [rng.randint(1, self.max_number) for _ in range(self.count_numbers)]
                made = self._random_expression(numbers, rng)
                if made and made[1].denominator == 1 and 1 <= made[1] <= self.max_target:
                    break
            else:
                raise ValueError(f"CountdownTask{self} cannot reach a target in 1..{self.max_target}")
            expression, value = made
            target = int(value)
            prompt = " ".join(map(str, numbers)) + f">{target}:"
            problems.append(
                Problem(
                    make_input_id(self.name, seed, index),
                    prompt,
                    expression,
                    {"numbers": tuple(numbers), "target": target},
                )
            )
        return problems

    def verify(self, problem: Problem, answer: str | None) -> bool:
        return verifiers.countdown_match(answer, problem.meta["numbers"], problem.meta["target"])

    def content_key(self, problem: Problem) -> str:
        """The numbers in order and the target: "7 3 5>22:" is "3 5 7>22:"."""
        meta = problem.meta
        if {"numbers", "target"} - set(meta):
            return problem.prompt
        return " ".join(map(str, sorted(meta["numbers"]))) + f">{meta['target']}:"


@dataclasses.dataclass(frozen=True)
class ReverseTask:
    """ "rev:abcd=" -> "dcba". Difficulty: string length and alphabet size."""

    min_length: int = 3
    max_length: int = 4
    alphabet: str = string.ascii_lowercase[:8]
    name: str = "reverse"

    def __post_init__(self):
        _check_positive("min_length", self.min_length)
        if self.min_length > self.max_length:
            raise ValueError(f"min_length={self.min_length} must be <= max_length={self.max_length}")
        if len(set(self.alphabet)) < 2 or any(c.isspace() for c in self.alphabet):
            raise ValueError(f"alphabet={self.alphabet!r} needs >= 2 distinct non-space characters")

    def generate(self, count: int, *, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        problems = []
        for index in range(count):
            text = "".join(
                rng.choice(self.alphabet) for _ in range(rng.randint(self.min_length, self.max_length))
            )
            problems.append(
                Problem(make_input_id(self.name, seed, index), f"rev:{text}=", text[::-1], {"text": text})
            )
        return problems

    def verify(self, problem: Problem, answer: str | None) -> bool:
        line = verifiers.first_line(answer)
        # Lenient: the first whitespace-separated token, so "dcba ." still counts.
        return line is not None and line.split()[0] == problem.answer


TASK_BUILDERS: dict[str, Callable[..., Task]] = {
    "arithmetic": ArithmeticTask,
    "countdown": CountdownTask,
    "reverse": ReverseTask,
}


def register_task(name: str) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    def decorator(builder: Callable[..., Task]) -> Callable[..., Task]:
        TASK_BUILDERS[name] = builder
        return builder

    return decorator


def build_task(name: str, **kwargs: Any) -> Task:
    """A task by registry name ("arithmetic", "countdown", "reverse", "jsonl") with its knobs as kwargs."""
    # "jsonl" and "word_problems" register themselves (dataset.py, word_problems.py); the package imports both.
    if name not in TASK_BUILDERS:
        raise ValueError(f"unknown task {name!r}; allowed: {sorted(TASK_BUILDERS)}")
    builder = TASK_BUILDERS[name]
    fields = (
        {field.name for field in dataclasses.fields(builder)} if dataclasses.is_dataclass(builder) else None
    )
    if fields is not None and set(kwargs) - fields:
        raise ValueError(
            f"task {name!r} got unknown options {sorted(set(kwargs) - fields)}; allowed: {sorted(fields)}"
        )
    return builder(**kwargs)


def resolve_task(spec: str, **kwargs: Any) -> Task:
    """`config.workflow.task`: a registered task name, or a path ending in .jsonl (kwargs: verifier, ...)."""
    if spec.endswith(".jsonl"):
        return build_task("jsonl", path=spec, **kwargs)
    return build_task(spec, **kwargs)


def solve_countdown(numbers: tuple[int, ...], target: int) -> str | None:
    """Brute-force one left-to-right expression reaching target (used by scripted oracle policies)."""
    for order in itertools.permutations(numbers):
        for operators in itertools.product("+-*/", repeat=len(numbers) - 1):
            text = str(order[0])
            for operator, number in zip(operators, order[1:], strict=True):
                text = (
                    f"({text}){operator}{number}"
                    if operator in "*/" and any(s in text for s in "+-")
                    else f"{text}{operator}{number}"
                )
            evaluated = verifiers.evaluate_expression(text)
            if evaluated and evaluated[0] == target:
                return text
    return None
