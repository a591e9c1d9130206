"""Stop sequences for streamed output.

String stops match the decoded text, also across token boundaries; token stops match the token tail.
A token that might be the start of a stop sequence is held back from the stream until that is decided,
so a caller never receives part of a stop sequence.
"""
from __future__ import annotations


class StopMatcher:
    def __init__(self, decode, stop_sequences):
        self.decode = decode
        self.strings = [s for s in stop_sequences if isinstance(s, str)]
        self.token_seqs = [list(s) for s in stop_sequences if not isinstance(s, str)]
        self.tokens: list[int] = []
        self.text_len = [0]  # text_len[m] = len(decode(tokens[:m]))
        self.text = ""
        self.emitted = 0

    def push(self, token: int) -> tuple[list[int], bool]:
        """Add a token; return the tokens now safe to stream and whether a stop sequence completed."""
        self.tokens.append(token)
        if self.strings:
            self.text = self.decode(self.tokens)
        self.text_len.append(len(self.text))
        for seq in self.token_seqs:
            if self.tokens[-len(seq):] == seq:
                return self._cut_tokens(len(self.tokens) - len(seq)), True
        hits = [i for i in (self.text.find(s) for s in self.strings) if i >= 0]
        if hits:
            return self._cut_text(min(hits)), True
        return self._release(self._safe_tokens()), False

    def flush(self) -> list[int]:
        return self._release(len(self.tokens))

    def _safe_tokens(self) -> int:
        """How many leading tokens cannot be part of a stop sequence that is still being completed."""
        safe = len(self.tokens)
        for seq in self.token_seqs:
            for n in range(min(len(seq) - 1, len(self.tokens)), 0, -1):
                if self.tokens[-n:] == seq[:n]:
                    safe = min(safe, len(self.tokens) - n)
                    break
        if self.strings:
            held_from = len(self.text)
            for s in self.strings:
                for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:n]):
                        held_from = min(held_from, len(self.text) - n)
                        break
            safe = min(safe, max(m for m in range(len(self.tokens) + 1) if self.text_len[m] <= held_from))
        return safe

    def _release(self, upto: int) -> list[int]:
        out = self.tokens[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return out

    def _cut_tokens(self, keep: int) -> list[int]:
        out = self._release(keep)
        self.tokens = self.tokens[:keep]
        self.text = self.decode(self.tokens) if self.strings else ""
        return out

    def _cut_text(self, at: int) -> list[int]:
        keep = max(m for m in range(len(self.tokens) + 1) if self.text_len[m] <= at)
        out = self._release(keep)
        self.tokens, self.text = self.tokens[:keep], self.text[:at]
        return out
