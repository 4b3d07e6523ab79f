"""`flexmarl chat` driven by a scripted stdin session, against an uncached greedy reference."""

from __future__ import annotations

import functools
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

QUESTIONS = ["rev:abcd=", "rev:hgf=", "1+2="]
REFERENCE_LENGTH = 64  # prompts and answers of the smoke run fit (32 + 8 tokens)


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, tokens, mask):
    from flexmarl_jax.models import functional

    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return functional.forward(graphdef, params, tokens, positions, mask)


def greedy_without_cache(agent, text: str, max_new_tokens: int) -> str:
    """Greedy decoding by a full forward pass per token (no KV cache, no engine): an independent reference."""
    tokenizer = agent.tokenizer
    ids = tokenizer.encode(text, add_bos=True)
    new = []
    for _ in range(max_new_tokens):
        tokens = np.zeros((1, REFERENCE_LENGTH), np.int32)
        tokens[0, :len(ids)] = ids
        mask = np.arange(REFERENCE_LENGTH)[None] < len(ids)
        token = int(np.argmax(np.asarray(_logits(agent.graphdef, agent.params, tokens, mask))[0, len(ids) - 1]))
        if token in tokenizer.stop_ids:
            break
        ids.append(token)
        new.append(token)
    return tokenizer.decode(new)


def _chat(monkeypatch, capsys, args: list[str], stdin: str) -> str:
    from flexmarl_jax.cli.main import main

    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert main(["chat", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.timeout(300)
def test_agent_chat_answers_each_line_until_quit(trained_run, monkeypatch, capsys):
    from flexmarl_jax.serve.served_agent import load_agent

    out = _chat(monkeypatch, capsys, [trained_run, "--agent", "solver"],
                "\n".join(QUESTIONS) + "\n\n/quit\nrev:never=\n")
    solver = load_agent(trained_run, "solver")
    replies = [greedy_without_cache(solver, question, 8) for question in QUESTIONS]
    # one response per question, the blank line skipped, nothing after /quit
    assert out == "".join(f"solver: {reply}\n" for reply in replies)
    assert sum(len(reply) for reply in replies) > 0


@pytest.mark.timeout(300)
def test_team_chat_prints_each_agents_turn_and_the_answer(trained_run, monkeypatch, capsys):
    from flexmarl_jax.serve.served_agent import load_agent
    from flexmarl_jax.workflows.graph import parse_verdict

    questions = ["rev:abcd=", "rev:hgf="]
    out = _chat(monkeypatch, capsys, [trained_run, "--team"], "\n".join(questions) + "\n")
    solver = load_agent(trained_run, "solver")
    blocks = re.split(r"^answer: .*\n", out, flags=re.M)
    assert len(blocks) == len(questions) + 1 and blocks[-1] == ""
    for question, block in zip(questions, blocks, strict=False):
        # chain: the solver's prompt is the question itself (its template is "{prompt}"), so its turn is the
        # agent's greedy reply; the verifier judges; the corrector runs only when the verdict is N
        assert block.startswith(f"solver: {greedy_without_cache(solver, question, 8).strip()}\nverifier: ")
        verifier_and_after = block.split("\nverifier: ", 1)[1]
        verdict = parse_verdict(verifier_and_after.split("\ncorrector: ", 1)[0])
        assert ("\ncorrector: " in verifier_and_after) == (verdict == "N")


def test_chat_needs_an_agent_or_the_team(trained_run, capsys):
    from flexmarl_jax.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["chat", trained_run])
    assert exited.value.code == 2
    assert "--agent" in capsys.readouterr().err
