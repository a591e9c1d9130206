"""Continuing a generation after output that was already delivered (the service's stream continuation).

When a worker dies mid-stream, the service re-runs the request on another worker as a continuation:
prompt' = prompt ids + the tokens already delivered, max_tokens' = max_tokens - len(delivered), the same
loops, sampling settings and stop sequences, and the grammar advanced over the delivered tokens. For
greedy decode without early exit that reproduces the undisturbed run exactly (prefill of prompt' builds
the same cache the step-by-step decode built; tests/test_chaos.py checks it end to end).

The one thing the runtime cannot express by itself is a grammar that starts part-way through its output.
GrammarPrefix is that value: put it in GenerateConfig.grammar and the grammar state of the call starts
after `tokens` (tinyloop/grammar.py, GrammarState.for_model, advances the matcher over them).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GrammarPrefix:
    """A GenerateConfig.grammar value: `grammar` (any accepted form), with `tokens` already generated under it.

    Contract: decode under GrammarPrefix(g, t) masks and completes exactly as decode under g would after
    having produced t; t must be a token sequence g accepts (otherwise the call fails with TinyLoopError)."""

    grammar: object
    tokens: tuple[int, ...]
