import pytest

from flexmarl_jax.workflows.builtin import build_workflow, majority_answer
from flexmarl_jax.workflows.graph import NodeOutput, WorkflowError


def test_chain_structure_and_agent_names():
    flow = build_workflow("chain", agents=["s", "v", "c"])
    assert flow.order == ("solver", "verifier", "corrector") and flow.agents == ("s", "v", "c")
    assert flow.upstream["corrector"] == ("solver", "verifier")
    assert [flow.turn[n] for n in flow.order] == [0, 1, 2]
    assert (
        flow.render_prompt(
            "corrector",
            "12+7=",
            {"solver": NodeOutput("18", "18", "s", 0, ""), "verifier": NodeOutput("no", "N", "v", 0, "")},
        )
        == "12+7=18 N:"
    )
    assert flow.max_prompt_chars(9) <= 32  # fits configs/tiny.py rollout.max_prompt_length
    custom = build_workflow("chain", templates={"verifier": "{prompt}{solver}?ok"})
    assert custom.nodes["verifier"].template == "{prompt}{solver}?ok"


def test_debate_rounds_and_turns():
    flow = build_workflow("debate", agents=["a", "b"], rounds=3)
    assert flow.num_levels == 3 and len(flow.nodes) == 6
    assert flow.upstream["a_r2"] == ("a_r1", "b_r1") and flow.turn["b_r2"] == 2
    judged = build_workflow("debate", agents=["a", "b"], rounds=1, aggregate="judge", judge="j")
    assert judged.upstream["judge"] == ("a_r0", "b_r0") and judged.agents == ("a", "b", "j")
    shared = build_workflow("debate", agents=["d", "d", "d"], rounds=2)
    turns = [shared.turn[n] for n in shared.order]
    assert sorted(turns) == list(range(6)) and shared.agents == ("d",)


def test_majority_vote_ties_go_to_the_first_agent():
    vote = majority_answer(["a", "b", "c"])

    def out(answer):
        return NodeOutput(str(answer), answer, "x", 0, "")

    assert vote({"a": out("1"), "b": out("2"), "c": out("2")}) == "2"
    assert vote({"a": out("1"), "b": out("2"), "c": out(None)}) == "1"
    assert vote({"a": out(None)}) is None


def test_mixture_structure():
    flow = build_workflow("mixture", proposers=["p", "q"], aggregator="agg")
    assert flow.upstream["aggregator"] == ("p", "q") and flow.agents == ("p", "q", "agg")
    shared = build_workflow("mixture", proposers=["p", "p"])
    assert shared.upstream["aggregator"] == ("p_0", "p_1")


def test_dag_from_plain_data():
    flow = build_workflow(
        "dag",
        nodes=[{"agent": "planner"}, {"agent": "coder", "template": "{prompt}{planner}>"}],
        edges=[("planner", "coder")],
    )
    assert (
        flow.order == ("planner", "coder") and flow.answer({"coder": NodeOutput("x", "x", "c", 0, "")}) == "x"
    )
    with pytest.raises(WorkflowError, match="names unknown agent/node 'tester'"):
        build_workflow("dag", nodes=[{"agent": "planner"}], edges=[{"src": "planner", "dst": "tester"}])


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("tree", {}, r"unknown workflow 'tree'; allowed: \['chain', 'dag', 'debate', 'mixture'\]"),
        ("chain", {"rounds": 2}, r"unknown options \['rounds'\]"),
        ("chain", {"agents": ["a", "b"]}, "chain needs 3 agents"),
        ("chain", {"templates": {"judge": "x"}}, r"unknown template keys \['judge'\]"),
        ("chain", {"shaping_weights": {"bonus": 1.0}}, r"unknown shaping weights \['bonus'\]"),
        ("chain", {"templates": {"verifier": "{prompt}{corrector}"}}, r"uses \{corrector\}"),
        ("debate", {"rounds": 0}, "rounds=0"),
        ("debate", {"aggregate": "mean"}, "aggregate='mean'"),
    ],
)
def test_bad_options_are_named(name, kwargs, message):
    with pytest.raises((ValueError, WorkflowError), match=message):
        build_workflow(name, **kwargs)


def test_roles_filled_from_configured_agent_names():
    from flexmarl_jax.workflows.builtin import build_workflow_for_agents

    assert build_workflow_for_agents("chain", ["s", "v", "c"]).agents == ("s", "v", "c")
    judged = build_workflow_for_agents("debate", ["a", "b", "j"], aggregate="judge", rounds=1)
    assert judged.nodes["judge"].agent == "j" and judged.agents == ("a", "b", "j")
    mixture = build_workflow_for_agents("mixture", ["p", "q", "agg"])
    assert mixture.nodes["aggregator"].agent == "agg" and mixture.agents == ("p", "q", "agg")
    with pytest.raises(WorkflowError, match="mixture needs >= 2 agents"):
        build_workflow_for_agents("mixture", ["p"])


def test_default_prompts_fit_the_tiny_config():
    # configs/tiny.py: rollout.max_prompt_length = 32 tokens (incl. BOS); task prompts are <= 9 chars.
    for name in ("chain", "debate", "mixture"):
        assert build_workflow(name).max_prompt_chars(max_query_chars=9) + 1 <= 32, name
