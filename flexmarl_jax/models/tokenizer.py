"""Tokenizers behind one interface: a built-in character tokenizer and HF `tokenizers`."""

from __future__ import annotations

import hashlib
import json
import os
import string
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer as _HFTok

from flexmarl_jax.models.chat_template import TOKENIZER_CONFIG_FILE, ChatTemplate, find_chat_template


@runtime_checkable
class Tokenizer(Protocol):
    """What rollout and workflows need from a tokenizer.

    `bos_id` may be None (e.g. Qwen). `stop_ids` holds every id that ends a sequence, `eos_id` first.
    `chat_template` is the checkpoint's chat template, None for models without one.
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...]
    chat_template: ChatTemplate | None

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
        self.stop_ids = (self.EOS,)
        self.chat_template = None

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


# Named special tokens a chat template may refer to (those transformers passes to it).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Files whose `eos_token_id` (an int or a list) names ids that end generation, in the order they are read.
_EOS_ID_FILES = ("generation_config.json", "config.json")


class HFTokenizer:
    """A HF `tokenizers` tokenizer from ``tokenizer.json`` (a file, or a directory holding it).

    Special tokens come from ``tokenizer_config.json`` (``bos_token``/``eos_token``/``pad_token``) next
    to it. `stop_ids` is its ``eos_token`` followed by every ``eos_token_id`` of ``generation_config.json``
    and ``config.json`` (an int or a list: chat models stop on several ids, e.g. end-of-turn and
    end-of-text); `eos_id` is the first of them. Without ``tokenizer_config.json`` the BOS and PAD ids also
    come from those files. ``tokenizer_config.json`` decides whether a BOS is added: a model whose
    ``bos_token`` is null (Qwen) has ``bos_id = None`` and `encode` adds nothing, even when its
    ``config.json`` names a ``bos_token_id``; so does one whose ``add_bos_token`` is false (SmolLM2 names
    ``<|im_start|>`` as its ``bos_token`` but its chat template, not the tokenizer, writes it).
    """

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        directory, file = (
            (path, os.path.join(path, "tokenizer.json"))
            if os.path.isdir(path)
            else (os.path.dirname(path), path)
        )
        if not os.path.exists(file):
            raise FileNotFoundError(f"no tokenizer.json at {file!r}")
        self._tok = _HFTok.from_file(file)
        self.directory = directory
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

        tokenizer_config = _read_json(os.path.join(directory, TOKENIZER_CONFIG_FILE))
        special_texts = {name: _token_text(tokenizer_config.get(name)) for name in _SPECIAL_TOKEN_NAMES}
        special_texts = {name: text for name, text in special_texts.items() if text is not None}
        named_ids = {name: self._tok.token_to_id(text) for name, text in special_texts.items()}
        model_ids = _read_model_token_ids(directory)

        eos_first = [named_ids["eos_token"]] if named_ids.get("eos_token") is not None else []
        self.stop_ids = tuple(dict.fromkeys(eos_first + model_ids["eos"]))  # ordered, without repeats
        if not self.stop_ids:
            raise ValueError(
                f"tokenizer at {path!r} has no EOS token (looked in tokenizer_config.json, "
                "generation_config.json, config.json)"
            )
        self.eos_id = self.stop_ids[0]
        if tokenizer_config:
            self.bos_id = None if tokenizer_config.get("add_bos_token") is False else named_ids.get("bos_token")
            pad = named_ids.get("pad_token")
        else:
            self.bos_id = next(iter(model_ids["bos"]), None)
            pad = next(iter(model_ids["pad"]), None)
        self.pad_id = pad if pad is not None else self.eos_id  # many chat models pad with EOS

        found = find_chat_template(directory)
        self.chat_template = (
            None if found is None else ChatTemplate(found[0], special_tokens=special_texts, origin=found[1])
        )
        # Two agents' tokenizers are interchangeable (a rollout instance may move between them) only if they
        # map text to the same ids and stop on the same ones: the vocabulary file's digest and the special ids.
        with open(file, "rb") as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()[:16]
        self.identity = f"HFTokenizer:{digest}:{self.bos_id}:{self.stop_ids}:{self.pad_id}"

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else list(ids)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def max_token_id(self) -> int:
        """The largest id the tokenizer can produce (special tokens included)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values())

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The checkpoint's chat template applied to `messages`, as text.

        Encode the result with ``add_bos=False``: templates that want a BOS write ``bos_token`` themselves.
        """
        if self.chat_template is None:
            raise ValueError(
                f"{self.directory!r} has no chat template (neither chat_template.jinja nor a "
                "'chat_template' entry in tokenizer_config.json)"
            )
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(entry) -> str | None:
    """A tokenizer_config special token: a string, or an AddedToken dict with its text in "content"."""
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def _read_model_token_ids(directory: str) -> dict[str, list[int]]:
    """{"bos"|"eos"|"pad": ids} from generation_config.json then config.json (`*_token_id`, int or list)."""
    found: dict[str, list[int]] = {"bos": [], "eos": [], "pad": []}
    for name in _EOS_ID_FILES:
        config = _read_json(os.path.join(directory, name))
        for kind, ids in found.items():
            value = config.get(f"{kind}_token_id")
            values = value if isinstance(value, list) else [value]
            ids.extend(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return found
