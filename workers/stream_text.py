"""Streamed text: token ids in, text pieces out (one per token, held back inside a UTF-8 character)."""

from __future__ import annotations

from typing import Any


class StreamText:
    """Turns a token stream into text pieces whose concatenation is the decoded text.

    A token may end inside a multi-byte character (the decoded text then ends in U+FFFD);
    such a piece is held back until a later token completes the character, but for at
    most MAX_HELD tokens, so an invalid byte sequence still streams.
    """

    MAX_HELD = 4  # a UTF-8 character has at most 4 bytes

    def __init__(self, codec: Any):
        self.codec = codec
        self.tokens: list[int] = []
        self.sent = ""
        self.held = 0

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.codec.decode(self.tokens)
        self.held += 1
        if text.endswith("\ufffd") and self.held < self.MAX_HELD:
            return ""
        piece, self.sent, self.held = text[len(self.sent):], text, 0
        return piece
