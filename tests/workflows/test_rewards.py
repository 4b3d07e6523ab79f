import pytest

from flexmarl_jax.workflows.builtin import build_workflow
from flexmarl_jax.workflows.graph import NodeOutput
from flexmarl_jax.workflows.rewards import allocate_rewards
from flexmarl_jax.workflows.tasks import ArithmeticTask, Problem

TASK = ArithmeticTask()
PROBLEM = Problem("q-1", "12+7=", "19")


def outputs(**answers):
    return {
        node: NodeOutput(text, TEXT_TO_ANSWER.get(text, text), node, 0, f"{node}-id")
        for node, text in answers.items()
    }


TEXT_TO_ANSWER = {"yes": "Y", "no": "N", "maybe": None}


@pytest.mark.parametrize(
    "answers, expected",
    [  # default weights: team 1.0, solver_correct 0.0, verifier_judgement 0.5, corrector_fix 0.5
        ({"solver": "19", "verifier": "yes"}, {"solver": 1.0, "verifier": 1.5}),
        ({"solver": "18", "verifier": "yes"}, {"solver": 0.0, "verifier": 0.0}),
        (
            {"solver": "18", "verifier": "no", "corrector": "19"},
            {"solver": 1.0, "verifier": 1.5, "corrector": 1.5},
        ),
        (
            {"solver": "18", "verifier": "no", "corrector": "17"},
            {"solver": 0.0, "verifier": 0.5, "corrector": 0.0},
        ),
        (
            {"solver": "19", "verifier": "no", "corrector": "19"},
            {"solver": 1.0, "verifier": 1.0, "corrector": 1.0},
        ),
        (
            {"solver": "19", "verifier": "no", "corrector": "20"},
            {"solver": 0.0, "verifier": 0.0, "corrector": 0.0},
        ),
        ({"solver": "abc", "verifier": "maybe"}, {"solver": 0.0, "verifier": 0.0}),
    ],
)
def test_chain_rewards_match_hand_computed_values(answers, expected):
    rewards, context = allocate_rewards(build_workflow("chain"), PROBLEM, outputs(**answers), TASK.verify)
    assert rewards == pytest.approx(expected)
    assert context.team_reward == expected["solver"]  # the solver gets exactly the team reward here


def test_chain_custom_weights():
    flow = build_workflow(
        "chain",
        team_weight=2.0,
        shaping_weights={"solver_correct": 1.0, "verifier_judgement": 0.25, "corrector_fix": 3.0},
    )
    rewards, _ = allocate_rewards(
        flow, PROBLEM, outputs(solver="18", verifier="no", corrector="19"), TASK.verify
    )
    assert rewards == pytest.approx({"solver": 2.0, "verifier": 2.25, "corrector": 5.0})
    rewards, _ = allocate_rewards(flow, PROBLEM, outputs(solver="19", verifier="yes"), TASK.verify)
    assert rewards == pytest.approx({"solver": 3.0, "verifier": 2.25})


def test_debate_and_mixture_rewards():
    debate = build_workflow("debate", debaters=["a", "b", "c"], rounds=1)
    rewards, context = allocate_rewards(
        debate, PROBLEM, outputs(a_r0="19", b_r0="19", c_r0="18"), TASK.verify
    )
    assert context.final_answer == "19" and rewards == pytest.approx({"a_r0": 1.5, "b_r0": 1.5, "c_r0": 1.0})
    rewards, context = allocate_rewards(
        debate, PROBLEM, outputs(a_r0="19", b_r0="18", c_r0="18"), TASK.verify
    )
    assert context.final_answer == "18" and rewards == pytest.approx({"a_r0": 0.5, "b_r0": 0.0, "c_r0": 0.0})
    mixture = build_workflow("mixture", proposers=["p", "q"], shaping_weights={"proposal_correct": 0.25})
    rewards, _ = allocate_rewards(mixture, PROBLEM, outputs(p="19", q="18", aggregator="19"), TASK.verify)
    assert rewards == pytest.approx({"p": 1.25, "q": 1.0, "aggregator": 1.0})
