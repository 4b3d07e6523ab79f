"""CharTokenizer and HFTokenizer behind the Tokenizer protocol."""

import json
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexmarl_jax.models.presets import get_preset
from flexmarl_jax.models.tokenizer import CharTokenizer, HFTokenizer, Tokenizer


def test_char_tokenizer_ids_are_fixed_and_cover_the_tiny_vocab():
    tok = CharTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.vocab_size == 104 == get_preset("tiny").vocab_size == get_preset("small").vocab_size
    assert tok.encode("0a A\n") == [1, 4, 14, 98, 40, 100]
    assert tok.encode("~", add_bos=False) == [4 + string.printable.index("~")]
    ids = tok.encode(string.printable, add_bos=False)
    assert sorted(ids) == list(range(4, 104))


@given(st.text(alphabet=string.printable, max_size=60))
def test_char_tokenizer_round_trips_printable_text(text):
    tok = CharTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and len(ids) == len(text) + 1
    assert tok.decode(ids + [tok.eos_id, tok.pad_id, tok.pad_id]) == text


def test_char_tokenizer_unknown_and_out_of_range_ids():
    tok = CharTokenizer()
    assert tok.encode("é€", add_bos=False) == [tok.unk_id, tok.unk_id]
    assert tok.decode([tok.unk_id]) == "\ufffd"
    assert tok.decode([200, -1, 4]) == "0"  # ids a sampler may produce outside the vocab are dropped


def _write_hf_tokenizer(directory, *, with_bos: bool):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "hello": 4, "world": 5, "agent": 6}
    raw = RawTokenizer(WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    raw.add_special_tokens(["<pad>", "<s>", "</s>"])
    raw.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "</s>", "pad_token": "<pad>", "bos_token": "<s>" if with_bos else None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_hf_tokenizer_reads_specials_and_round_trips(tmp_path):
    _write_hf_tokenizer(tmp_path, with_bos=True)
    tok = HFTokenizer(tmp_path)
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (7, 1, 2, 0)
    assert tok.encode("hello agent world") == [1, 4, 6, 5]
    assert tok.decode([1, 4, 6, 5, 2, 0]) == "hello agent world"
    assert HFTokenizer(tmp_path / "tokenizer.json").encode("world", add_bos=False) == [5]


def test_hf_tokenizer_without_bos_adds_nothing(tmp_path):
    _write_hf_tokenizer(tmp_path, with_bos=False)
    tok = HFTokenizer(tmp_path)
    assert tok.bos_id is None
    assert tok.encode("hello") == [4]


def test_hf_tokenizer_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        HFTokenizer(tmp_path)
