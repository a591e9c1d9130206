"""Incremental detokenizing: token ids in, text pieces out, in time linear in the output.

Decoding the whole output again for every token costs O(n^2) over a long answer. Instead each push decodes a short
window: the tokens since `prefix` (the token before the last piece, kept as context, since a tokenizer may drop a
leading space or merge bytes at the start of what it decodes) with and without the new ones, and the new piece is
the difference. This is the prefix / read offset scheme of vLLM's and TGI's incremental detokenizers.

A token may end inside a multi-byte character (the window then decodes to text ending in U+FFFD). Such a piece is
held back until a later token completes the character, for at most MAX_HELD tokens, so an invalid byte sequence
still streams. The pieces joined are the text of the tokens.

One class serves everything that turns a token stream into text: stop-string matching (tinyloop/stops.py), the
worker's streamed pieces, the CLI's printed answer and a stream continued on another worker.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

MAX_HELD = 4  # a UTF-8 character has at most 4 bytes


class Detokenizer:
    def __init__(self, codec: Any, tokens: Iterable[int] = ()):
        """`tokens`: output already produced (a continuation), decoded now so later pieces continue its text."""
        self.decode = codec.decode
        self.tokens: list[int] = []
        self.prefix = 0  # the window starts here: one piece back, as context
        self.read = 0  # tokens whose text is in self.text
        self.text = ""
        for token in tokens:
            self.push(token)

    def push(self, token: int) -> str:
        """Add a token; return the text it completes ("" while a character is unfinished)."""
        self.tokens.append(token)
        before = self.decode(self.tokens[self.prefix:self.read])
        now = self.decode(self.tokens[self.prefix:])
        if now.endswith("\ufffd") and len(self.tokens) - self.read < MAX_HELD:
            return ""
        piece = now[len(before):]
        self.text += piece
        self.prefix, self.read = self.read, len(self.tokens)
        return piece

    def flush(self) -> str:
        """The text of tokens still held back (the output ended inside a character)."""
        if self.read == len(self.tokens):
            return ""
        piece = self.decode(self.tokens[self.prefix:])[len(self.decode(self.tokens[self.prefix:self.read])):]
        self.text += piece
        self.prefix, self.read = self.read, len(self.tokens)
        return piece
