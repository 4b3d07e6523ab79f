"""Rollout settings that must be checked before any JAX code runs, and an agent's `EngineConfig` from the run
config (`engine_config_for`).

Pure Python (no JAX import) so that config validation can call it when a config
loads. Every error names the field, the offending value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flexmarl_jax.config import RunConfig


class VersionSwapPolicy(enum.StrEnum):
    """What an engine instance does with in-flight sequences when new weights arrive.

    DRAIN:   stop admitting, finish every in-flight sequence under the old weights (its
             result says so through `policy_version`), then swap.
    REQUEUE: abort in-flight sequences, swap at once, and re-queue them; they restart
             from their prompt under the new weights.
    Either way no sequence ever mixes two policy versions.
    """

    DRAIN = "drain"
    REQUEUE = "requeue"


def validate_sampling(
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    max_new_tokens: int,
    field: str = "sampling",
) -> None:
    """Raises ValueError naming `field.<name>` when a sampling setting is out of range.

    temperature == 0 means greedy; top_k == 0 means no top-k cut; top_p == 1.0 means no
    nucleus cut.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"{field}.temperature={temperature!r} must be a number >= 0 (0 means greedy)")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"{field}.top_k={top_k!r} must be an int >= 0 (0 disables top-k)")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"{field}.top_p={top_p!r} must be in (0, 1] (1 disables top-p)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"{field}.max_new_tokens={max_new_tokens!r} must be an int >= 1")


# The most raw top log-probs a served request may ask for per token (OpenAI's `top_logprobs` allows 0..20).
MAX_TOP_LOGPROBS = 20


def default_prefill_buckets(max_prefill_length: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest` up to (and always ending at) `max_prefill_length`."""
    buckets = []
    length = smallest
    while length < max_prefill_length:
        buckets.append(length)
        length *= 2
    buckets.append(max_prefill_length)
    return tuple(buckets)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static shape settings of one FlexEngine; changing any of them means recompiling. No defaults of its own:
    a run's comes from `engine_config_for` (below).

    max_concurrent_decodes: decode slots (rows of the decode batch).
    max_prefill_length:     longest prompt in tokens (BOS included).
    max_decode_length:      most tokens a sequence may generate; the KV cache holds
                            max_prefill_length + max_decode_length positions.
    prefill_buckets:        prompt lengths prefill is compiled for (ascending, ending at
                            max_prefill_length); a prompt is right-padded to the next bucket.
                            None = `default_prefill_buckets(max_prefill_length)`.
    truncate_long_prompts:  keep the last max_prefill_length tokens of a longer prompt
                            instead of raising.
    prefill_batch_sizes:    how many prompts of one bucket the in-process loop may prefill in
                            one call (ascending, starting at 1); each size is one more compile
                            per bucket. The JetStream API path always prefills one prompt.
    top_logprobs:           how many of the most likely tokens' raw log-probs (the model's log-softmax,
                            before temperature and top-k/top-p) each generate step reports per slot, with
                            the raw log-prob of the token drawn; 0 reports none (rollouts for training need
                            only the behaviour log-prob). The OpenAI-compatible server asks for
                            MAX_TOP_LOGPROBS.
    """

    max_concurrent_decodes: int
    max_prefill_length: int
    max_decode_length: int
    prefill_buckets: tuple[int, ...] | None
    truncate_long_prompts: bool
    prefill_batch_sizes: tuple[int, ...]
    top_logprobs: int

    def __post_init__(self) -> None:
        for name in ("max_concurrent_decodes", "max_prefill_length", "max_decode_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.{name}={value!r} must be an int >= 1")
        if self.prefill_buckets is None:
            object.__setattr__(self, "prefill_buckets", default_prefill_buckets(self.max_prefill_length))
        buckets = tuple(self.prefill_buckets)
        object.__setattr__(self, "prefill_buckets", buckets)
        if (
            not buckets
            or any(not isinstance(b, int) or b < 1 for b in buckets)
            or list(buckets) != sorted(set(buckets))
            or buckets[-1] != self.max_prefill_length
        ):
            raise ValueError(
                f"rollout.prefill_buckets={buckets!r} must be strictly increasing positive ints "
                f"ending at max_prefill_length={self.max_prefill_length}"
            )

        sizes = tuple(self.prefill_batch_sizes)
        object.__setattr__(self, "prefill_batch_sizes", sizes)
        if (
            not sizes
            or sizes[0] != 1
            or any(isinstance(b, bool) or not isinstance(b, int) for b in sizes)
            or list(sizes) != sorted(set(sizes))
        ):
            raise ValueError(f"rollout.prefill_batch_sizes={sizes!r} must be strictly increasing ints starting at 1")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) or self.top_logprobs < 0:
            raise ValueError(f"top_logprobs={self.top_logprobs!r} must be an int >= 0")

    @property
    def cache_length(self) -> int:
        """KV-cache positions per slot."""
        return self.max_prefill_length + self.max_decode_length

    def bucket_for(self, prompt_length: int) -> int:
        """Smallest bucket that holds `prompt_length` tokens (ValueError when none does)."""
        if prompt_length < 1:
            raise ValueError(f"prompt has {prompt_length} tokens; an empty prompt cannot be generated from")
        for bucket in self.prefill_buckets:
            if prompt_length <= bucket:
                return bucket
        raise ValueError(
            f"prompt has {prompt_length} tokens, more than max_prefill_length={self.max_prefill_length} "
            "(set truncate_long_prompts=True to keep the last tokens instead)"
        )


def engine_config_for(config: RunConfig, agent: str) -> EngineConfig:
    """``agent``'s engine shapes in a run: its own decode slots (agents.<name>.decode_slots, 0 =
    rollout.decode_slots), prompts up to rollout.max_prompt_length tokens (prefill buckets: powers of two up to
    it; a longer prompt is an error), at most rollout.max_response_length new tokens, and one prompt per prefill
    call. Reads only those fields."""
    return EngineConfig(max_concurrent_decodes=config.agents[agent].decode_slots or config.rollout.decode_slots,
                        max_prefill_length=config.rollout.max_prompt_length,
                        max_decode_length=config.rollout.max_response_length,
                        prefill_buckets=None, truncate_long_prompts=False, prefill_batch_sizes=(1,),
                        top_logprobs=0)
