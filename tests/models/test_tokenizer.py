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


def test_char_tokenizer_stops_on_eos_and_has_no_chat_template():
    tok = CharTokenizer()
    assert tok.stop_ids == (tok.eos_id,) == (2,)
    assert tok.chat_template is None


def test_hf_tokenizer_stop_ids_hold_every_eos_in_order(tmp_path):
    """tokenizer_config's eos_token first, then generation_config.json's list, then config.json's ids, once each."""
    _write_hf_tokenizer(tmp_path, with_bos=False)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 2, 4]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [6, 5], "bos_token_id": 1}))
    tok = HFTokenizer(tmp_path)
    assert tok.stop_ids == (2, 5, 4, 6) and tok.eos_id == 2
    # Qwen's case: config.json names a bos_token_id, tokenizer_config.json's bos_token is null: no BOS added
    assert tok.bos_id is None and tok.encode("hello") == [4]


def test_hf_tokenizer_without_tokenizer_config_takes_ids_from_the_model_configs(tmp_path):
    _write_hf_tokenizer(tmp_path, with_bos=True)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 0}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 6], "bos_token_id": 1}))
    tok = HFTokenizer(tmp_path)
    assert (tok.stop_ids, tok.eos_id, tok.bos_id, tok.pad_id) == ((2, 6), 2, 1, 0)
    assert tok.encode("agent") == [1, 6]


def test_hf_tokenizer_without_eos_or_template_says_so(tmp_path):
    _write_hf_tokenizer(tmp_path, with_bos=False)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    with pytest.raises(ValueError, match="has no EOS token"):
        HFTokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    tok = HFTokenizer(tmp_path)
    assert tok.stop_ids == (2,) and tok.chat_template is None
    with pytest.raises(ValueError, match="has no chat template"):
        tok.render_chat([{"role": "user", "content": "hello"}])


def test_hf_tokenizer_renders_its_checkpoints_chat_template(tmp_path):
    _write_hf_tokenizer(tmp_path, with_bos=True)
    template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    (tmp_path / "chat_template.jinja").write_text(template + "{% if add_generation_prompt %}>{% endif %}")
    tok = HFTokenizer(tmp_path)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    assert tok.render_chat(messages) == "<s>hello</s>world</s>>"
    assert tok.render_chat(messages, add_generation_prompt=False) == "<s>hello</s>world</s>"
    assert tok.encode(tok.render_chat(messages, add_generation_prompt=False), add_bos=False) == [1, 4, 2, 5, 2]
