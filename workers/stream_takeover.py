"""Stream continuation on the worker: finish a request whose previous worker died after streaming part of it.

The broker sends the original request plus `delivered`, the token ids the client already holds. The worker
runs the same op on prompt ids + delivered with the remaining token budget (and the grammar advanced over
the delivered tokens, tinyloop/stream_continuation.py), streams what follows at positions len(delivered).., and
replies with the whole answer, as if one worker had produced it. A continued generate, chat or pool request
joins the batch like any other; one with nothing left to generate is answered by `delivered_answer`.

Exact for greedy decode. Refused (error "worker_lost") where a continuation would not be exact: beam search
(the stream carries only the prefix all beams agree on) and early exit (a prefill runs every loop, so the
delivered tokens' cache would differ from the one the adaptive decode built).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from broker.protocol import Codes
from tinyloop.stream_continuation import GrammarPrefix
from tinyloop.detokenize import Detokenizer
from workers.handle_registry import EngineError


@dataclass
class Continuation:
    """What continuing after `delivered` changes about a request, and how its answer is put back together."""

    prompt_ids: list[int]
    delivered: list[int]
    max_tokens: int  # the request's budget, delivered tokens included
    text: Detokenizer  # primed with the delivered tokens, so streamed pieces continue their text

    def params(self, params: dict) -> dict:
        """The request to run: prompt ids + delivered, the remaining budget, the grammar advanced over them."""
        changed = {"prompt": self.prompt_ids + self.delivered, "max_tokens": self.max_tokens - len(self.delivered)}
        if params.get("grammar") is not None:
            changed["grammar"] = GrammarPrefix(params["grammar"], tuple(self.delivered))
        return {**params, **changed}

    def result(self, codec: Any, new: dict) -> dict:
        """The whole answer: the delivered tokens and what followed them."""
        tokens = self.delivered + list(new["tokens"])
        # A string stop sequence may end the text inside a token: keep whatever text the runtime had past its tokens.
        new_tokens_text = codec.decode(new["tokens"]) if new["tokens"] else ""
        tail = new["text"][len(new_tokens_text):] if new["text"].startswith(new_tokens_text) else ""
        stats = dict(new.get("stats") or {})
        stats.update(prompt_tokens=len(self.prompt_ids), generated_tokens=len(tokens), continued_after=len(self.delivered))
        return {**new, "tokens": tokens, "text": codec.decode(tokens) + tail, "stats": stats}


def continuation(engine: Any, params: dict, prompt_ids: list[int], delivered: list[int]) -> Continuation:
    """A Continuation of `delivered`, or EngineError(worker_lost) where continuing would not be exact."""
    cfg = engine.config(params)
    if cfg.beam_size > 1:
        raise EngineError(Codes.WORKER_LOST, "a beam search stream cannot be continued on another worker: "
                          "its streamed prefix does not determine the beams")
    if cfg.early_exit_threshold > 0 or engine.model.cfg.exit_gate:
        raise EngineError(Codes.WORKER_LOST, "an early-exit stream cannot be continued exactly on another worker "
                          "(its delivered tokens were decoded at adaptive depth)")
    return Continuation(prompt_ids, list(delivered), cfg.max_tokens, Detokenizer(engine.model.codec, delivered))


def delivered_answer(engine: Any, params: dict, delivered: list[int]) -> dict:
    """The answer of a stream whose every token was delivered before its worker died (only the final reply was
    lost): what was delivered, as the runtime would have answered it."""
    cont = continuation(engine, params, engine.model.encode_prompt(params["prompt"]), delivered)
    new = {"tokens": [], "text": "", "stats": {"stop_reason": "max_tokens", "generated_tokens": 0}}
    return cont.result(engine.model.codec, new)
