"""The one incremental detokenizer (tinyloop/detokenize.py): its pieces join to the decoded text, a character split
across tokens streams whole, a continuation primes it, and each token costs a bounded window of decoding."""
from __future__ import annotations

import pytest

import tinyloop
from tinyloop.detokenize import Detokenizer
from tinyloop.stops import StopMatcher

TEXT = "def fibonacci(n):\n    # é 中文 🙂 and more\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"


class CountingCodec:
    """A codec that counts the token ids it is asked to decode."""

    def __init__(self, codec):
        self.codec, self.decoded = codec, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.codec.decode(ids)


@pytest.fixture(scope="module", params=[None, "tests/data/hf/ouro-tiny", "tests/data/hf/huginn-tiny"])
def codec(request):
    return tinyloop.load_model(request.param, 256).codec


def test_pieces_join_to_the_text_and_each_token_costs_a_bounded_window(codec):
    ids = codec.encode(TEXT * 20, special=False)
    counting = CountingCodec(codec)
    detok = Detokenizer(counting)
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) + detok.flush() == codec.decode(ids) == detok.text
    # linear, not quadratic: a window of a few tokens per push (decoding everything again would be ~len(ids)^2 / 2)
    assert counting.decoded <= 4 * 2 * len(ids)


def test_a_character_split_across_tokens_streams_whole(codec):
    ids = codec.encode("🙂", special=False)
    detok = Detokenizer(codec)
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) == "🙂" and all(p in ("", "🙂") for p in pieces)


def test_a_primed_detokenizer_continues_the_text(codec):
    ids = codec.encode(TEXT, special=False)
    half = len(ids) // 2
    primed = Detokenizer(codec, ids[:half])
    rest = "".join(primed.push(t) for t in ids[half:]) + primed.flush()
    assert codec.decode(ids[:half]) + rest == codec.decode(ids)


def test_stop_strings_match_across_tokens_with_the_incremental_text(codec):
    ids = codec.encode(TEXT * 3, special=False)
    matcher = StopMatcher(codec, ["else fib"])
    streamed = []
    for t in ids:
        ready, stopped = matcher.push(t)
        streamed += ready
        if stopped:
            break
    assert stopped and matcher.text == TEXT[:TEXT.index("else fib")]
    assert codec.decode(streamed) == matcher.text[:len(codec.decode(streamed))]  # nothing past the stop was streamed
