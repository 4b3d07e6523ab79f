"""Scripted generation backend: per-agent Python policies with configurable latencies.

It stands in for the rollout engine in tests and benchmarks. Each request runs on a worker thread, sleeps
for its scripted latency (the max over its samples, as if they were decoded in one batch) and returns
completions whose token ids come from a simple character encoding. Everything random is drawn from an
RNG seeded by the request id, so the same request always yields the same text and latency, whatever the
submission order: two execution modes of the same batch produce identical experience.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from flexmarl_jax.workflows.generation import Completion, GenerationRequest

# policy(request, sample_index, rng) -> completion text (before stop/length truncation)
Policy = Callable[[GenerationRequest, int, random.Random], str]
# latency(request, sample_index, rng) -> seconds this sample takes
Latency = Callable[[GenerationRequest, int, random.Random], float]


def constant_latency(seconds: float) -> Latency:
    """Every sample takes `seconds`."""
    return lambda request, sample_index, rng: seconds


def long_tail_latency(base_s: float, tail_s: float, tail_probability: float, jitter: float = 0.2) -> Latency:
    """Mostly `base_s` (± jitter), but with `tail_probability` a straggler of `tail_s`.

    This is the shape the FlexMARL paper measured: most interactions finish fast, a few take far longer.
    """
    if not 0.0 <= tail_probability <= 1.0:
        raise ValueError(f"tail_probability={tail_probability} must be in [0, 1]")

    def latency(request: GenerationRequest, sample_index: int, rng: random.Random) -> float:
        scale = 1.0 + jitter * (2.0 * rng.random() - 1.0)
        return (tail_s if rng.random() < tail_probability else base_s) * scale

    return latency


def char_encode(text: str) -> list[int]:
    """Default scripted tokenizer: one token per character (its code point)."""
    return [ord(character) for character in text]


@dataclasses.dataclass(frozen=True)
class ScriptedAgent:
    """A scripted agent: what it answers and how long it takes."""

    policy: Policy
    latency: Latency | None = None


@dataclasses.dataclass(frozen=True)
class RequestEvent:
    """When the backend received, started and finished one request (time.monotonic seconds)."""

    request_id: str
    agent: str
    prompt: str
    submitted_at: float
    started_at: float
    finished_at: float


class ScriptedBackend:
    """A `GenerationBackend` over per-agent scripted policies, run on a thread pool.

    Args:
      agents: agent name -> ScriptedAgent (or a bare policy callable, latency 0).
      max_workers: how many requests run at once (the "engine capacity").
      seed: mixed into every request's RNG.
      encode: text -> token ids (default: one id per character).
      policy_versions: initial policy version per agent (default 0); change with `set_policy_version`.
    """

    def __init__(
        self,
        agents: Mapping[str, ScriptedAgent | Policy],
        *,
        max_workers: int = 32,
        seed: int = 0,
        encode: Callable[[str], Sequence[int]] = char_encode,
        policy_versions: Mapping[str, int] | None = None,
    ):
        self._agents = {
            name: agent if isinstance(agent, ScriptedAgent) else ScriptedAgent(policy=agent)
            for name, agent in agents.items()
        }
        self._seed = seed
        self._encode = encode
        self._versions = {name: 0 for name in self._agents}
        self._versions.update(policy_versions or {})
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="scripted"
        )
        self._lock = threading.Lock()
        self._events: list[RequestEvent] = []

    @property
    def events(self) -> list[RequestEvent]:
        """A copy of the finished requests' timings, in finishing order."""
        with self._lock:
            return list(self._events)

    def set_policy_version(self, agent: str, version: int) -> None:
        with self._lock:
            self._versions[agent] = version

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[list[Completion]]:
        if request.agent not in self._agents:
            raise ValueError(
                f"ScriptedBackend has no policy for agent {request.agent!r}; "
                f"known agents: {sorted(self._agents)}"
            )
        if request.num_samples < 1:
            raise ValueError(
                f"request {request.request_id!r}: num_samples={request.num_samples} must be >= 1"
            )
        return self._pool.submit(self._run, request, time.monotonic())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ScriptedBackend:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def _run(self, request: GenerationRequest, submitted_at: float) -> list[Completion]:
        started_at = time.monotonic()
        agent = self._agents[request.agent]
        with self._lock:
            version = self._versions.get(request.agent, 0)
        completions, delays = [], []
        for sample_index in range(request.num_samples):
            # A str seed is hashed deterministically by `random` (not by PYTHONHASHSEED).
            rng = random.Random(f"{self._seed}|{request.sampling.seed}|{request.request_id}|{sample_index}")
            text = agent.policy(request, sample_index, rng)
            delays.append(agent.latency(request, sample_index, rng) if agent.latency else 0.0)
            completions.append(self._complete(request, text, version, rng))
        if max(delays) > 0:
            time.sleep(max(delays))
        with self._lock:
            self._events.append(
                RequestEvent(
                    request.request_id,
                    request.agent,
                    str(request.prompt),
                    submitted_at,
                    started_at,
                    time.monotonic(),
                )
            )
        return completions

    def _complete(
        self, request: GenerationRequest, text: str, version: int, rng: random.Random
    ) -> Completion:
        finish_reason = "stop"
        for stop in request.sampling.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        match = re.search(request.sampling.stop_pattern, text) if request.sampling.stop_pattern else None
        if match:  # kept, as the rollout loop keeps it
            text = text[:match.end()]
        token_ids = list(self._encode(text))
        if len(token_ids) > request.sampling.max_new_tokens:
            # With the default char encoding ids and characters line up one to one.
            token_ids = token_ids[: request.sampling.max_new_tokens]
            text = text[: request.sampling.max_new_tokens]
            finish_reason = "length"
        logprobs = tuple(-0.05 - rng.random() for _ in token_ids)
        return Completion(
            text=text,
            prompt_token_ids=tuple(self._encode(str(request.prompt))),
            token_ids=tuple(token_ids),
            logprobs=logprobs,
            finish_reason=finish_reason,
            policy_version=version,
        )
