"""The held-out evaluator, with scripted agents whose skill depends on how they are asked to sample."""

import random

import pytest

from flexmarl_jax.orchestrator.evaluation import TeamEvaluator, agent_accuracy, evaluation_due, pass_at_k
from flexmarl_jax.workflows import (
    ArithmeticTask,
    Problem,
    SamplingParams,
    ScriptedBackend,
    WorkflowExecutor,
    build_workflow,
)
from flexmarl_jax.workflows.oracles import PromptOracle, verdict_policy, wrong_answer
from flexmarl_jax.workflows.splits import TrainEvalSplit

CHAIN = build_workflow("chain")
SAMPLED_SKILL = 0.3  # how often a sampled solver answer is right; a greedy one always is


def _team(problems, *, sampled_skill=SAMPLED_SKILL):
    """Solver: right when greedy (temperature 0), right with `sampled_skill` when sampling. Verifier: always
    right. Corrector: always wrong (so the final answer is right iff the solver was)."""
    oracle = PromptOracle(problems)
    task = ArithmeticTask()

    def solver(request, sample_index, rng: random.Random):
        problem, _ = oracle.find(request.prompt)
        greedy = request.sampling.temperature == 0
        return problem.answer if greedy or rng.random() < sampled_skill else wrong_answer(problem, rng)

    def corrector(request, sample_index, rng):
        return wrong_answer(oracle.find(request.prompt)[0], rng)

    return {"solver": solver, "verifier": verdict_policy(oracle, task.verify, 1.0), "corrector": corrector}


@pytest.fixture
def evaluation():
    split = TrainEvalSplit(ArithmeticTask(max_digits=2, operators="+-"), eval_fraction=0.2)
    problems = split.eval_problems(200, seed=0)
    backend = ScriptedBackend(_team(problems), seed=0)
    sampling = {agent: SamplingParams(temperature=1.0, max_new_tokens=8) for agent in CHAIN.agents}
    yield TeamEvaluator(CHAIN, backend, problems, split.verify, sampling, samples=4), backend
    backend.shutdown()


@pytest.mark.timeout(120)
def test_greedy_eval_of_an_oracle_team_is_perfect_and_sampled_eval_matches_its_skill(evaluation):
    evaluator, backend = evaluation
    for agent in CHAIN.agents:
        backend.set_policy_version(agent, 3)
    record = evaluator.evaluate(3, {agent: 3 for agent in CHAIN.agents})
    assert record["kind"] == "eval" and record["iteration"] == 3 and record["eval_problems"] == 200
    assert record["eval_team_accuracy"] == 1.0
    assert record["agent"]["solver"]["eval_accuracy"] == 1.0
    assert record["agent"]["verifier"]["eval_accuracy"] == 1.0
    assert record["agent"]["corrector"]["eval_accuracy"] is None  # a right solver is never corrected
    # Sampled: 200 problems x 4 trajectories, each right with probability 0.3.
    assert record["eval_sampled_accuracy"] == pytest.approx(SAMPLED_SKILL, abs=0.06)
    assert record["eval_pass_at_k"] == pytest.approx(1 - (1 - SAMPLED_SKILL) ** 4, abs=0.1)
    assert record["eval_k"] == 4 and record["policy_version"] == {agent: 3 for agent in CHAIN.agents}
    # Both passes used the scripted agents: 200 greedy solver calls + 200 grouped sampled requests.
    solver_requests = [event for event in backend.events if event.agent == "solver"]
    assert len(solver_requests) == 400


@pytest.mark.timeout(120)
def test_samples_zero_runs_the_greedy_pass_only(evaluation):
    evaluator, backend = evaluation
    greedy_only = TeamEvaluator(CHAIN, backend, evaluator.problems, evaluator.verify, evaluator.sampling, samples=0)
    record = greedy_only.evaluate(0, {agent: 0 for agent in CHAIN.agents})
    assert record["eval_team_accuracy"] == 1.0 and record["eval_k"] == 0
    assert record["eval_pass_at_k"] is None and record["eval_sampled_accuracy"] is None
    solver_requests = [event for event in backend.events if event.agent == "solver"]
    assert len(solver_requests) == 200  # one greedy call per problem, nothing sampled
    with pytest.raises(ValueError, match="samples=-1 must be >= 0"):
        TeamEvaluator(CHAIN, backend, evaluator.problems, evaluator.verify, evaluator.sampling, samples=-1)


@pytest.mark.timeout(120)
def test_evaluations_never_reuse_request_ids(evaluation):
    evaluator, backend = evaluation
    first = evaluator.evaluate(0, {agent: 0 for agent in CHAIN.agents})
    second = evaluator.evaluate(5, {agent: 0 for agent in CHAIN.agents})
    ids = [event.request_id for event in backend.events]
    assert len(ids) == len(set(ids))
    # Fresh ids mean fresh draws: the two sampled passes differ, the greedy ones agree.
    assert first["eval_team_accuracy"] == second["eval_team_accuracy"] == 1.0
    assert first["eval_sampled_accuracy"] != second["eval_sampled_accuracy"]


@pytest.mark.timeout(60)
def test_pass_at_k_and_agent_accuracy_by_hand():
    task = ArithmeticTask()
    problems = [Problem(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]
    answers = {problems[0].prompt: [problems[0].answer, "x"], problems[1].prompt: ["x", "x"],
               problems[2].prompt: ["x", problems[2].answer], problems[3].prompt: ["x", "x"]}
    team = {"solver": lambda request, index, rng: answers[request.prompt][int(request.request_id.rsplit("_", 1)[1])],
            "verifier": lambda request, index, rng: "Y",
            "corrector": lambda request, index, rng: "x"}
    with ScriptedBackend(team) as backend:
        result = WorkflowExecutor(CHAIN, backend, task, samples_per_query=2).run(problems)
    assert pass_at_k(result) == 2 / 4  # problems 0 and 2 have one right trajectory of two
    assert result.accuracy == 2 / 8
    accuracy = agent_accuracy(CHAIN, problems, result, task.verify)
    # Solver right in 2 of 8 calls; the verifier said Y every time: right exactly when the solver was.
    assert accuracy == {"solver": 2 / 8, "verifier": 2 / 8, "corrector": None}


def test_evaluation_points():
    due = [step for step in range(0, 26) if evaluation_due(step, every=10, iterations=25)]
    assert due == [0, 10, 20, 25]
    assert [step for step in range(0, 4) if evaluation_due(step, every=1, iterations=3)] == [0, 1, 2, 3]
