import json
import threading
import time

import pytest

from flexmarl_jax.workflows import math_answers, verifiers
from flexmarl_jax.workflows.dataset import JsonlTask
from flexmarl_jax.workflows.graph import PARSERS, Node
from flexmarl_jax.workflows.math_answers import MathAnswerChecker, extract_final_answer
from flexmarl_jax.workflows.process_pool import PoolClosed

# (prediction, reference, math-verify's verdict)
TABLE = [
    ("42", "42", True),
    ("42.0", "42", True),
    ("$42$", "42", True),
    ("\\boxed{42}", "42", True),
    ("The answer is 42.", "42", True),
    ("\\frac{1}{2}", "0.5", True),
    ("0.5", "\\frac{1}{2}", True),
    ("\\boxed{\\frac{3}{4}}", "0.75", True),
    ("1234", "1234", True),
    ("-3", "-3", True),
    ("43", "42", False),
    ("3", "-3", False),
    ("0.49", "\\frac{1}{2}", False),
    ("abc", "42", False),
    ("", "42", False),
    (None, "42", False),
]


@pytest.fixture(scope="module")
def checker():
    checker = MathAnswerChecker(workers=2, timeout_s=2.0)
    yield checker
    checker.close()


@pytest.mark.timeout(60)
def test_math_verify_verdicts(checker):
    assert [checker.check(prediction, reference) for prediction, reference, _ in TABLE] == [
        verdict for _, _, verdict in TABLE
    ]


@pytest.mark.timeout(60)
def test_checks_from_many_threads_at_once(checker):
    cases = [(str(n), str(n), True) for n in range(12)] + [(str(n + 1), str(n), False) for n in range(12)]
    results = [None] * len(cases)

    def check(index):
        prediction, reference, _ = cases[index]
        results[index] = checker.check(prediction, reference)

    threads = [threading.Thread(target=check, args=(index,)) for index in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == [verdict for _, _, verdict in cases]
    assert checker.replaced_workers == 0


@pytest.mark.timeout(60)
def test_an_answer_past_the_deadline_is_wrong_and_the_checker_recovers():
    # (10^8)! takes math-verify seconds even with its own 1 s alarms (each stage gets one, and sympy's big
    # integer work runs in C where no alarm lands): the caller's 1 s deadline ends it by killing the worker.
    checker = MathAnswerChecker(workers=1, timeout_s=1.0)
    try:
        assert checker.check("7", "7")  # started and warm
        started = time.monotonic()
        assert not checker.check("$(10^{8})!$", "42")
        assert time.monotonic() - started < 1.0 + 1.5
        assert checker.replaced_workers == 1
        assert checker.check("42.0", "42") and not checker.check("41", "42")  # the replacement serves
    finally:
        checker.close()
    with pytest.raises(PoolClosed):
        checker.check("1", "1")


@pytest.mark.parametrize(
    "text, answer",
    [
        ("First 3 + 4 = 7, so \\boxed{7}. Check: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("She has 5 + 37 = 42 apples.\n#### 42", "42"),
        ("Total: 1,200 + 34 = 1,234\n#### 1,234", "1234"),
        ("So the answer is $1,234$.", "1234"),
        ("**Final Answer:** 18", "18"),
        ("The answer is: **-2.5**.", "-2.5"),
        ("5 boxes of 8 make 40, minus 3 leaves 37 apples.", "37"),
        ("It costs 1,500 dollars", "1500"),
        ("\\boxed{unclosed 12", "12"),  # no closed box: the last number
        ("no numbers here", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_final_answer(text, answer):
    assert extract_final_answer(text) == answer


def test_math_node_parser_and_verifier_are_registered():
    assert Node("solver", "solver", parser="math").parse("12 * 3 = 36, so the answer is 36.") == "36"
    assert PARSERS["math"] is extract_final_answer
    assert verifiers.get_verifier("math") is verifiers.math_match


@pytest.mark.timeout(60)
def test_gsm8k_task_checks_a_chat_completion_with_the_shared_checker(checker, monkeypatch, tmp_path):
    monkeypatch.setattr(math_answers, "_shared_checker", checker)
    assert math_answers.shared_checker() is checker
    assert verifiers.math_match("$\\frac{84}{2}$", "42") and not verifiers.math_match("41", "42")
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"question": "1000 + 234?", "answer": "1,000 + 234 = 1,234\n#### 1,234"}) + "\n")
    task = JsonlTask(path)
    problem = task.generate(1, seed=0)[0]
    parse = Node("solver", "solver", parser="math").parse
    assert task.verify(problem, parse("1000 + 234 = 1234.\nSo the final answer is $\\boxed{1,234}$."))
    assert task.verify(problem, parse("Adding them gives 1,234 in total."))
    assert not task.verify(problem, parse("1000 + 234 = 1243, the answer is 1243"))


def test_math_verifier_needs_math_verify(monkeypatch):
    monkeypatch.setattr(math_answers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="verifier 'math' needs the math-verify package: pip install math-verify"):
        verifiers.get_verifier("math")
