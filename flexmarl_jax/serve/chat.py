"""`flexmarl chat`: ask one trained agent, or the whole team, questions in process.

    chat = AgentChat.load(workdir, "solver")         # greedy, on the run's engine shapes
    chat.reply("rev:abcd=")                            # -> "dcba"
    team = TeamChat.load(workdir)                      # every agent, the run's workflow
    for turn in team.ask("rev:abcd=").turns: print(turn.node, turn.text)

Both decode greedily with the agents' latest checkpoints (or ``version``). `AgentChat` sends the question as the
agent's prompt (a user message through its chat template, for a chat checkpoint); `TeamChat` runs the run's
workflow on it exactly as held-out evaluation does (orchestrator/evaluation.py: dependency-driven executor, each
agent at temperature 0 with its own top-k/top-p and the run's response length), with nothing stored or trained.
`run_repl` is the interactive loop over either.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import IO, Any

import jax

from flexmarl_jax.config.workflow_from_config import team_agents, workflow_from_config
from flexmarl_jax.mesh.meshes import make_mesh
from flexmarl_jax.rollout.backend import EngineBackend
from flexmarl_jax.rollout.instance import EngineInstance
from flexmarl_jax.rollout.loop import RolloutLoop, RolloutRequest
from flexmarl_jax.serve.served_agent import (
    ServedAgent,
    build_engine,
    check_jetstream_shapes,
    load_agent,
    read_run,
    serving_engine_config,
)
from flexmarl_jax.workflows import Problem, SamplingParams, WorkflowExecutor

QUIT_COMMANDS = ("/quit", "/exit")


class AgentChat:
    """One agent answering greedily in process (a `RolloutLoop` over its own `FlexEngine`)."""

    def __init__(self, agent: ServedAgent, run: Any, device: Any = None):
        self.agent, self.run = agent, run
        # The engine shapes `flexmarl serve` uses, so in-process answers are the served ones.
        self.engine_config = serving_engine_config(run, agent.name)
        self.engine, self.params = build_engine(agent, self.engine_config, device or jax.devices()[0])
        self.loop = RolloutLoop(self.engine, self.params, policy_version=agent.policy_version)

    @classmethod
    def load(cls, workdir: str, agent: str, *, version: int | None = None) -> AgentChat:
        run = read_run(workdir)
        return cls(load_agent(workdir, agent, version=version, run=run), run)

    def prompt_ids(self, text: str) -> list[int]:
        """The question as the agent's prompt: a user turn through its chat template, else the text after BOS."""
        tokenizer = self.agent.tokenizer
        if getattr(tokenizer, "chat_template", None) is not None:
            rendered = tokenizer.render_chat([{"role": "user", "content": text}], add_generation_prompt=True)
            return tokenizer.encode(rendered, add_bos=False)
        return tokenizer.encode(text, add_bos=True)

    def generate_ids(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> list[int]:
        """Greedy continuation of ``prompt_ids`` (BOS included if wanted), without the stop token that ends it."""
        limit = max_new_tokens or self.engine_config.max_decode_length
        (result,) = self.loop.generate([RolloutRequest(tuple(prompt_ids), max_new_tokens=limit)])[0]
        stop_ids = set(getattr(self.agent.tokenizer, "stop_ids", ()) or (self.agent.tokenizer.eos_id,))
        tokens = list(result.token_ids)
        return tokens[:-1] if result.finish_reason == "stop" and tokens and tokens[-1] in stop_ids else tokens

    def reply(self, text: str) -> str:
        return self.agent.tokenizer.decode(self.generate_ids(self.prompt_ids(text)))

    def respond(self, text: str) -> list[str]:
        """The lines the REPL prints for one question."""
        return [f"{self.agent.name}: {self.reply(text)}"]

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Turn:
    """One agent call of a team's answer."""

    node: str
    agent: str
    text: str
    answer: str | None  # what the workflow parsed from the text (None if malformed)


@dataclasses.dataclass(frozen=True)
class TeamAnswer:
    turns: tuple[Turn, ...]  # in workflow order; skipped nodes (a corrector after a Y) are absent
    final_answer: str | None


class TeamChat:
    """The run's whole workflow answering greedily: one engine instance per agent behind an `EngineBackend`."""

    def __init__(self, agents: dict[str, ServedAgent], run: Any):
        self.run = run
        chat_models = all(getattr(agent.tokenizer, "chat_template", None) is not None for agent in agents.values())
        self.workflow = workflow_from_config(run.workflow, chat_models=chat_models)
        devices = jax.devices()
        instances = {}
        for index, (name, agent) in enumerate(agents.items()):
            engine_config = serving_engine_config(run, name)
            check_jetstream_shapes(engine_config, agent.model_config, name)
            mesh = make_mesh([devices[index % len(devices)]], fsdp=1)
            instances[name] = [EngineInstance.create(agent.model_config, agent.graphdef, agent.params, engine_config,
                                                     agent.tokenizer, mesh=mesh, policy_version=agent.policy_version,
                                                     name=f"chat-{name}")]
        self.backend = EngineBackend(instances, {name: agent.tokenizer for name, agent in agents.items()})
        greedy = {name: SamplingParams(temperature=0.0, top_k=run.agents[name].top_k, top_p=run.agents[name].top_p,
                                       max_new_tokens=run.rollout.max_response_length) for name in agents}
        # No reference answer exists for a typed question: nothing is verified, nothing is rewarded or stored.
        self.executor = WorkflowExecutor(self.workflow, self.backend, lambda problem, answer: False,
                                         samples_per_query=1, sampling=greedy, mode="dependency")
        self._numbers = itertools.count()

    @classmethod
    def load(cls, workdir: str, *, version: int | None = None) -> TeamChat:
        run = read_run(workdir)
        agents = {name: load_agent(workdir, name, version=version, run=run) for name in team_agents(run.workflow)}
        return cls(agents, run)

    def ask(self, question: str) -> TeamAnswer:
        problem = Problem(input_id=f"chat{next(self._numbers)}", prompt=question, answer="")
        (trajectory,) = self.executor.run([problem]).trajectories
        order = {node: index for index, node in enumerate(self.workflow.nodes)}
        turns = tuple(Turn(node, output.agent, output.text, output.answer)
                      for node, output in sorted(trajectory.outputs.items(), key=lambda item: order[item[0]]))
        return TeamAnswer(turns, trajectory.final_answer)

    def respond(self, text: str) -> list[str]:
        answer = self.ask(text)
        lines = [f"{turn.node} ({turn.agent}): {turn.text.strip()}" if turn.node != turn.agent
                 else f"{turn.agent}: {turn.text.strip()}" for turn in answer.turns]
        return lines + [f"answer: {answer.final_answer if answer.final_answer is not None else '(none)'}"]

    def close(self) -> None:
        self.backend.close()


def run_repl(session: AgentChat | TeamChat, stdin: IO[str], stdout: IO[str], *, prompt: str = "> ") -> int:
    """Reads questions line by line until end of input or /quit; prints each response. Returns the number of
    questions answered. ``prompt`` is printed before each read (pass "" for scripted input)."""
    answered = 0
    while True:
        if prompt:
            stdout.write(prompt)
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        question = line.rstrip("\n")
        if question.strip() in QUIT_COMMANDS:
            break
        if not question.strip():
            continue
        try:
            lines = session.respond(question)
        except ValueError as error:  # a question longer than the engine's prompt length, say
            lines = [f"error: {error}"]
        for out in lines:
            stdout.write(out + "\n")
        stdout.flush()
        answered += 1
    return answered
