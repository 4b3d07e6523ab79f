"""`word_problems`: GSM8K-format word problems generated from templates, one and two arithmetic steps.

The task a small pretrained instruct model can learn on a CPU: questions in GSM8K's style ("Mia has 12 shells.
She finds 7 more and gives 5 to Omar. How many shells does Mia have now?") whose answers are whole numbers, so
that math-verify checks them (`verifier`, "math" by default) after the chat workflows' `math` parser takes the
final answer out of a worked solution.

A problem's content (`content_key`, what the held-out split compares: workflows/splits.py) is its template and
its numbers and items, not the people's names: "Mia has 12 shells ..." and "Omar has 12 shells ..." are one
problem, so a question in the eval split is not trained on under another name. With 16 templates, 40 names and 32
items there are far more contents than a run draws (each template has thousands of number choices).

`meta` holds the template's name, its step count, the numbers and a worked solution ending in "#### N" (GSM8K's
answer format), which `flexmarl_jax.workflows.dataset` would read back from a JSONL line.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable

from flexmarl_jax.workflows import verifiers
from flexmarl_jax.workflows.tasks import Problem, make_input_id, register_task

# (name, pronoun): the pronoun starts sentences, so it is capitalised.
NAMES = (
    ("Mia", "She"), ("Omar", "He"), ("Lena", "She"), ("Ravi", "He"), ("Sofia", "She"), ("Tom", "He"),
    ("Aisha", "She"), ("Lucas", "He"), ("Yuki", "She"), ("Mateo", "He"), ("Chloe", "She"), ("Kwame", "He"),
    ("Emma", "She"), ("Diego", "He"), ("Hana", "She"), ("Noah", "He"), ("Priya", "She"), ("Ben", "He"),
    ("Zara", "She"), ("Ivan", "He"), ("Grace", "She"), ("Leo", "He"), ("Amara", "She"), ("Sam", "He"),
    ("Nora", "She"), ("Felix", "He"), ("Julia", "She"), ("Hugo", "He"), ("Elif", "She"), ("Jonas", "He"),
    ("Maya", "She"), ("Arjun", "He"), ("Rosa", "She"), ("Owen", "He"), ("Ines", "She"), ("Kenji", "He"),
    ("Lily", "She"), ("Marco", "He"), ("Fatima", "She"), ("Ethan", "He"),
)
# (singular, plural) of countable things a person can have, buy, share and pack.
ITEMS = (
    ("apple", "apples"), ("pencil", "pencils"), ("sticker", "stickers"), ("marble", "marbles"),
    ("cookie", "cookies"), ("book", "books"), ("card", "cards"), ("shell", "shells"), ("flower", "flowers"),
    ("balloon", "balloons"), ("cupcake", "cupcakes"), ("stamp", "stamps"), ("orange", "oranges"),
    ("toy car", "toy cars"), ("bead", "beads"), ("egg", "eggs"), ("candle", "candles"), ("crayon", "crayons"),
    ("button", "buttons"), ("notebook", "notebooks"), ("lemon", "lemons"), ("muffin", "muffins"),
    ("peach", "peaches"), ("tomato", "tomatoes"), ("ribbon", "ribbons"), ("puzzle", "puzzles"),
    ("sandwich", "sandwiches"), ("seashell", "seashells"), ("carrot", "carrots"), ("plum", "plums"),
    ("comic", "comics"), ("paintbrush", "paintbrushes"),
)


@dataclasses.dataclass(frozen=True)
class Filled:
    """One template filled in: the question, the worked steps and the answer."""

    question: str
    steps: tuple[str, ...]
    answer: int


@dataclasses.dataclass(frozen=True)
class Template:
    """A question pattern: `draw(rng)` picks its numbers (answers whole and >= 0 by construction), `fill` writes it.

    `fill(numbers, person, pronoun, friend, item, items)` -> Filled.
    """

    name: str
    steps: int
    draw: Callable[[random.Random], tuple[int, ...]]
    fill: Callable[..., Filled]


def _one_step() -> list[Template]:
    def add(n, p, s, f, item, items):
        a, b = n
        return Filled(f"{p} has {a} {items}. {s} buys {b} more. How many {items} does {p} have now?",
                      (f"{a} + {b} = {a + b}",), a + b)

    def give(n, p, s, f, item, items):
        a, b = n
        return Filled(f"{p} had {a} {items} and gave {b} of them to {f}. How many {items} does {p} have left?",
                      (f"{a} - {b} = {a - b}",), a - b)

    def packs(n, p, s, f, item, items):
        a, b = n
        return Filled(f"{p} buys {a} packs of {items}. Each pack holds {b} {items}. How many {items} does {p} buy?",
                      (f"{a} * {b} = {a * b}",), a * b)

    def share(n, p, s, f, item, items):
        a, b = n
        return Filled(f"{p} shares {a * b} {items} equally among {a} friends. How many {items} does each friend "
                      "get?", (f"{a * b} / {a} = {b}",), b)

    def price(n, p, s, f, item, items):
        a, b = n
        return Filled(f"One {item} costs ${a}. How many dollars does {p} pay for {b} {items}?",
                      (f"{b} * {a} = {a * b}",), a * b)

    def more_than(n, p, s, f, item, items):
        a, b = n
        return Filled(f"{p} has {a} {items}. {f} has {b} more {items} than {p}. How many {items} does {f} have?",
                      (f"{a} + {b} = {a + b}",), a + b)

    def per_day(n, p, s, f, item, items):
        a, b = n
        return Filled(f"{p} makes {a} {items} every day. How many {items} does {p} make in {b} days?",
                      (f"{a} * {b} = {a * b}",), a * b)

    def fewer_than(n, p, s, f, item, items):
        a, b = n
        return Filled(f"{p} has {a} {items}. {f} has {b} fewer {items} than {p}. How many {items} does {f} have?",
                      (f"{a} - {b} = {a - b}",), a - b)

    pair = lambda low, high: lambda rng: (rng.randint(low, high), rng.randint(low, high))  # noqa: E731
    minus = lambda rng: (lambda a: (a, rng.randint(1, a - 1)))(rng.randint(5, 60))  # noqa: E731
    return [
        Template("add", 1, pair(2, 60), add),
        Template("give", 1, minus, give),
        Template("packs", 1, pair(2, 12), packs),
        Template("share", 1, pair(2, 12), share),
        Template("price", 1, pair(2, 15), price),
        Template("more_than", 1, pair(2, 50), more_than),
        Template("per_day", 1, pair(2, 12), per_day),
        Template("fewer_than", 1, minus, fewer_than),
    ]


def _two_step() -> list[Template]:
    def buy_and_give(n, p, s, f, item, items):
        a, b, c = n
        return Filled(f"{p} has {a} {items}. {s} buys {b} more and then gives {c} to {f}. How many {items} does "
                      f"{p} have now?", (f"{a} + {b} = {a + b}", f"{a + b} - {c} = {a + b - c}"), a + b - c)

    def boxes_and_loose(n, p, s, f, item, items):
        a, b, c = n
        return Filled(f"{p} has {a} boxes of {items} with {b} {items} in each box, and {c} more {items} outside "
                      f"the boxes. How many {items} does {p} have in total?",
                      (f"{a} * {b} = {a * b}", f"{a * b} + {c} = {a * b + c}"), a * b + c)

    def change(n, p, s, f, item, items):
        a, b, c = n
        return Filled(f"{p} buys {a} {items} at ${b} each and pays with a ${c} bill. How many dollars of change "
                      f"does {p} get?", (f"{a} * {b} = {a * b}", f"{c} - {a * b} = {c - a * b}"), c - a * b)

    def times_as_many(n, p, s, f, item, items):
        a, b = n
        return Filled(f"{p} has {a} {items}. {f} has {b} times as many {items} as {p}. How many {items} do they "
                      "have together?", (f"{a} * {b} = {a * b}", f"{a} + {a * b} = {a + a * b}"), a + a * b)

    def earn_and_spend(n, p, s, f, item, items):
        a, b, c = n
        return Filled(f"{p} earns ${a} a week for {b} weeks and then spends ${c} on {items}. How many dollars "
                      f"does {p} have left?", (f"{a} * {b} = {a * b}", f"{a * b} - {c} = {a * b - c}"), a * b - c)

    def pick_and_share(n, p, s, f, item, items):
        a, b, c = n
        return Filled(f"{p} picks {a} {items} and {f} picks {b} {items}. They put them equally into {c} baskets. "
                      f"How many {items} go into each basket?",
                      (f"{a} + {b} = {a + b}", f"{a + b} / {c} = {(a + b) // c}"), (a + b) // c)

    def together_fewer(n, p, s, f, item, items):
        a, b = n
        return Filled(f"{p} has {a} {items}. {f} has {b} fewer {items} than {p}. How many {items} do they have "
                      "together?", (f"{a} - {b} = {a - b}", f"{a} + {a - b} = {2 * a - b}"), 2 * a - b)

    def rows(n, p, s, f, item, items):
        a, b, c = n
        return Filled(f"{p} sets out {a} rows of {items} with {b} {items} in each row. Then {c} of them are "
                      f"taken away. How many {items} are left?",
                      (f"{a} * {b} = {a * b}", f"{a * b} - {c} = {a * b - c}"), a * b - c)

    def draw_change(rng):
        a, b = rng.randint(2, 8), rng.randint(2, 9)
        return a, b, rng.choice([bill for bill in (20, 50, 100) if bill >= a * b])

    def draw_earn(rng):
        a, b = rng.randint(5, 30), rng.randint(2, 8)
        return a, b, rng.randint(1, a * b - 1)

    def draw_pick(rng):
        c, each = rng.randint(2, 8), rng.randint(2, 12)
        a = rng.randint(1, c * each - 1)
        return a, c * each - a, c

    def draw_rows(rng):
        a, b = rng.randint(2, 10), rng.randint(2, 10)
        return a, b, rng.randint(1, a * b - 1)

    def draw_buy_give(rng):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        return a, b, rng.randint(1, a + b - 1)

    return [
        Template("buy_and_give", 2, draw_buy_give, buy_and_give),
        Template("boxes_and_loose", 2, lambda rng: (rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 20)),
                 boxes_and_loose),
        Template("change", 2, draw_change, change),
        Template("times_as_many", 2, lambda rng: (rng.randint(2, 20), rng.randint(2, 5)), times_as_many),
        Template("earn_and_spend", 2, draw_earn, earn_and_spend),
        Template("pick_and_share", 2, draw_pick, pick_and_share),
        Template("together_fewer", 2, lambda rng: (lambda a: (a, rng.randint(1, a - 1)))(rng.randint(5, 50)),
                 together_fewer),
        Template("rows", 2, draw_rows, rows),
    ]


TEMPLATES: dict[str, Template] = {template.name: template for template in _one_step() + _two_step()}


@register_task("word_problems")
@dataclasses.dataclass(frozen=True)
class WordProblemTask:
    """GSM8K-format word problems with whole-number answers (module docstring).

    Args:
      steps: which problems to draw: "1" (one arithmetic step), "2" (two steps) or "1,2" (both, half each).
      verifier: how a parsed answer is checked against the reference: "math" (math-verify), "numeric" or "exact".
      name: prefix of input ids (no underscores).
    """

    steps: str = "1,2"
    verifier: str = "math"
    name: str = "wordproblems"

    def __post_init__(self):
        allowed = {"1", "2", "1,2"}
        if self.steps not in allowed:
            raise ValueError(f"steps={self.steps!r} must be one of {sorted(allowed)}")
        if "_" in self.name:
            raise ValueError(f"name={self.name!r} must not contain '_' (sample ids are split on it)")
        self._verify  # noqa: B018 - raises now for an unknown name, or math without math-verify

    def templates(self) -> list[Template]:
        wanted = {int(part) for part in self.steps.split(",")}
        return [template for template in TEMPLATES.values() if template.steps in wanted]

    def generate(self, count: int, *, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        templates = self.templates()
        problems = []
        for index in range(count):
            template = rng.choice(templates)
            numbers = template.draw(rng)
            (person, pronoun), (friend, _) = rng.sample(NAMES, 2)
            item, items = rng.choice(ITEMS)
            filled = template.fill(numbers, person, pronoun, friend, item, items)
            solution = "\n".join(filled.steps) + f"\n#### {filled.answer}"
            meta = {"template": template.name, "steps": template.steps, "numbers": numbers, "item": items,
                    "reasoning": solution}
            problems.append(Problem(make_input_id(self.name, seed, index), filled.question, str(filled.answer),
                                    meta))
        return problems

    @functools.cached_property
    def _verify(self) -> Callable[[str | None, str], bool]:
        """The verifier function, looked up once (not per reward)."""
        return verifiers.get_verifier(self.verifier)

    def verify(self, problem: Problem, answer: str | None) -> bool:
        return self._verify(answer, problem.answer)

    def content_key(self, problem: Problem) -> str:
        """Template, numbers and item: the question without its people's names."""
        meta = problem.meta
        if {"template", "numbers", "item"} - set(meta):
            return problem.prompt  # not one of this task's problems
        return f"{meta['template']}:{','.join(map(str, meta['numbers']))}:{meta['item']}"
