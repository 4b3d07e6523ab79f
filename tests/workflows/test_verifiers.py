from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexmarl_jax.workflows import verifiers


@pytest.mark.parametrize(
    "text, expected",
    [
        ("19", 19),
        (" 19\n", 19),
        ("answer: 19.", 19),
        ("-4", -4),
        ("1 9", 1),
        ("2.5", 2.5),
        ("\n\n7", 7),
        ("", None),
        ("abc", None),
        (None, None),
        ("nan", None),
        ("1e999", None),
    ],
)
def test_parse_number_is_lenient(text, expected):
    assert verifiers.parse_number(text) == expected


def test_numeric_and_exact_match():
    assert verifiers.numeric_match("19 ", "19")
    assert verifiers.numeric_match("=19", "19")
    assert not verifiers.numeric_match("18", "19")
    assert not verifiers.numeric_match("", "19")
    assert verifiers.numeric_match("0.30000000001", "0.3")
    assert verifiers.exact_match(" dcba \nmore", "dcba")
    assert not verifiers.exact_match("dcb", "dcba")
    assert not verifiers.exact_match("DCBA", "dcba")
    assert verifiers.exact_match("DCBA", "dcba", case_sensitive=False)
    with pytest.raises(ValueError, match="allowed"):
        verifiers.get_verifier("fuzzy")


@pytest.mark.parametrize(
    "text, value, numbers",
    [
        ("3*5+7", 22, [3, 5, 7]),
        ("(3+5)*7", 56, [3, 5, 7]),
        ("8/4-1", 1, [8, 4, 1]),
        ("3 x 4", 12, [3, 4]),
        ("2+3=5", 5, [2, 3]),
    ],
)
def test_evaluate_expression(text, value, numbers):
    assert verifiers.evaluate_expression(text) == (Fraction(value), numbers)


@pytest.mark.parametrize(
    "text", ["", "3+", "3/0", "(3+4", "3+4)", "a+b", "3++4", "(" * 100 + "1" + ")" * 100]
)
def test_evaluate_expression_rejects_malformed(text):
    assert verifiers.evaluate_expression(text) is None


def test_countdown_match_uses_each_number_once():
    assert verifiers.countdown_match("3*5+7", [3, 5, 7], 22)
    assert verifiers.countdown_match("7+5*3", [3, 5, 7], 22)
    assert not verifiers.countdown_match("3*5+7+0", [3, 5, 7], 22)  # 0 is not a given number
    assert not verifiers.countdown_match("3*7+1", [3, 5, 7], 22)
    assert not verifiers.countdown_match("3*5", [3, 5, 7], 15)  # must use all numbers
    assert verifiers.countdown_match("3*5", [3, 5, 7], 15, use_all=False)
    assert not verifiers.countdown_match("5*5", [3, 5, 7], 25, use_all=False)  # 5 given once


@given(st.text(max_size=80))
def test_verifiers_never_raise_on_garbage(text):
    assert verifiers.numeric_match(text, "19") in (True, False)
    assert verifiers.exact_match(text, "dcba") in (True, False)
    assert verifiers.countdown_match(text, [3, 5, 7], 22) in (True, False)
