"""The text of one generated choice as its tokens arrive, with OpenAI's stop-string semantics.

The engine ends a sequence at the token that completes a stop string (rollout/loop.py) and keeps that token
whole; what a client sees is cut before the stop string, even one that ends inside a token. While streaming,
text that might still turn out to be the start of a stop string is held back, and so is a trailing partial
UTF-8 character (decoded as U+FFFD until its last byte arrives):

    text = ChoiceText(tokenizer, stop=("\\n\\n",), stop_ids={eos})
    released = text.add([101, 102])   # the new text safe to send now ("" while a stop string may be starting)
    rest = text.finish()              # the end of the choice: whatever was held back and is not a stop string

Token offsets (`token_end`) let the caller attach each token's log-probs to the text it released.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

REPLACEMENT = "\ufffd"  # what a decoder writes for the bytes of a character not yet complete


class ChoiceText:
    """One choice's token ids, the text released so far, and where its first stop string starts."""

    def __init__(self, tokenizer: Any, *, stop: Sequence[str], stop_ids: Iterable[int]):
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._stop_ids = frozenset(stop_ids)
        self.token_ids: list[int] = []
        self.token_end: list[int] = []  # len(decode(tokens[:i + 1])): where token i's text ends
        self.released = ""
        self.stopped = False  # a stop string was found: the text ends before it, nothing more is released
        self._full = ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Takes the choice's next tokens; returns the text they release (may be "")."""
        if self.stopped:
            return ""
        for token in token_ids:
            self.token_ids.append(int(token))
            if int(token) in self._stop_ids:  # an end-of-sequence id has no text (decode skips it)
                self.token_end.append(len(self._full))
                continue
            self._full = self._tokenizer.decode([t for t in self.token_ids if t not in self._stop_ids])
            self.token_end.append(len(self._full))
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            return self._release(cut)
        return self._release(self._safe_length())

    def finish(self) -> str:
        """The choice is over: releases what was held back (a partial stop string that never completed)."""
        if self.stopped:
            return ""
        return self._release(len(self._full))

    def released_tokens(self) -> int:
        """How many tokens' text lies wholly inside the released text (their log-probs may go out with it); after
        a stop string, every token whose text starts before the cut."""
        released = len(self.released)
        if self.stopped:
            starts = [0, *self.token_end[:-1]]
            return sum(1 for start in starts if start < released)
        return sum(1 for end in self.token_end if end <= released)

    def _first_stop(self) -> int | None:
        # Only text after what was already released can hold a new stop string's start (what was released
        # held none), but a stop string may begin inside the held-back tail: search from there.
        longest = max((len(s) for s in self._stop), default=0)
        start = max(0, len(self.released) - longest)
        found = [index for index in (self._full.find(s, start) for s in self._stop) if index >= 0]
        return min(found) if found else None

    def _safe_length(self) -> int:
        """The length of text that no later token can turn into (part of) a stop string, nor change."""
        safe = len(self._full)
        while safe > 0 and self._full[safe - 1] == REPLACEMENT:
            safe -= 1
        head = self._full[:safe]
        held = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(head)), held, -1):
                if head.endswith(stop[:size]):
                    held = size
                    break
        return safe - held

    def _release(self, length: int) -> str:
        if length <= len(self.released):
            return ""
        piece = self._full[len(self.released):length]
        self.released += piece
        return piece
