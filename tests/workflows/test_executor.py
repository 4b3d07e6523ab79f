import collections
import threading

import pytest

from flexmarl_jax.workflows.builtin import build_workflow
from flexmarl_jax.workflows.executor import WorkflowExecutionError, WorkflowExecutor
from flexmarl_jax.workflows.oracles import PromptOracle, answer_policy, chain_policies
from flexmarl_jax.workflows.records import InMemorySink
from flexmarl_jax.workflows.scripted import ScriptedAgent, long_tail_latency
from flexmarl_jax.workflows.tasks import ArithmeticTask

TASK = ArithmeticTask()
N = 4


def three_way_verifier(request, sample_index, rng):
    """Y, N or an unparseable verdict, so both conditional branches and "malformed" occur."""
    return rng.choice(["Y", "N", "N", "maybe"])


def chain_backend(make_backend, problems, *, latency=None, verifier=None, **kwargs):
    policies = chain_policies(problems, TASK.verify, solver_accuracy=0.5, verifier_accuracy=0.7)
    if verifier is not None:
        policies["verifier"] = verifier
    return make_backend(
        {role: ScriptedAgent(policy, latency) for role, policy in policies.items()}, max_workers=64, **kwargs
    )


def run_chain(backend, problems, mode="dependency", **kwargs):
    sink = InMemorySink()
    executor = WorkflowExecutor(
        build_workflow("chain"), backend, TASK, samples_per_query=N, mode=mode, **kwargs
    )
    return executor.run(problems, sink), sink


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["dependency", "staged"])
def test_call_order_respects_the_dag(make_backend, mode):
    problems = TASK.generate(6, seed=0)
    backend = chain_backend(make_backend, problems, latency=long_tail_latency(0.001, 0.02, 0.2))
    result, sink = run_chain(backend, problems, mode)
    flow = build_workflow("chain")
    timing = {(c.input_id, t, c.node): c for c in result.timeline for t in c.trajectory_ids}
    events = {e.request_id: e for e in backend.events}
    checked = 0
    for record in sink.records.values():
        call = timing[(record.input_id, record.trajectory_id, record.node)]
        for upstream in flow.upstream[record.node]:
            before = timing[(record.input_id, record.trajectory_id, upstream)]
            assert call.submitted_at >= before.finished_at
            # ... and on the backend's own clock: generation starts after the input was generated.
            upstream_id = f"{upstream}/{record.input_id}_{flow.turn[upstream]}_{record.trajectory_id}"
            assert events[f"{record.agent}/{record.sample_id}"].started_at >= events[upstream_id].finished_at
            checked += 1
    correctors = sum(r.agent == "corrector" for r in sink.records.values())
    assert checked == len(problems) * N + 2 * correctors  # each verifier call: 1 input, each corrector: 2
    if mode == "staged":  # the barrier: no level-1 call before every level-0 call finished
        levels = collections.defaultdict(list)
        for call in result.timeline:
            levels[call.level].append(call)
        for level in (1, 2):
            if levels[level]:
                assert min(c.submitted_at for c in levels[level]) >= max(
                    c.finished_at for c in levels[level - 1]
                )


@pytest.mark.timeout(60)
def test_conditional_edge_fires_exactly_on_rejection(make_backend):
    problems = TASK.generate(10, seed=1)
    backend = chain_backend(make_backend, problems, verifier=three_way_verifier)
    result, sink = run_chain(backend, problems)
    verdicts = collections.Counter()
    for trajectory in result.trajectories:
        verdict = trajectory.outputs["verifier"].answer
        verdicts[verdict] += 1
        assert ("corrector" in trajectory.outputs) == (verdict == "N")
        assert trajectory.skipped == (() if verdict == "N" else ("corrector",))
        expected_final = trajectory.outputs["corrector" if verdict == "N" else "solver"].answer
        assert trajectory.final_answer == expected_final
    assert set(verdicts) == {"Y", "N", None}  # all three branches were exercised
    load = result.load
    assert load["solver"].calls == load["verifier"].calls == len(problems) * N
    assert (
        load["corrector"].calls == verdicts["N"] == sum(r.agent == "corrector" for r in sink.records.values())
    )
    assert load["corrector"].skipped == len(problems) * N - verdicts["N"]
    share = result.request_share()
    assert share["solver"] == pytest.approx(len(problems) * N / (2 * len(problems) * N + verdicts["N"]))
    assert sum(share.values()) == pytest.approx(1.0)


def gated_solver(problems, gate: threading.Event, released: dict, wait_s: float):
    """Trajectory 0 of the first query blocks until a downstream (verifier) call has started, or wait_s."""
    oracle = PromptOracle(problems)
    normal = answer_policy(oracle, 1.0)

    def policy(request, sample_index, rng):
        if request.request_id.endswith(f"{problems[0].input_id}_0_0"):
            released["before_timeout"] = gate.wait(wait_s)
        return normal(request, sample_index, rng)

    return policy


def releasing_verifier(gate: threading.Event):
    def policy(request, sample_index, rng):
        gate.set()
        return "Y"

    return policy


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode, downstream_first", [("dependency", True), ("staged", False)])
def test_downstream_calls_start_before_the_slowest_upstream_call_finishes(
    make_backend, mode, downstream_first
):
    problems = TASK.generate(4, seed=2)
    gate, released = threading.Event(), {}
    wait_s = 10.0 if downstream_first else 0.3  # the staged barrier can only time out
    backend = make_backend(
        {
            "solver": gated_solver(problems, gate, released, wait_s),
            "verifier": releasing_verifier(gate),
            "corrector": answer_policy(PromptOracle(problems), 1),
        },
        max_workers=64,
    )
    result, _ = run_chain(backend, problems, mode)
    assert released["before_timeout"] is downstream_first
    slowest = next(e for e in backend.events if e.request_id.endswith(f"{problems[0].input_id}_0_0"))
    verifier_starts = [e.started_at for e in backend.events if e.agent == "verifier"]
    assert (min(verifier_starts) < slowest.finished_at) is downstream_first
    assert len(result.trajectories) == len(problems) * N


@pytest.mark.timeout(60)
def test_sample_ids_groups_versions_and_sink_protocol(make_backend):
    problems = TASK.generate(5, seed=3)
    backend = chain_backend(
        make_backend,
        problems,
        verifier=three_way_verifier,
        latency=long_tail_latency(0.0005, 0.01, 0.2),
        policy_versions={"solver": 3, "verifier": 5, "corrector": 7},
    )
    result, sink = run_chain(backend, problems)
    rejected = {(t.input_id, t.trajectory_id) for t in result.trajectories if "corrector" in t.outputs}
    expected = set()
    for problem in problems:
        for trajectory in range(N):
            expected.add(("solver", f"{problem.input_id}_0_{trajectory}"))
            expected.add(("verifier", f"{problem.input_id}_1_{trajectory}"))
            if (problem.input_id, trajectory) in rejected:
                expected.add(("corrector", f"{problem.input_id}_2_{trajectory}"))
    assert set(sink.records) == expected
    versions = {"solver": 3, "verifier": 5, "corrector": 7}
    for (agent, sample_id), record in sink.records.items():
        input_id, turn, trajectory = sample_id.split("_")
        assert (record.input_id, record.turn, record.trajectory_id) == (input_id, int(turn), int(trajectory))
        assert record.group_id == f"{input_id}_{turn}" and record.node == agent
        assert record.policy_version == versions[agent]
        upstream = {"solver": {}, "verifier": {"solver": 3}, "corrector": {"solver": 3, "verifier": 5}}[agent]
        assert record.upstream_policy_versions == upstream
        assert record.token_ids == tuple(map(ord, record.text)) and len(record.logprobs) == len(
            record.token_ids
        )
        assert record.prompt_token_ids == tuple(map(ord, record.prompt))
    # Groups: closed with their real size, after all their rows were added; empty groups are not reported.
    rows_per_group = collections.Counter((r.agent, r.group_id) for r in sink.records.values())
    assert sink.group_sizes == dict(rows_per_group)
    assert all(size == N for (agent, _), size in sink.group_sizes.items() if agent != "corrector")
    position = {event: index for index, event in enumerate(sink.events)}
    for agent, group_id in sink.group_sizes:
        closed_at = position[("close", agent, group_id)]
        assert all(
            position[("add", agent, r.sample_id)] < closed_at for r in sink.group_rows(agent, group_id)
        )
    for kind, agent, sample_id in sink.events:
        if kind == "reward":
            assert position[("add", agent, sample_id)] < position[(kind, agent, sample_id)]
    assert set(sink.rewards) == set(sink.records)
    for agent in versions:
        assert sink.complete_groups(agent) == sorted(g for a, g in sink.group_sizes if a == agent)


@pytest.mark.timeout(60)
def test_rewards_in_the_sink_match_hand_computed_values(make_backend):
    problems = TASK.generate(8, seed=4)
    backend = chain_backend(make_backend, problems, verifier=three_way_verifier)
    result, sink = run_chain(backend, problems)
    by_id = {p.input_id: p for p in problems}
    for trajectory in result.trajectories:
        problem, outputs = by_id[trajectory.input_id], trajectory.outputs
        solver_right = TASK.verify(problem, outputs["solver"].answer)
        final = outputs["corrector"].answer if "corrector" in outputs else outputs["solver"].answer
        team = 1.0 if TASK.verify(problem, final) else 0.0
        verdict = outputs["verifier"].answer
        expected = {
            "solver": team,
            "verifier": team + 0.5 * (verdict in ("Y", "N") and (verdict == "Y") == solver_right),
        }
        if "corrector" in outputs:
            expected["corrector"] = team + 0.5 * (
                TASK.verify(problem, outputs["corrector"].answer) and not solver_right
            )
        got = {node: sink.rewards[(node, output.sample_id)] for node, output in outputs.items()}
        assert got == pytest.approx(expected)
        assert trajectory.team_reward == team
    assert 0.0 < result.accuracy < 1.0


@pytest.mark.timeout(60)
def test_modes_and_admission_limits_produce_identical_experience(make_backend):
    problems = TASK.generate(6, seed=5)
    backend = chain_backend(make_backend, problems, latency=long_tail_latency(0.0005, 0.01, 0.2))
    _, reference = run_chain(backend, problems, "dependency")
    for mode, kwargs in [("staged", {}), ("dependency", {"max_concurrent_queries": 2})]:
        result, sink = run_chain(backend, problems, mode, **kwargs)
        assert sink.records == reference.records and sink.rewards == reference.rewards
        assert sink.group_sizes == reference.group_sizes
    # max_concurrent_queries=2: never more than two queries with calls in flight.
    spans = collections.defaultdict(list)
    for call in result.timeline:
        spans[call.input_id].append(call)
    intervals = [
        (min(c.submitted_at for c in calls), max(c.finished_at for c in calls)) for calls in spans.values()
    ]
    for start, _ in intervals:
        assert sum(s <= start < e for s, e in intervals) <= 2


@pytest.mark.timeout(60)
def test_grouped_root_requests_and_load_statistics(make_backend):
    problems = TASK.generate(5, seed=6)
    backend = chain_backend(make_backend, problems)
    result, sink = run_chain(backend, problems, group_root_requests=True)
    solver = result.load["solver"]
    assert solver.requests == len(problems) and solver.calls == len(problems) * N
    assert sorted(r.trajectory_id for r in sink.group_rows("solver", f"{problems[0].input_id}_0")) == list(
        range(N)
    )
    for agent, load in result.load.items():
        rows = [r for r in sink.records.values() if r.agent == agent]
        assert load.completion_tokens == sum(len(r.token_ids) for r in rows)
    verifier_rows = [r for r in sink.records.values() if r.agent == "verifier"]
    assert result.load["verifier"].prompt_tokens == sum(len(r.prompt_token_ids) for r in verifier_rows)
    assert solver.prompt_tokens == sum(len(p.prompt) for p in problems)  # one prefill per grouped request


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("debate", {"debaters": ["a", "b"], "rounds": 2}),
        ("debate", {"debaters": ["a", "b", "c"], "aggregate": "judge"}),
        ("mixture", {"proposers": ["p", "q"]}),
    ],
)
def test_debate_and_mixture_run_end_to_end(make_backend, name, kwargs):
    problems = TASK.generate(3, seed=7)
    flow = build_workflow(name, **kwargs)
    oracle = PromptOracle(problems)
    backend = make_backend({agent: answer_policy(oracle, 0.6) for agent in flow.agents}, max_workers=32)
    sink = InMemorySink()
    result = WorkflowExecutor(flow, backend, TASK, samples_per_query=3, mode="staged").run(problems, sink)
    assert len(sink.records) == len(flow.nodes) * len(problems) * 3
    assert all(size == 3 for size in sink.group_sizes.values())
    by_id = {p.input_id: p for p in problems}
    for trajectory in result.trajectories:
        assert trajectory.final_answer == flow.answer(trajectory.outputs)
        assert trajectory.team_reward == float(
            TASK.verify(by_id[trajectory.input_id], trajectory.final_answer)
        )
    for record in sink.records.values():
        ancestors = flow.ancestors[record.node]
        assert set(record.upstream_policy_versions) == {flow.nodes[a].agent for a in ancestors}
    # Each call saw exactly its own trajectory's upstream answers.
    outputs = {(t.input_id, t.trajectory_id): t.outputs for t in result.trajectories}
    for record in sink.records.values():
        seen = outputs[(record.input_id, record.trajectory_id)]
        assert record.prompt == flow.render_prompt(record.node, by_id[record.input_id].prompt, seen)
        if flow.upstream[record.node]:
            assert record.prompt.endswith(">" if name != "debate" or record.node != "judge" else "?")


def failing(request, sample_index, rng):
    raise RuntimeError("engine fell over")


@pytest.mark.timeout(60)
def test_errors_name_the_problem(make_backend):
    problems = TASK.generate(2, seed=8)
    flow = build_workflow("chain")
    policies = chain_policies(problems, TASK.verify)
    backend = make_backend({**policies, "verifier": failing})
    with pytest.raises(
        WorkflowExecutionError, match=r"request 'verifier/arithmetic-s8-\d_1_\d' .*engine fell over"
    ):
        WorkflowExecutor(flow, backend, TASK, samples_per_query=2).run(problems)

    class ShortBackend:
        def submit(self, request):
            return backend.submit(
                request.__class__(request.request_id, request.agent, request.prompt, 1, request.sampling)
            )

    with pytest.raises(WorkflowExecutionError, match="asked for 2 samples, backend returned 1"):
        WorkflowExecutor(flow, ShortBackend(), TASK, samples_per_query=2, group_root_requests=True).run(
            problems
        )
    with pytest.raises(ValueError, match=r"mode='async'; allowed: \['dependency', 'staged'\]"):
        WorkflowExecutor(flow, backend, TASK, samples_per_query=2, mode="async")
    with pytest.raises(ValueError, match=r"sampling names agents \['judge'\]"):
        WorkflowExecutor(flow, backend, TASK, samples_per_query=2, sampling={"judge": None})
    with pytest.raises(ValueError, match="unique and contain no '_'"):
        WorkflowExecutor(flow, backend, TASK, samples_per_query=2).run(problems + problems[:1])


class _LimitedBackend:
    """A scripted backend with a token limit per agent and per-agent decoding, as the engine backend has."""

    def __init__(self, backend, too_long_for: str):
        self.backend, self.too_long_for = backend, too_long_for
        self.prompts = []

    def submit(self, request):
        from flexmarl_jax.workflows.generation import PromptTooLong

        self.prompts.append(request.prompt)
        if request.agent == self.too_long_for:
            raise PromptTooLong(f"request {request.request_id!r}: the prompt has 999 tokens")
        return self.backend.submit(request)

    def decode_tokens(self, agent, token_ids):
        return "".join(chr(t) for t in token_ids)  # ScriptedBackend encodes one id per character


@pytest.mark.timeout(60)
def test_chat_prompts_quote_responses_cut_in_tokens_and_an_overflowing_turn_is_skipped(make_backend):
    """Quoted responses are cut to max_field_tokens of the producer's tokens; a later turn whose prompt is too long
    fails only that call: it and what depends on it are skipped, the trajectories still finish with rewards."""
    problems = TASK.generate(3, seed=1)
    reasoning = "Step one gives 7 and step two gives 9. The answer is 9"
    scripted = make_backend({"solver": lambda request, index, rng: reasoning,
                             "verifier": lambda request, index, rng: "No, step two is wrong.",
                             "corrector": lambda request, index, rng: reasoning}, max_workers=8)
    backend = _LimitedBackend(scripted, too_long_for="corrector")
    flow = build_workflow("chain", chat=True, max_field_tokens=10)
    sink = InMemorySink()
    result = WorkflowExecutor(flow, backend, TASK, samples_per_query=2).run(problems, sink)
    quoted = [p.user for p in backend.prompts if p.system == flow.nodes["verifier"].system]
    assert quoted and all(reasoning[:10] in user and reasoning[:11] not in user for user in quoted)
    assert result.load["corrector"].overflowed == len(problems) * 2 and result.load["corrector"].calls == 0
    assert len(result.trajectories) == len(problems) * 2
    assert all(t.skipped == ("corrector",) for t in result.trajectories)
    assert {r.agent for r in sink.records.values()} == {"solver", "verifier"}
