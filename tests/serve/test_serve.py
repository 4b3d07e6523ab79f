"""`flexmarl serve` in a subprocess, spoken to with JetStream's own client stubs.

The server serves the solver of a trained smoke run; what it streams is compared with the same checkpoint's
greedy generation in this process (`AgentChat`, the in-process RolloutLoop on the same engine shapes).
"""

from __future__ import annotations

import concurrent.futures
import re
import signal
import time
import urllib.request

import grpc
import pytest
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

from tests.serve.conftest import ServerProcess, free_port

AGENT = "solver"
# Prompts of the run's task (reverse) and others; the smoke run's prompt limit is 32 tokens, BOS included.
PROMPTS = ["rev:abcd=", "rev:hgf=", "rev:aa=", "1+2=", "rev:cab=", "hello", "rev:dcba=", "x"]


@pytest.fixture(scope="module")
def in_process(trained_run):
    from flexmarl_jax.serve.chat import AgentChat

    return AgentChat.load(trained_run, AGENT)


@pytest.fixture(scope="module")
def server(trained_run):
    port = free_port()
    process = ServerProcess([trained_run, "--agent", AGENT, "--port", str(port)])
    try:
        process.wait_for("ready", timeout_s=240)
        yield process, port
    finally:
        process.terminate()


@pytest.fixture(autouse=True)
def _server_output_if_it_ended(request):
    """A test whose server ended under it fails with the server's own output (a Driver thread that raises
    SIGKILLs the process, and gRPC then reports only a closed socket)."""
    yield
    if "server" not in request.fixturenames:
        return
    process, _ = request.getfixturevalue("server")
    if process.process.poll() is not None:
        output = "\n".join(process.lines[-80:])
        pytest.fail(f"the server ended (rc={process.process.returncode}); its output:\n{output}")


@pytest.fixture(scope="module")
def stub(server):
    _, port = server
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield jetstream_pb2_grpc.OrchestratorStub(channel)


def _token_request(token_ids, max_tokens):
    return jetstream_pb2.DecodeRequest(
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=token_ids), max_tokens=max_tokens)


def _text_request(text, max_tokens):
    return jetstream_pb2.DecodeRequest(text_content=jetstream_pb2.DecodeRequest.TextContent(text=text),
                                       max_tokens=max_tokens)


def _stream(stub, request, timeout=60):
    """(token ids, text) of one Decode stream (one sample per response)."""
    token_ids, text = [], []
    for response in stub.Decode(request, timeout=timeout):
        (sample,) = response.stream_content.samples
        token_ids.extend(sample.token_ids)
        text.append(sample.text)
    return token_ids, "".join(text)


def _reference(in_process, text, max_tokens):
    return in_process.generate_ids(in_process.prompt_ids(text), max_tokens)


@pytest.mark.timeout(300)
def test_announces_the_address_it_binds_and_is_live(server, stub):
    process, port = server
    line = process.wait_for(f") on 127.0.0.1:{port}: ", timeout_s=1)
    assert line.startswith(f"flexmarl serve: agent {AGENT} (policy_version ")
    assert stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=10).is_live is True


@pytest.mark.timeout(300)
def test_token_and_text_content_stream_the_in_process_greedy_tokens(stub, in_process):
    max_tokens = in_process.engine_config.max_decode_length
    tokenizer = in_process.agent.tokenizer
    generated = 0
    for text in PROMPTS:
        want = _reference(in_process, text, max_tokens)
        # Token content goes without BOS: the Driver puts it in front itself.
        by_tokens, _ = _stream(stub, _token_request(tokenizer.encode(text, add_bos=False), max_tokens))
        by_text, streamed_text = _stream(stub, _text_request(text, max_tokens))
        assert by_tokens == want, text
        assert by_text == want, text
        assert streamed_text == tokenizer.decode(want)
        generated += len(want)
    assert generated >= len(PROMPTS)  # not a vacuous comparison of empty streams


@pytest.mark.timeout(300)
def test_max_tokens_caps_the_stream(stub, in_process):
    text = "rev:abcd="
    want = _reference(in_process, text, 3)
    by_tokens, _ = _stream(stub, _text_request(text, 3))
    assert by_tokens == want and len(by_tokens) <= 3


@pytest.mark.timeout(300)
def test_sixteen_concurrent_streams_all_complete(stub, in_process):
    max_tokens = in_process.engine_config.max_decode_length
    texts = [f"rev:{a}{b}{c}=" for a, b, c in ["abc", "bca", "cab", "hgf", "fed", "aab", "dcb", "hha",
                                               "bag", "gab", "ceh", "ech", "dad", "add", "bbc", "fhg"]]
    want = [_reference(in_process, text, max_tokens) for text in texts]
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        streams = list(pool.map(lambda text: _stream(stub, _text_request(text, max_tokens))[0], texts))
    assert streams == want


BAD_REQUESTS = {
    "empty text": (_text_request("", 4), "text_content.text is empty"),
    "empty tokens": (_token_request([], 4), "token_content.token_ids is empty"),
    "no content": (jetstream_pb2.DecodeRequest(max_tokens=4), "content"),
    "max_tokens 0": (_text_request("rev:abc=", 0), "max_tokens=0"),
    "max_tokens beyond the limit": (_text_request("rev:abc=", 9), "max_tokens=9"),  # the smoke run: 8 new tokens
    "prompt too long": (_text_request("a" * 32, 4), "max_prefill_length=32"),  # 32 characters + BOS
    "token outside the vocabulary": (_token_request([5, 104], 4), "104"),
    "session_cache": (jetstream_pb2.DecodeRequest(session_cache="x", text_content=jetstream_pb2.DecodeRequest.
                                                  TextContent(text="rev:abc="), max_tokens=4), "session_cache"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_and_the_next_request_is_served(stub, in_process, case):
    request, named = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as raised:
        _stream(stub, request)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in raised.value.details()
    assert len(raised.value.details().splitlines()) == 1
    assert _stream(stub, _text_request("rev:abcd=", 8))[0] == _reference(in_process, "rev:abcd=", 8)


@pytest.mark.timeout(300)
def test_the_longest_accepted_prompt_is_served(stub, in_process):
    text = "a" * 31  # 31 characters + BOS = max_prefill_length
    assert _stream(stub, _text_request(text, 8))[0] == _reference(in_process, text, 8)


@pytest.mark.timeout(400)
def test_sigterm_with_streams_open_stops_the_server_within_10_s(trained_run):
    """Every agent of the run, each on its own (free) port with two slots; many long requests to the solver:
    when its first token arrives most streams are still open (queued or decoding); SIGTERM must cancel them
    and end the process (exit status 0) within 10 s. This server also exports JetStream's Prometheus gauges,
    labelled with the agent."""
    metrics_port = free_port()
    process = ServerProcess([trained_run, "--port", "0", "--slots", "2", "--max-new-tokens", "256",
                             "--metrics-port", str(metrics_port)])
    try:
        process.wait_for("ready", timeout_s=240)
        ports = dict(re.findall(r"agent (\w+) \(policy_version \d+\) on 127\.0\.0\.1:(\d+):",
                                "\n".join(process.lines)))
        assert sorted(ports) == ["corrector", "solver", "verifier"] and len(set(ports.values())) == 3
        for agent_port in ports.values():
            with grpc.insecure_channel(f"127.0.0.1:{agent_port}") as channel:
                health = jetstream_pb2_grpc.OrchestratorStub(channel).HealthCheck(jetstream_pb2.HealthCheckRequest())
                assert health.is_live
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
            metrics = page.read().decode()
        for agent in ports:
            assert f'jetstream_prefill_backlog_size{{id="{agent}"}}' in metrics
        channel = grpc.insecure_channel(f"127.0.0.1:{ports[AGENT]}")
        stub = jetstream_pb2_grpc.OrchestratorStub(channel)
        calls = [stub.Decode(_text_request(f"rev:{'abcdefgh'[i % 8]}{'hgfedcba'[i % 7]}c=", 256), timeout=120)
                 for i in range(48)]
        first = next(iter(calls[0]))  # a stream is being decoded now
        assert first.stream_content.samples
        open_streams = sum(not call.done() for call in calls)
        process.process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        returncode = process.process.wait(timeout=10)
        stopped_after = time.monotonic() - started
        outcomes = []
        for call in calls:
            try:
                for _ in call:
                    pass
                outcomes.append(grpc.StatusCode.OK)
            except grpc.RpcError as error:
                outcomes.append(error.code())
        channel.close()
    finally:
        process.terminate()
    assert open_streams >= 1
    assert returncode == 0, "\n".join(process.lines)
    assert stopped_after < 10
    assert any(code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE) for code in outcomes)
    assert any("stopping" in line for line in process.lines)


def test_unknown_agent_and_version_are_one_line_errors(trained_run, capsys):
    from flexmarl_jax.cli.main import main

    assert main(["serve", trained_run, "--agent", "nobody"]) == 2
    error = capsys.readouterr().err.strip()
    assert "unknown agent 'nobody'" in error and "solver" in error and len(error.splitlines()) == 1
    assert main(["serve", trained_run, "--agent", AGENT, "--version", "99"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("flexmarl serve: --version 99") and len(error.splitlines()) == 1
