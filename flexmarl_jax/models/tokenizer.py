"""Tokenizers behind one interface: a built-in character tokenizer and HF `tokenizers`."""

from __future__ import annotations

import json
import os
import string
from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """What rollout and workflows need from a tokenizer. `bos_id` may be None (e.g. Qwen)."""

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids) -> str: ...


class CharTokenizer:
    """Character-level tokenizer over `string.printable` with PAD/BOS/EOS/UNK specials.

    Ids are fixed: PAD=0, BOS=1, EOS=2, UNK=3, then the 100 printable ASCII characters in
    `string.printable` order (vocab_size 104). Characters outside that set encode to UNK, which
    decodes to U+FFFD; special ids and ids outside the vocabulary decode to nothing.
    """

    PAD, BOS, EOS, UNK = 0, 1, 2, 3
    _FIRST_CHAR_ID = 4
    _UNK_TEXT = "\ufffd"

    def __init__(self):
        self._chars = string.printable
        self._char_to_id = {c: i + self._FIRST_CHAR_ID for i, c in enumerate(self._chars)}
        self.vocab_size = self._FIRST_CHAR_ID + len(self._chars)
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = self.PAD, self.BOS, self.EOS, self.UNK

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [self._char_to_id.get(c, self.UNK) for c in text]
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.UNK:
                out.append(self._UNK_TEXT)
            elif self._FIRST_CHAR_ID <= i < self.vocab_size:
                out.append(self._chars[i - self._FIRST_CHAR_ID])
        return "".join(out)


class HFTokenizer:
    """A HF `tokenizers` tokenizer from ``tokenizer.json`` (a file, or a directory holding it).

    Special ids come from ``tokenizer_config.json`` (``bos_token``/``eos_token``/``pad_token``)
    when present next to it, else from ``config.json``/``generation_config.json`` ids. A model
    without a BOS token (Qwen) has ``bos_id = None`` and `encode` adds nothing.
    """

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer as _HFTok  # lazy: keeps `import flexmarl_jax.models` light

        path = os.fspath(path)
        directory, file = (
            (path, os.path.join(path, "tokenizer.json"))
            if os.path.isdir(path)
            else (os.path.dirname(path), path)
        )
        if not os.path.exists(file):
            raise FileNotFoundError(f"no tokenizer.json at {file!r}")
        self._tok = _HFTok.from_file(file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        specials = _read_special_ids(directory, self._tok)
        self.bos_id = specials.get("bos")
        eos = specials.get("eos")
        if eos is None:
            raise ValueError(
                f"tokenizer at {path!r} has no EOS token (looked in tokenizer_config.json, "
                "generation_config.json, config.json)"
            )
        self.eos_id = eos
        self.pad_id = specials.get("pad", eos)  # many chat models pad with EOS

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else list(ids)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _read_special_ids(directory: str, tok) -> dict[str, int]:
    found: dict[str, int] = {}
    tc_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(tc_path):
        with open(tc_path) as f:
            tc = json.load(f)
        for kind in ("bos", "eos", "pad"):
            token = tc.get(f"{kind}_token")
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str) and tok.token_to_id(token) is not None:
                found[kind] = tok.token_to_id(token)
    for name in ("generation_config.json", "config.json"):
        p = os.path.join(directory, name)
        if not os.path.exists(p):
            continue
        with open(p) as f:
            cfg = json.load(f)
        for kind in ("bos", "eos", "pad"):
            value = cfg.get(f"{kind}_token_id")
            if isinstance(value, list):
                value = value[0] if value else None
            if isinstance(value, int) and kind not in found:
                found[kind] = value
    return found
