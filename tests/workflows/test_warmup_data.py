"""Warm-up examples: `format` answers carry no information about the truth, `sft` answers are all right, and
both are drawn from training problems only."""

import collections

import pytest

from flexmarl_jax.workflows import build_workflow
from flexmarl_jax.workflows.oracles import PromptOracle
from flexmarl_jax.workflows.splits import TrainEvalSplit
from flexmarl_jax.workflows.tasks import ArithmeticTask, ReverseTask
from flexmarl_jax.workflows.warmup_data import WARMUP_KINDS, warmup_examples, warmup_problems

CHAIN = build_workflow("chain")


def _solver_answers(examples, problems):
    """(reference answer, the solver's answer) for every solver example."""
    oracle = PromptOracle(problems)
    return [(oracle.find(prompt)[0].answer, text) for prompt, text in examples["solver"]]


@pytest.mark.timeout(120)
def test_format_answers_are_drawn_independently_of_the_truth():
    # Every reversed string differs, so an answer that ignores the problem is right only by chance (~1/256).
    task = ReverseTask(min_length=6, max_length=6)
    examples = warmup_examples(CHAIN, task, kind="format", queries=256, samples_per_query=1, seed=0)
    problems = warmup_problems(task, queries=256, seed=0)
    answers = _solver_answers(examples, problems)
    assert len(answers) == 256
    assert sum(reference == text for reference, text in answers) / len(answers) < 0.03
    # The answers are well-formed: each is some training problem's reference answer.
    assert {text for _, text in answers} <= {problem.answer for problem in problems}
    verdicts = collections.Counter(text for _, text in examples["verifier"])
    assert set(verdicts) == {"Y", "N"} and verdicts["Y"] / sum(verdicts.values()) == pytest.approx(0.5, abs=0.08)
    assert len(examples["corrector"]) == verdicts["N"]  # the corrector answers every rejected answer


@pytest.mark.timeout(120)
def test_format_answers_on_a_small_space_match_truth_only_at_the_chance_rate():
    # One-digit sums up to 4: answers 0..4. Answering from the answer pool regardless of the problem is right
    # with probability sum_a P(a)^2 (about 0.25 here), whatever the problem: the truth plays no part.
    task = ArithmeticTask(max_digits=1, operators="+", max_answer=4)
    problems = warmup_problems(task, queries=256, seed=1)
    examples = warmup_examples(CHAIN, task, kind="format", queries=256, samples_per_query=4, seed=1)
    answers = _solver_answers(examples, problems)
    pool = collections.Counter(problem.answer for problem in problems)
    chance = sum((count / len(problems)) ** 2 for count in pool.values())
    right = sum(reference == text for reference, text in answers) / len(answers)
    assert right == pytest.approx(chance, abs=0.05)
    for answer in pool:  # the right answer is not favoured for any reference answer
        given = [text for reference, text in answers if reference == answer]
        assert sum(text == answer for text in given) / len(given) == pytest.approx(pool[answer] / 256, abs=0.1)


@pytest.mark.timeout(120)
def test_sft_keeps_only_right_calls_of_every_agent():
    task = ArithmeticTask(max_digits=2, operators="+-")
    problems = warmup_problems(task, queries=256, seed=2)
    examples = warmup_examples(CHAIN, task, kind="sft", queries=256, samples_per_query=1, seed=2)
    answers = _solver_answers(examples, problems)
    assert 100 < len(answers) < 156  # the scripted solver is right about half of the time; only those are kept
    assert all(reference == text for reference, text in answers)
    oracle = PromptOracle(problems)
    verdicts = collections.Counter()
    for prompt, text in examples["verifier"]:
        problem, rest = oracle.find(prompt)
        truth = task.verify(problem, rest[:-1])  # "{prompt}{solver}?"
        assert text == ("Y" if truth else "N")
        verdicts[text] += 1
    assert verdicts["Y"] > 50 and verdicts["N"] > 50  # both verdicts are taught
    assert examples["corrector"]
    for prompt, text in examples["corrector"]:
        assert task.verify(oracle.find(prompt)[0], text)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(WARMUP_KINDS))
def test_warmup_draws_training_problems_only(kind):
    task = ArithmeticTask(max_digits=1, operators="+", max_answer=4)  # 15 prompts: 256 draws meet them all
    split = TrainEvalSplit(task, eval_fraction=0.3)
    eval_keys = {split.content_key(problem) for problem in split.eval_problems(100, seed=0)}
    assert eval_keys == {"0+0=", "0+1=", "1+1=", "2+2="}
    assert eval_keys <= {split.content_key(p) for p in warmup_problems(task, queries=256, seed=3)}
    examples = warmup_examples(CHAIN, split, kind=kind, queries=256, samples_per_query=1, seed=3)
    # "a+b=" starts every prompt; its problem is "min(a,b)+max(a,b)=".
    queries = {"+".join(sorted(prompt[:3].split("+"))) + "=" for pairs in examples.values() for prompt, _ in pairs}
    assert len(queries) == 9 - 4 and not queries & eval_keys


def test_unknown_kind():
    with pytest.raises(ValueError, match=r"unknown warm-up kind 'rl'; allowed: \['format', 'sft'\]"):
        warmup_examples(CHAIN, ArithmeticTask(), kind="rl", queries=1, samples_per_query=1, seed=0)
