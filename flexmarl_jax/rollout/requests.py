"""What a caller hands the rollout loop (`RolloutRequest`) and what it gets back: a `SequenceResult` per finished
sample, and a `TokenEvent` per sample and step for a request that streams (rollout/loop.py runs them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from flexmarl_jax.rollout.engine import SlotSampling
from flexmarl_jax.rollout.settings import validate_sampling

STOP_PATTERN_TOKENS = 64  # a stop pattern is matched against the response's last this many tokens


@dataclasses.dataclass(frozen=True)
class RolloutRequest:
    """`num_samples` continuations of one tokenised prompt.

    prompt_ids: token ids (BOS included if wanted). stop_token_ids: extra ids that end a
    sequence besides the tokenizer's EOS. stop_strings: end at the token that completes the first
    occurrence of one of them in the decoded response, also one that ends inside that token (needs the loop's
    tokenizer; the tokens are kept whole, cutting the text is the caller's). stop_pattern: a regex; end once the
    decoded last STOP_PATTERN_TOKENS tokens hold a match ('' = none). ignore_eos: only max_new_tokens (and
    the explicit stops) end a sequence, for fixed-length benchmarks. on_tokens: called with a `TokenEvent`
    per sample each step that gave it tokens (deferred like on_done under `defer_callbacks`). agent: the
    agent it is for, on an instance that serves several LoRA agents of one base from one engine (their
    adapters in one table, rollout/instance.py); "" elsewhere.
    """

    prompt_ids: tuple[int, ...]
    num_samples: int = 1
    sampling: SlotSampling = SlotSampling()
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    stop_pattern: str = ""
    ignore_eos: bool = False  # benchmarks: always generate max_new_tokens
    on_done: Callable[[list[SequenceResult]], None] | None = None
    on_error: Callable[[BaseException], None] | None = None
    on_tokens: Callable[[TokenEvent], None] | None = None
    agent: str = ""

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError("prompt_ids is empty; an empty prompt cannot be generated from")
        if isinstance(self.num_samples, bool) or not isinstance(self.num_samples, int) or self.num_samples < 1:
            raise ValueError(f"num_samples={self.num_samples!r} must be an int >= 1")
        validate_sampling(
            temperature=self.sampling.temperature,
            top_k=self.sampling.top_k,
            top_p=self.sampling.top_p,
            max_new_tokens=self.max_new_tokens,
        )


@dataclasses.dataclass(frozen=True)
class SequenceResult:
    """One finished sample: token ids / behaviour log-probs [response_len], why it ended, and the
    policy version of every token of it (a sequence never spans two versions)."""

    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    policy_version: int
    sample_index: int


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """The tokens one sample got in one step, for a request's `on_tokens`.

    logprobs: their behaviour log-probs. raw_logprobs / top: the model's own log-softmax of each token and its
    most likely alternatives ((id, log-prob) pairs, most likely first), when the engine reports them
    (`EngineConfig.top_logprobs` > 0), else empty. finish_reason: set on the sample's last event.
    """

    sample_index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    raw_logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]
    finish_reason: str | None
