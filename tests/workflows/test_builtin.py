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
    flow = build_workflow("debate", debaters=["a", "b"], rounds=3)
    assert flow.num_levels == 3 and len(flow.nodes) == 6
    assert flow.upstream["a_r2"] == ("a_r1", "b_r1") and flow.turn["b_r2"] == 2
    judged = build_workflow("debate", debaters=["a", "b"], rounds=1, aggregate="judge", judge="j")
    assert judged.upstream["judge"] == ("a_r0", "b_r0") and judged.agents == ("a", "b", "j")
    shared = build_workflow("debate", debaters=["d", "d", "d"], rounds=2)
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


def test_roles_are_mapped_to_agents():
    from flexmarl_jax.workflows.builtin import build_configured_workflow, workflow_roles

    chain = build_configured_workflow("chain", roles={"solver": "s", "verifier": "v", "corrector": "c"})
    assert chain.agents == ("s", "v", "c") and chain.order == ("solver", "verifier", "corrector")
    judged = build_configured_workflow("debate", options={"aggregate": "judge", "rounds": 1},
                                       roles={"judge": "j"})
    assert judged.nodes["judge"].agent == "j" and judged.agents == ("debater0", "debater1", "debater2", "j")
    assert workflow_roles("debate", {"aggregate": "judge"}) == ("debater0", "debater1", "debater2", "judge")
    assert workflow_roles("debate") == ("debater0", "debater1", "debater2")  # no judge without aggregate="judge"
    # Two debater roles played by one agent: one policy; its calls get distinct turns (distinct sample ids).
    shared = build_configured_workflow("debate", options={"rounds": 2}, roles={"debater0": "d", "debater1": "d"})
    assert shared.agents == ("d", "debater2")
    d_turns = [shared.turn[n] for n in shared.order if shared.nodes[n].agent == "d"]
    assert len(d_turns) == 4 == len(set(d_turns))
    mixture = build_configured_workflow("mixture", options={"proposers": ["p", "q"]}, roles={"p": "x", "q": "x"})
    assert mixture.agents == ("x", "aggregator") and mixture.upstream["aggregator"] == ("x_0", "x_1")


def test_dag_roles_keep_node_names():
    from flexmarl_jax.workflows.builtin import build_configured_workflow

    options = {"nodes": [{"agent": "planner"}, {"agent": "coder", "template": "{prompt}{planner}>"},
                         {"agent": "tester", "template": "{prompt}{coder}?"}],
               "edges": [("planner", "coder"), ("coder", "tester")]}
    flow = build_configured_workflow("dag", options=options, roles={"planner": "lead", "tester": "lead"},
                                     shaping_weights={"own_answer_correct": 0.25})
    assert flow.order == ("planner", "coder", "tester")  # node names stay the roles the edges name
    assert [flow.nodes[n].agent for n in flow.order] == ["lead", "coder", "lead"]
    assert flow.reward_weights.shaping == {"own_answer_correct": 0.25}


@pytest.mark.parametrize("options, roles, message", [
    ({}, {"critic": "x"}, r"workflow 'chain' has no role\(s\) \['critic'\] to map to agents; its roles: "
                          r"\['solver', 'verifier', 'corrector'\]"),
    ({"shaping_weights": {}}, {}, "set shaping weights in config.workflow.shaping_weights"),
    ({"rounds": 0}, {}, "rounds=0"),
])
def test_configured_workflow_errors(options, roles, message):
    from flexmarl_jax.workflows.builtin import build_configured_workflow

    name = "debate" if "rounds" in options else "chain"
    with pytest.raises((ValueError, WorkflowError), match=message):
        build_configured_workflow(name, options=options, roles=roles)


def test_default_prompts_fit_the_tiny_config():
    # configs/tiny.py: rollout.max_prompt_length = 32 tokens (incl. BOS); task prompts are <= 9 chars.
    for name in ("chain", "debate", "mixture"):
        assert build_workflow(name).max_prompt_chars(max_query_chars=9) + 1 <= 32, name


@pytest.mark.parametrize("name", ["chain", "debate", "mixture"])
def test_chat_prompts_quote_upstream_responses_whole(name):
    """With chat=True every node sends a ChatPrompt: a system prompt and a user turn quoting whole responses."""
    from flexmarl_jax.workflows.generation import ChatPrompt

    flow = build_workflow(name, chat=True)
    assert flow.chat and flow.max_field_tokens == 256
    reasoning = "First 12 + 7 = 19.\nThe answer is 19"
    for node in flow.order:
        outputs = {u: NodeOutput(reasoning, "19", flow.nodes[u].agent, 0, "") for u in flow.upstream[node]}
        prompt = flow.render_prompt(node, "What is 12 + 7?", outputs)
        assert isinstance(prompt, ChatPrompt) and prompt.system and "What is 12 + 7?" in prompt.user
        assert prompt.messages[0]["role"] == "system" and prompt.messages[1]["content"] == prompt.user
        if flow.upstream[node]:
            assert prompt.user.count(reasoning) == len(flow.upstream[node])  # quoted whole, reasoning included
        if flow.nodes[node].parser != "verdict":
            assert flow.nodes[node].parse(reasoning) == "19"  # the math parser reads past the reasoning
    plain = build_workflow(name)
    assert not plain.chat and plain.max_field_tokens is None
    assert isinstance(plain.render_prompt(plain.order[0], "1+1=", {}), str)


def test_chat_prompt_overrides_and_their_errors():
    flow = build_workflow("chain", chat=True, system_prompts={"verifier": "Say Yes or No."},
                          templates={"solver": "Solve: {prompt}"})
    assert flow.nodes["verifier"].system == "Say Yes or No." and flow.nodes["solver"].template == "Solve: {prompt}"
    with pytest.raises(WorkflowError, match="system_prompts need chat=True"):
        build_workflow("chain", system_prompts={"verifier": "x"})
    with pytest.raises(WorkflowError, match="unknown template keys"):
        build_workflow("mixture", chat=True, system_prompts={"judge": "x"})
