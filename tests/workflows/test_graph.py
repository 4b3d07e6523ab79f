import pytest

from flexmarl_jax.workflows.graph import (
    Edge,
    Node,
    NodeOutput,
    Workflow,
    WorkflowError,
    first_answer_of,
    parse_verdict,
)


def make(nodes, edges, **kwargs):
    return Workflow("test", nodes, edges, first_answer_of([nodes[-1].name]), **kwargs)


def test_cycle_is_reported_with_its_path():
    nodes = [Node("a", "x"), Node("b", "y"), Node("c", "z"), Node("d", "w")]
    edges = [Edge("d", "a"), Edge("a", "b"), Edge("b", "c"), Edge("c", "a")]
    with pytest.raises(
        WorkflowError, match=r"has a cycle: (a -> b -> c -> a|b -> c -> a -> b|c -> a -> b -> c)"
    ):
        make(nodes, edges)
    with pytest.raises(WorkflowError, match="has a cycle: a -> a"):
        make([Node("a", "x")], [Edge("a", "a")])


def test_edge_naming_unknown_agent():
    with pytest.raises(
        WorkflowError,
        match=r"edge 'solver' -> 'correctr' names unknown agent/node 'correctr'; "
        r"known nodes: \['solver', 'verifier'\]",
    ):
        make([Node("solver", "s"), Node("verifier", "v")], [Edge("solver", "correctr")])


@pytest.mark.parametrize(
    "nodes, edges, message",
    [
        ([Node("a", "x"), Node("a", "y")], [], "duplicate node name 'a'"),
        ([Node("a-b", "x")], [], "must be an identifier"),
        ([Node("prompt", "x")], [], "reserved"),
        ([Node("a", "x", "{prompt}{b}")], [], r"uses \{b\}; allowed: \['inputs', 'prompt'\]"),
        ([Node("a", "x", "{prompt")], [], "bad template"),
        ([Node("a", "x", parser="json")], [], "unknown parser 'json'"),
        ([Node("a", "x", turn=0), Node("b", "x", turn=0)], [], "both agent 'x' at turn 0"),
        ([Node("a", "x"), Node("b", "y")], [Edge("a", "b", when="maybe")], "unknown condition 'maybe'"),
    ],
)
def test_invalid_definitions_name_the_problem(nodes, edges, message):
    with pytest.raises(WorkflowError, match=message):
        Workflow("test", nodes, edges, first_answer_of([nodes[0].name]))


def test_order_levels_turns_and_ancestors():
    nodes = [Node("d", "w", "{prompt}{b}{c}"), Node("c", "z", "{a}"), Node("b", "y", "{a}"), Node("a", "x")]
    flow = make(nodes, [Edge("a", "b"), Edge("a", "c"), Edge("b", "d"), Edge("c", "d")])
    assert flow.order == ("a", "c", "b", "d") or flow.order == ("a", "b", "c", "d")
    assert flow.level == {"a": 0, "b": 1, "c": 1, "d": 2}
    assert flow.num_levels == 3 and flow.roots() == ("a",)
    assert flow.ancestors["d"] == {"a", "b", "c"} and flow.ancestors["a"] == set()
    assert sorted(flow.turn.values()) == [0, 1, 2, 3] and flow.turn["a"] == 0 and flow.turn["d"] == 3
    outputs = {n: NodeOutput(f"{n}-text", n.upper() * 20, n, 0, "") for n in "abc"}
    flow_short = make(
        nodes, [Edge("a", "b"), Edge("a", "c"), Edge("b", "d"), Edge("c", "d")], max_field_chars=3
    )
    assert flow_short.render_prompt("d", "Q=", outputs) == "Q=BBBCCC"
    assert flow_short.max_prompt_chars(max_query_chars=2) == 8
    # An unparsed upstream output shows as its raw text, newlines flattened.
    flow_raw = make([Node("a", "x"), Node("b", "y", "{prompt}{inputs}|")], [Edge("a", "b")])
    unparsed = {"a": NodeOutput(" raw\ntext ", None, "x", 0, "")}
    assert flow_raw.render_prompt("b", "Q", unparsed) == "Qraw text|"


def test_conditions_and_verdict_parser():
    accepted, rejected = Edge("a", "b", when="accepted"), Edge("a", "b", when="rejected")
    for text, verdict in [("Y", "Y"), (" yes.", "Y"), ("n", "N"), ("No!", "N"), ("maybe", None), ("", None)]:
        assert parse_verdict(text) == verdict
        output = NodeOutput(text, verdict, "v", 0, "")
        assert accepted.holds(output) == (verdict == "Y") and rejected.holds(output) == (verdict == "N")
    assert Edge("a", "b", when=lambda output: output.text == "go").holds(NodeOutput("go", None, "v", 0, ""))
    # A parser that raises yields "malformed" (None), never an exception.
    assert Node("a", "x", parser=lambda text: 1 / 0).parse("1") is None
