"""Tokenizer files of an exported model, in the layout transformers' ``AutoTokenizer`` loads.

A checkpoint-directory agent keeps its own files (copied unchanged, chat template included). A preset agent
uses `CharTokenizer`, which has no file form, so `write_char_tokenizer` builds an equivalent `tokenizers`
tokenizer: a word-level vocabulary with one entry per character, a pre-tokenizer that splits the text into
characters, and CharTokenizer's own ids (read through its `encode`).

Token names are byte-level (GPT-2 style: " " is "Ġ", "\n" is "Ċ") and the pipeline includes the byte-level
step, because transformers 5 loads the tokenizer of a ``qwen2`` model (every preset is one) as its
``Qwen2Tokenizer``, which keeps only the vocabulary, merges and post-processor of tokenizer.json and
rebuilds the rest as Qwen's byte-level pipeline. With byte-level names both readings agree with
CharTokenizer on every text made of its characters (`string.printable`); on other characters the file
itself still gives CharTokenizer's UNK per character, while the rebuilt Qwen pipeline drops them (it has no
unknown token). docs/export.md says so.
"""

from __future__ import annotations

import json
import os
import shutil
import string

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as FastTokenizer

from flexmarl_jax.models.tokenizer import CharTokenizer

# Files of a HF checkpoint directory that describe its tokenizer and decoding defaults (the slow-tokenizer
# vocabularies too, so a tool that wants them finds them). Weights and config.json are written separately.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)

# CharTokenizer's special ids get these names. UNK is not a special token: it is the character CharTokenizer
# decodes it to (U+FFFD), so decoding with skip_special_tokens=True keeps it, as CharTokenizer.decode does.
_CHAR_SPECIAL_NAMES = {CharTokenizer.PAD: "<pad>", CharTokenizer.BOS: "<s>", CharTokenizer.EOS: "</s>"}
_CHAR_UNK_TEXT = "\ufffd"


def _byte_level(text: str) -> str:
    """``text`` as the byte-level pre-tokenizer spells it (each UTF-8 byte as one printable character)."""
    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    return "".join(piece for piece, _ in pieces)


def copy_tokenizer_files(source: str | os.PathLike, destination: str | os.PathLike) -> list[str]:
    """Copies every `TOKENIZER_FILES` entry present in ``source`` to ``destination``; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        path = os.path.join(os.fspath(source), name)
        if os.path.isfile(path):
            shutil.copyfile(path, os.path.join(os.fspath(destination), name))
            copied.append(name)
    return copied


def char_tokenizer_vocab(tokenizer: CharTokenizer) -> dict[str, int]:
    """{byte-level token: id} for all ``tokenizer.vocab_size`` ids: the specials, UNK, one entry per character."""
    vocab = {name: token_id for token_id, name in _CHAR_SPECIAL_NAMES.items()}
    vocab[_byte_level(_CHAR_UNK_TEXT)] = tokenizer.unk_id
    for character in string.printable:
        (token_id,) = tokenizer.encode(character, add_bos=False)
        vocab[_byte_level(character)] = token_id
    if sorted(vocab.values()) != list(range(tokenizer.vocab_size)):
        raise ValueError(f"CharTokenizer ids {sorted(vocab.values())} are not 0..{tokenizer.vocab_size - 1}; "
                         "the exported vocabulary would not match")
    return vocab


def write_char_tokenizer(directory: str | os.PathLike, tokenizer: CharTokenizer, *,
                         model_max_length: int) -> list[str]:
    """Writes ``tokenizer.json`` and ``tokenizer_config.json`` equivalent to ``tokenizer``; returns the names.

    With transformers: ``tok(text)["input_ids"] == tokenizer.encode(text)`` (the BOS comes from the
    post-processor, so ``add_special_tokens=False`` matches ``add_bos=False``) and
    ``tok.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids)`` (for every text under
    `tokenizers` and our `HFTokenizer`; for texts of `string.printable` characters under transformers 5, see
    the module docstring).
    """
    directory = os.fspath(directory)
    fast = FastTokenizer(models.WordLevel(char_tokenizer_vocab(tokenizer), unk_token=_byte_level(_CHAR_UNK_TEXT)))
    # One piece per character, whitespace included ([\s\S]: "." would skip newlines), then spelt byte-level: a
    # character outside the vocabulary is one unknown piece, so one UNK, as in CharTokenizer.
    fast.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    fast.decoder = decoders.ByteLevel()  # back to bytes, then UTF-8 text, with nothing between the tokens
    bos = _CHAR_SPECIAL_NAMES[tokenizer.bos_id]
    fast.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                        special_tokens=[(bos, tokenizer.bos_id)])
    fast.add_special_tokens([AddedToken(name, special=True, normalized=False)
                             for _, name in sorted(_CHAR_SPECIAL_NAMES.items())])
    fast.save(os.path.join(directory, "tokenizer.json"))

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": _CHAR_SPECIAL_NAMES[tokenizer.eos_id],
        "pad_token": _CHAR_SPECIAL_NAMES[tokenizer.pad_id],
        "unk_token": None,  # UNK is an ordinary token here (above); None also stops Qwen2Tokenizer adding its own
        # CharTokenizer reads "<s>" in a text as three characters: so must transformers (by default it
        # would match the special token's name in the text).
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,  # decoding must not touch spaces before punctuation
        "model_max_length": model_max_length,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as handle:
        json.dump(config, handle, indent=2)
    return ["tokenizer.json", "tokenizer_config.json"]
