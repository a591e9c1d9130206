"""Stop sequences for streamed output.

String stops match the decoded text, also across token boundaries; token stops match the token tail.
A token that might be the start of a stop sequence is held back from the stream until that is decided,
so a caller never receives part of a stop sequence. The text comes from the one incremental detokenizer
(tinyloop/detokenize.py) and only its tail is searched, so matching stays linear in the output's length.
"""
from __future__ import annotations

import copy
from bisect import bisect_right
from typing import Any

from .detokenize import Detokenizer


class StopMatcher:
    def __init__(self, codec: Any, stop_sequences):
        self.strings = [s for s in stop_sequences if isinstance(s, str)]
        self.token_seqs = [list(s) for s in stop_sequences if not isinstance(s, str)]
        self.detok = Detokenizer(codec) if self.strings else None  # text is needed only to match strings
        self.longest = max((len(s) for s in self.strings), default=0)
        self.tokens: list[int] = []
        self.text_len = [0]  # text_len[m]: characters of text known once m tokens are in (non-decreasing)
        self.text = ""
        self.emitted = 0

    def push(self, token: int, can_stop: bool = True) -> tuple[list[int], bool]:
        """Add a token; return the tokens now safe to stream and whether a stop sequence completed (never while not
        `can_stop`: before min_tokens)."""
        self.tokens.append(token)
        searched_to = len(self.text)
        if self.detok is not None:
            self.text += self.detok.push(token)
        self.text_len.append(len(self.text))
        if not can_stop:
            return self._release(self._safe_tokens()), False
        for seq in self.token_seqs:
            if self.tokens[-len(seq):] == seq:
                return self._cut_tokens(len(self.tokens) - len(seq)), True
        start = max(0, searched_to - self.longest + 1)  # a stop that ends in the new text starts after this
        hits = [i for i in (self.text.find(s, start) for s in self.strings) if i >= 0]
        if hits:
            return self._cut_text(min(hits)), True
        return self._release(self._safe_tokens()), False

    def flush(self) -> list[int]:
        return self._release(len(self.tokens))

    def fork(self) -> "StopMatcher":
        """An independent copy (a beam hypothesis): the lists and the detokenizer's window are its own."""
        child = copy.copy(self)
        child.tokens, child.text_len = list(self.tokens), list(self.text_len)
        if self.detok is not None:
            child.detok = copy.copy(self.detok)
            child.detok.tokens = list(self.detok.tokens)
        return child

    def _safe_tokens(self) -> int:
        """How many leading tokens cannot be part of a stop sequence that is still being completed."""
        safe = len(self.tokens)
        for seq in self.token_seqs:
            for n in range(min(len(seq) - 1, len(self.tokens)), 0, -1):
                if self.tokens[-n:] == seq[:n]:
                    safe = min(safe, len(self.tokens) - n)
                    break
        if self.strings:
            assert self.detok is not None  # (made for the strings)
            held_from = len(self.text)
            for s in self.strings:
                for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:n]):
                        held_from = min(held_from, len(self.text) - n)
                        break
            # tokens still held by the detokenizer (an unfinished character) are not safe either
            safe = min(safe, self._tokens_within(held_from), self.detok.read)
        return safe

    def _tokens_within(self, chars: int) -> int:
        """The most leading tokens whose text fits in the first `chars` characters."""
        return bisect_right(self.text_len, chars) - 1

    def _release(self, upto: int) -> list[int]:
        out = self.tokens[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return out

    def _cut_tokens(self, keep: int) -> list[int]:
        out = self._release(keep)
        self.tokens = self.tokens[:keep]
        self.text = self.text[:self.text_len[keep]]
        return out

    def _cut_text(self, at: int) -> list[int]:
        keep = self._tokens_within(at)
        out = self._release(keep)
        self.tokens, self.text = self.tokens[:keep], self.text[:at]
        return out
