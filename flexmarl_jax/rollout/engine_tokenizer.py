"""What JetStream's Driver and our loop need of a tokenizer at the engine: `FlexTokenizer`, our `Tokenizer`
behind JetStream's tokenizer API, and `pad_prompt`, a prompt right-padded to its prefill bucket."""

from __future__ import annotations

from typing import Any

import numpy as np

from flexmarl_jax.rollout import engine_api
from flexmarl_jax.rollout.settings import EngineConfig


class FlexTokenizer(engine_api.Tokenizer):
    """Adapts our `Tokenizer` (models/tokenizer.py) to JetStream's tokenizer API for its Driver."""

    def __init__(self, tokenizer: Any, engine_config: EngineConfig):
        self._tokenizer = tokenizer
        self._engine_config = engine_config

    def encode(self, s: str, **kwargs):
        """Returns (padded tokens [bucket] np.int32, true_length); JetStream's pad kwargs are honoured."""
        ids = self._tokenizer.encode(s, add_bos=kwargs.get("is_bos", True))
        return pad_prompt(ids, self._engine_config, self.pad_id)

    def decode(self, token_ids: list[int], **kwargs) -> str:
        return self._tokenizer.decode(token_ids)

    @property
    def pad_id(self) -> int:
        return self._tokenizer.pad_id

    @property
    def eos_id(self) -> int:
        return self._tokenizer.eos_id

    @property
    def bos_id(self) -> int:
        return self._tokenizer.bos_id

    @property
    def stop_tokens(self) -> set[int]:
        """Every end-of-sequence id of the checkpoint (chat models list several)."""
        return set(getattr(self._tokenizer, "stop_ids", None) or (self.eos_id,))


def pad_prompt(ids, engine_config: EngineConfig, pad_id: int) -> tuple[np.ndarray, int]:
    """Right-pads prompt token ids to their bucket: returns ([bucket] int32, true_length).

    Raises ValueError for an empty prompt, and for one longer than max_prefill_length unless
    the config asks to truncate (then the last max_prefill_length tokens are kept).
    """
    ids = [int(t) for t in ids]
    if len(ids) > engine_config.max_prefill_length and engine_config.truncate_long_prompts:
        ids = ids[-engine_config.max_prefill_length :]
    bucket = engine_config.bucket_for(len(ids))
    padded = np.full((bucket,), pad_id, dtype=np.int32)
    padded[: len(ids)] = ids
    return padded, len(ids)
