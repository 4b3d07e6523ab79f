"""The `word_problems` task: GSM8K-format questions whose reference answers are what the question says, a
held-out split by content (names do not count), and math-verify rewards."""

import re

import pytest

from flexmarl_jax.workflows import TASK_BUILDERS, build_task
from flexmarl_jax.workflows.splits import TrainEvalSplit
from flexmarl_jax.workflows.word_problems import NAMES, TEMPLATES, WordProblemTask


def _solve_by_steps(reasoning: str) -> int:
    """Recomputes every worked step ("a op b = c") and returns the last result, checking each one."""
    result = None
    for line in reasoning.splitlines()[:-1]:
        left, right = line.split(" = ")
        a, op, b = left.split()
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b), "/": int(a) // int(b)}[op]
        if op == "/":
            assert int(a) % int(b) == 0, line  # shares are whole
        assert value == int(right), line
        result = value
    assert reasoning.splitlines()[-1] == f"#### {result}"
    return result


def test_registered_and_every_template_is_drawn():
    assert TASK_BUILDERS["word_problems"] is WordProblemTask
    problems = build_task("word_problems").generate(2000, seed=3)
    assert {problem.meta["template"] for problem in problems} == set(TEMPLATES)
    assert len(TEMPLATES) == 16 and {t.steps for t in TEMPLATES.values()} == {1, 2}


def test_answers_are_whole_non_negative_and_follow_from_the_numbers_in_the_question():
    for problem in WordProblemTask().generate(3000, seed=0):
        answer = int(problem.answer)
        assert answer >= 0
        assert _solve_by_steps(problem.meta["reasoning"]) == answer
        # the drawn numbers are in the question ("share" states the total and the friends, not each share)
        numbers = problem.meta["numbers"]
        shown = numbers[:1] if problem.meta["template"] == "share" else numbers
        assert {str(n) for n in shown} <= set(re.findall(r"\d+", problem.prompt))
        assert problem.prompt.endswith("?") and "_" not in problem.input_id


def test_generation_is_deterministic_per_seed_and_varies_across_seeds():
    task = WordProblemTask()
    assert task.generate(50, seed=7) == task.generate(50, seed=7)
    assert [p.prompt for p in task.generate(50, seed=7)] != [p.prompt for p in task.generate(50, seed=8)]


def test_steps_option_selects_one_or_two_step_templates():
    one = WordProblemTask(steps="1").generate(300, seed=0)
    two = WordProblemTask(steps="2").generate(300, seed=0)
    assert {p.meta["steps"] for p in one} == {1} and {p.meta["steps"] for p in two} == {2}
    with pytest.raises(ValueError, match="steps='3' must be one of"):
        WordProblemTask(steps="3")
    with pytest.raises(ValueError, match="unknown verifier"):
        WordProblemTask(verifier="fuzzy")


def test_content_ignores_names_so_eval_questions_are_not_trained_under_other_names():
    task = WordProblemTask()
    split = TrainEvalSplit(task, eval_fraction=0.2)
    eval_problems = split.eval_problems(200, seed=0)
    assert len(eval_problems) == 200
    eval_keys = {split.content_key(problem) for problem in eval_problems}
    assert len(eval_keys) == 200  # distinct contents
    train = split.generate(2000, seed=1)
    assert not eval_keys & {split.content_key(problem) for problem in train}
    # the same numbers and item under other names are one content
    problem = eval_problems[0]
    renamed = problem.prompt
    for name, _ in NAMES:
        renamed = renamed.replace(name, "Zed")
    assert renamed != problem.prompt
    assert task.content_key(problem) == task.content_key(type(problem)(problem.input_id, renamed, problem.answer,
                                                                      problem.meta))


def test_math_verifier_reads_final_answers_as_the_chat_parser_gives_them():
    task = WordProblemTask()
    problem = next(p for p in task.generate(100, seed=0) if int(p.answer) >= 10)
    assert task.verify(problem, problem.answer)
    assert task.verify(problem, f"{problem.answer}.0")
    assert task.verify(problem, f"\\boxed{{{problem.answer}}}")
    assert not task.verify(problem, str(int(problem.answer) + 1))
    assert not task.verify(problem, None)
    assert WordProblemTask(verifier="numeric").verify(problem, f"{problem.answer} apples")
