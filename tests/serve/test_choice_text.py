"""OpenAI stop-string semantics on a choice's text (`serve/choice_text.py`): cut before the stop string, also
one that ends inside a token; hold back what may be the start of one, and a partial UTF-8 character."""

from __future__ import annotations

from flexmarl_jax.serve.choice_text import ChoiceText

EOS = 0


class PieceTokenizer:
    """Token i decodes to PIECES[i] (EOS to nothing); a piece of bytes decodes to U+FFFD until completed."""

    PIECES = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!\n", 6: "\n", 7: "\xe2", 8: "\x82\xac", 9: "ok"}

    def decode(self, ids) -> str:
        raw = "".join(self.PIECES.get(int(i), "") for i in ids if int(i) != EOS)
        return raw.encode("latin-1").decode("utf-8", errors="replace")


def _stream(tokens, stop=()) -> tuple[list[str], ChoiceText]:
    text = ChoiceText(PieceTokenizer(), stop=stop, stop_ids={EOS})
    pieces = [text.add([token]) for token in tokens]
    return pieces + [text.finish()], text


def test_without_stop_strings_every_token_releases_its_text():
    pieces, text = _stream([1, 2, 3, 4, EOS])
    assert pieces == ["Hel", "lo", " wor", "ld", "", ""] and text.released == "Hello world"
    assert text.released_tokens() == 5 and not text.stopped


def test_a_stop_string_ending_inside_a_token_cuts_the_text_before_it():
    pieces, text = _stream([1, 2, 3, 4], stop=("lo w",))
    assert "".join(pieces) == "Hel" and text.stopped
    assert text.released_tokens() == 1  # only "Hel" is text the answer keeps
    assert text.add([4]) == ""  # nothing after the stop


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot():
    pieces, text = _stream([1, 2, 5, 9], stop=("\n\n",))
    # "!\n" might be the start of "\n\n": the "\n" waits; "ok" shows it was not
    assert pieces[:4] == ["Hel", "lo", "!", "\nok"] and text.released == "Hello!\nok"
    pieces, text = _stream([1, 5, 6, 9], stop=("\n\n",))
    assert "".join(pieces) == "Hel!" and text.stopped


def test_a_partial_utf8_character_waits_for_its_last_byte():
    pieces, text = _stream([9, 7, 8])
    assert pieces[:3] == ["ok", "", "\u20ac"] and text.released == "ok\u20ac"


def test_a_held_back_prefix_is_released_when_the_choice_ends():
    pieces, text = _stream([1, 5], stop=("\n\n",))
    assert pieces == ["Hel", "!", "\n"] and text.released == "Hel!\n"
