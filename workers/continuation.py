"""Stream continuation on the worker: finish a request whose previous worker died after streaming part of it.

The broker sends the original request plus `delivered`, the token ids the client already holds. The worker
runs the same op on prompt ids + delivered with the remaining token budget (and the grammar advanced over
the delivered tokens, tinyloop/continuation.py), streams what follows at positions len(delivered).., and
replies with the whole answer, as if one worker had produced it.

Exact for greedy decode. Refused (error "worker_lost") where a continuation would not be exact: beam search
(the stream carries only the prefix all beams agree on) and early exit (a prefill runs every loop, so the
delivered tokens' cache would differ from the one the adaptive decode built).
"""

from __future__ import annotations

from typing import Any, Callable

from broker.protocol import Codes
from tinyloop.continuation import GrammarPrefix
from tinyloop.detokenize import Detokenizer
from workers.handles import EngineError

TokenSink = Callable[[int, int, str], None]


def run_continuation(engine: Any, handler: Callable[..., dict], params: dict, delivered: list[int],
                     on_token: TokenSink | None, should_stop: Callable[[], bool]) -> dict:
    """Run `handler` (one of the engine's generation ops) as the continuation of `delivered`."""
    model = engine.model
    cfg = engine.config(params)
    if cfg.beam_size > 1:
        raise EngineError(Codes.WORKER_LOST, "a beam search stream cannot be continued on another worker: "
                          "its streamed prefix does not determine the beams")
    if cfg.early_exit_threshold > 0 or model.cfg.exit_gate:
        raise EngineError(Codes.WORKER_LOST, "an early-exit stream cannot be continued exactly on another worker "
                          "(its delivered tokens were decoded at adaptive depth)")
    remaining = cfg.max_tokens - len(delivered)
    prompt_ids = model.encode_prompt(params["prompt"])
    text = Detokenizer(model.codec, delivered)  # primed with the delivered tokens, so text pieces continue seamlessly
    if remaining <= 0:  # everything was delivered, only the final reply was lost
        new = {"tokens": [], "text": "", "stats": {"stop_reason": "max_tokens", "generated_tokens": 0}}
    else:
        changed = {"prompt": prompt_ids + list(delivered), "max_tokens": remaining}
        if params.get("grammar") is not None:
            changed["grammar"] = GrammarPrefix(params["grammar"], tuple(delivered))
        sink = None
        if on_token is not None:
            sink = lambda token, pos, _piece: on_token(token, pos + len(delivered), text.push(token))  # noqa: E731
        new = handler({**params, **changed}, sink, should_stop)
    tokens = list(delivered) + list(new["tokens"])
    # A string stop sequence may end the text inside a token: keep whatever text the runtime had past its tokens.
    new_tokens_text = model.codec.decode(new["tokens"]) if new["tokens"] else ""
    tail = new["text"][len(new_tokens_text):] if new["text"].startswith(new_tokens_text) else ""
    stats = dict(new.get("stats") or {})
    stats.update(prompt_tokens=len(prompt_ids), generated_tokens=len(tokens), continued_after=len(delivered))
    return {**new, "tokens": tokens, "text": model.codec.decode(tokens) + tail, "stats": stats}
