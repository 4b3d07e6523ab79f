"""`flexmarl serve --api openai` in a subprocess, spoken to with the real `openai` client (max_retries=0).

Three servers: the solver of a run on the synthetic BPE chat checkpoint (4 slots, on port 8000 so that the
README's snippet runs as printed), the same solver with one slot, a long response budget and an API key (a
dropped client must free its slot), and the tiny preset's team (character tokenizer, no chat template). What
they answer at temperature 0 is compared with the same checkpoint's greedy tokens in this process.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from openai import APIStatusError, APITimeoutError, OpenAI

from tests.serve.conftest import REPO, ServerProcess, free_port

AGENT = "solver"
KEY = "sk-flexmarl-test"
SNIPPET_PORT = 8000  # the README's snippet talks to the default port
QUESTIONS = ["What is 2 + 3?", "Tom has 4 apples and eats one. How many are left?", "hello"]


def _start(args: list[str]) -> ServerProcess:
    process = ServerProcess(["--api", "openai", *args])
    process.wait_for("ready", timeout_s=300)
    return process


@pytest.fixture(scope="module")
def chat_server(chat_run):
    process = _start([chat_run, "--agent", AGENT, "--slots", "4", "--port", str(SNIPPET_PORT)])
    try:
        yield process
    finally:
        process.terminate()


@pytest.fixture(scope="module")
def one_slot_server(chat_run):
    port = free_port()
    process = _start([chat_run, "--agent", AGENT, "--slots", "1", "--max-new-tokens", "2048", "--port", str(port),
                      "--api-key", KEY])
    try:
        yield process, port
    finally:
        process.terminate()


@pytest.fixture(scope="module")
def tiny_server(trained_run):
    port = free_port()
    process = _start([trained_run, "--slots", "4", "--port", str(port)])
    try:
        yield process, port
    finally:
        process.terminate()


def _client(port: int, key: str = "unused") -> OpenAI:
    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(chat_server) -> OpenAI:
    return _client(SNIPPET_PORT)


@dataclasses.dataclass
class Reference:
    """The served checkpoint's greedy generation in this process, on the server's engine shapes."""

    loop: object
    tokenizer: object

    @classmethod
    def load(cls, workdir: str, agent: str, slots: int) -> Reference:
        import jax

        from flexmarl_jax.rollout.loop import RolloutLoop
        from flexmarl_jax.serve.openai_server import openai_engine_config
        from flexmarl_jax.serve.served_agent import build_engine, load_agent, read_run

        run = read_run(workdir)
        served = load_agent(workdir, agent, run=run)
        config = openai_engine_config(run, agent, slots=slots)
        engine, params = build_engine(served, config, jax.devices()[0])
        return cls(RolloutLoop(engine, params), served.tokenizer)

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> tuple[str, int, str]:
        """(text, tokens generated, finish reason) of the greedy continuation."""
        from flexmarl_jax.rollout.loop import RolloutRequest

        (result,) = self.loop.generate([RolloutRequest(tuple(prompt_ids), max_new_tokens=max_tokens)])[0]
        return self.tokenizer.decode(result.token_ids), len(result.token_ids), result.finish_reason

    def chat_prompt(self, text: str) -> list[int]:
        rendered = self.tokenizer.render_chat([{"role": "user", "content": text}], add_generation_prompt=True)
        return self.tokenizer.encode(rendered, add_bos=False)


@pytest.fixture(scope="module")
def chat_reference(chat_run) -> Reference:
    return Reference.load(chat_run, AGENT, slots=4)


def _health(port: int, key: str | None = None) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/health",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=10) as page:
        return json.loads(page.read())


def _streamed_text(stream, chat: bool) -> tuple[str, str | None]:
    text, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            piece = (choice.delta.content if chat else choice.text) or ""
            text.append(piece)
            finish = choice.finish_reason or finish
    return "".join(text), finish


# ---------------------------------------------------------------------------------------------- greedy equality
@pytest.mark.timeout(600)
def test_chat_and_completions_at_temperature_0_equal_the_in_process_greedy_tokens(client, chat_reference):
    for question in QUESTIONS:
        expected, generated, reason = chat_reference.greedy(chat_reference.chat_prompt(question), 24)
        answer = client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": question}],
                                                temperature=0, max_tokens=24)
        (choice,) = answer.choices
        assert choice.message.content == expected and choice.message.role == "assistant"
        assert choice.finish_reason == reason
        assert answer.usage.completion_tokens == generated
        assert answer.usage.prompt_tokens == len(chat_reference.chat_prompt(question))
        streamed = client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": question}],
                                                  temperature=0, max_tokens=24, stream=True)
        assert _streamed_text(streamed, chat=True) == (expected, reason)

        prompt_ids = chat_reference.tokenizer.encode(question, add_bos=True)
        expected, generated, reason = chat_reference.greedy(prompt_ids, 16)
        completion = client.completions.create(model=AGENT, prompt=question, temperature=0, max_tokens=16)
        assert completion.choices[0].text == expected and completion.usage.completion_tokens == generated
        streamed = client.completions.create(model=AGENT, prompt=question, temperature=0, max_tokens=16, stream=True)
        assert _streamed_text(streamed, chat=False) == (expected, reason)


@pytest.mark.timeout(600)
def test_the_tiny_preset_team_serves_completions_equal_to_in_process_greedy(tiny_server, trained_run):
    _, port = tiny_server
    tiny = _client(port)
    models = {model.id: model for model in tiny.models.list().data}
    assert sorted(models) == ["corrector", "solver", "verifier"]
    assert all(model.model_extra["policy_version"] >= 1 for model in models.values())
    reference = Reference.load(trained_run, AGENT, slots=4)
    for prompt in ["rev:abcd=", "rev:hgf=", "1+2="]:
        expected, generated, reason = reference.greedy(reference.tokenizer.encode(prompt, add_bos=True), 8)
        completion = tiny.completions.create(model=AGENT, prompt=prompt, temperature=0, max_tokens=8)
        assert completion.choices[0].text == expected and completion.choices[0].finish_reason == reason
        streamed = tiny.completions.create(model=AGENT, prompt=prompt, temperature=0, max_tokens=8, stream=True)
        assert _streamed_text(streamed, chat=False) == (expected, reason)
    with pytest.raises(APIStatusError) as raised:  # no chat template: chat is refused, and serving goes on
        tiny.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.status_code == 400 and "chat template" in str(raised.value)
    assert tiny.completions.create(model="verifier", prompt="x", max_tokens=2).choices[0].finish_reason


# ---------------------------------------------------------------------------------------------- sampling
def test_n_choices_with_a_seed_repeat_and_another_seed_changes_them(client):
    def four(seed: int) -> list[str]:
        answer = client.completions.create(model=AGENT, prompt="Once upon a time", n=4, temperature=1.0, seed=seed,
                                           max_tokens=12)
        assert [choice.index for choice in answer.choices] == [0, 1, 2, 3]
        return [choice.text for choice in answer.choices]

    first = four(11)
    assert len(set(first)) >= 2
    assert four(11) == first
    assert four(12) != first
    unseeded = [four_text for four_text in (client.completions.create(
        model=AGENT, prompt="Once upon a time", temperature=1.0, max_tokens=12).choices[0].text for _ in range(3))]
    assert len(set(unseeded)) >= 2  # a request without a seed draws its own


def test_logprobs_are_raw_log_softmax_and_top_alternatives_are_sorted(client, chat_reference):
    answer = client.completions.create(model=AGENT, prompt="hello", temperature=0, max_tokens=6, logprobs=5)
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) >= 1
    for value, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) <= 5 and value <= 0
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert abs(max(top.values()) - value) < 1e-5  # greedy: the token drawn is the most likely one
    # Sampled at a low temperature, the reported log-prob is the model's own, not the sharpened distribution's.
    hot = client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "hi"}], temperature=0.3,
                                         seed=3, max_tokens=6, logprobs=True, top_logprobs=3)
    content = hot.choices[0].logprobs.content
    assert content and all(len(entry.top_logprobs) == 3 for entry in content)
    assert all(entry.logprob <= entry.top_logprobs[0].logprob + 1e-6 for entry in content)


def test_a_stop_string_ends_the_text_before_it(client, chat_reference):
    prompt = "Count with me"
    free, _, _ = chat_reference.greedy(chat_reference.tokenizer.encode(prompt, add_bos=True), 24)
    assert len(free) > 6, free
    stop = free[3:5]  # two characters from the middle of the free text, most likely inside a token
    cut = free[: free.index(stop)]
    answer = client.completions.create(model=AGENT, prompt=prompt, temperature=0, max_tokens=24, stop=[stop])
    assert answer.choices[0].text == cut and answer.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=AGENT, prompt=prompt, temperature=0, max_tokens=24, stop=stop,
                                         stream=True)
    assert _streamed_text(streamed, chat=False) == (cut, "stop")


@pytest.mark.timeout(600)
def test_32_concurrent_requests_all_complete(client):
    def ask(index: int):
        if index % 2:
            return client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": f"Q{index}"}],
                                                  temperature=0.8, seed=index, max_tokens=16).choices[0].finish_reason
        stream = client.completions.create(model=AGENT, prompt=f"Number {index}", temperature=0.8, seed=index,
                                           max_tokens=16, stream=True)
        return _streamed_text(stream, chat=False)[1]

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        reasons = list(pool.map(ask, range(32)))
    assert len(reasons) == 32 and all(reason in ("stop", "length") for reason in reasons)


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("call, status, words", [
    (dict(model="nobody", prompt="x"), 404, "nobody"),
    (dict(model=AGENT, prompt="x", temperature=3), 400, "temperature"),
    (dict(model=AGENT, prompt="x", top_p=0), 400, "top_p"),
    (dict(model=AGENT, prompt="x", max_tokens=0), 400, "max_tokens"),
    (dict(model=AGENT, prompt="x", max_tokens=100_000), 400, "at most"),
    (dict(model=AGENT, prompt="x", n=0), 400, "n:"),
    (dict(model=AGENT, prompt="x", stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (dict(model=AGENT, prompt="x", logprobs=21), 400, "logprobs"),
    (dict(model=AGENT, prompt="x", presence_penalty=1.0), 400, "presence_penalty"),
    (dict(model=AGENT, prompt="word " * 400), 400, "takes at most"),
    (dict(model=AGENT, prompt=[]), 400, "prompt"),
])
def test_bad_input_gets_an_openai_error_and_the_next_request_is_served(client, call, status, words):
    with pytest.raises(APIStatusError) as raised:
        client.completions.create(**call)
    assert raised.value.status_code == status
    error = raised.value.body
    assert words in error["message"] and error["type"].endswith("error"), error
    assert client.completions.create(model=AGENT, prompt="x", max_tokens=2).choices[0].finish_reason


def test_a_chat_message_without_content_is_a_400_naming_it(client):
    with pytest.raises(APIStatusError) as raised:
        client.chat.completions.create(model=AGENT, messages=[{"role": "user"}])
    assert raised.value.status_code == 400 and raised.value.body["param"] == "messages[0].content"


def test_the_readme_client_snippet_runs_unmodified(chat_server):
    with open(os.path.join(REPO, "README.md")) as handle:
        readme = handle.read()
    snippet = re.search(r"```python\n(from openai import OpenAI\n.*?)```", readme, re.S).group(1)
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "the snippet printed nothing"


# ---------------------------------------------------------------------------------------------- one slot, a key
def test_without_the_key_a_request_gets_401(one_slot_server):
    _, port = one_slot_server
    with pytest.raises(APIStatusError) as raised:
        _client(port, key="wrong").models.list()
    assert raised.value.status_code == 401
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10)
        raise AssertionError("no 401 without a key")
    except urllib.error.HTTPError as error:
        assert error.code == 401
    assert [model.id for model in _client(port, KEY).models.list().data] == [AGENT]


def _slots_free_within(port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        figures = _health(port)["models"][AGENT]
        if figures["active_slots"] == 0 and figures["queued_requests"] == 0:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(300)
def test_a_dropped_stream_frees_its_slot_and_the_next_request_is_served_at_once(one_slot_server):
    """One slot, 2,048 tokens asked with EOS ignored (several seconds of decoding): the client reads one chunk
    and goes away; the slot is free well before that response could have finished, and the next request runs."""
    _, port = one_slot_server
    served = _client(port, KEY)
    stream = served.completions.create(model=AGENT, prompt="Once", max_tokens=2048, temperature=1.0, seed=1,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    assert _health(port)["models"][AGENT]["active_slots"] == 1
    dropped_at = time.monotonic()
    stream.close()
    assert _slots_free_within(port, 3.0)
    freed_after = time.monotonic() - dropped_at
    answer = served.completions.create(model=AGENT, prompt="Next", max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")
    # The same 2,048 tokens, not dropped: how long the slot would have stayed busy.
    started = time.monotonic()
    served.completions.create(model=AGENT, prompt="Once", max_tokens=2048, temperature=1.0, seed=1,
                              extra_body={"ignore_eos": True})
    whole = time.monotonic() - started
    assert freed_after < 0.5 * whole, (freed_after, whole)


@pytest.mark.timeout(300)
def test_a_dropped_non_streamed_request_frees_its_slot(one_slot_server):
    _, port = one_slot_server
    hasty = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=0.5)
    with pytest.raises(APITimeoutError):  # the client gives up and closes the connection
        hasty.completions.create(model=AGENT, prompt="Once", max_tokens=2048, temperature=1.0, seed=2,
                                 extra_body={"ignore_eos": True})
    assert _slots_free_within(port, 3.0)


@pytest.mark.timeout(300)
def test_sigterm_with_streams_open_stops_the_server_within_10_s(chat_run):
    process = _start([chat_run, "--agent", AGENT, "--slots", "2", "--max-new-tokens", "2048", "--port", "0"])
    try:
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", process.wait_for("OpenAI API on", 5)).group(1))
        served = _client(port)
        streams = [served.completions.create(model=AGENT, prompt=f"Story {i}", max_tokens=2048, stream=True,
                                             extra_body={"ignore_eos": True}) for i in range(2)]
        for stream in streams:
            next(iter(stream))
        process.process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        returncode = process.process.wait(timeout=10)
        stopped_after = time.monotonic() - started
        for stream in streams:  # each ends early (closed by the server), none hangs
            try:
                for _ in stream:
                    pass
            except Exception:  # noqa: BLE001 -- a connection closed mid-stream is one way for it to end
                pass
    finally:
        process.terminate()
    assert returncode == 0, "\n".join(process.lines)
    assert stopped_after < 10
    assert any("stopped" in line for line in process.lines)
