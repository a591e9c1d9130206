"""Scoring: the logits of every position of a token sequence, and log-probabilities built on them.

`score` runs one full causal forward of the model's network (no KV cache, no early exit, no
sampling settings) at a loop count: what log-likelihood evaluation needs (scripts/lmeval_adapter.py).
A generation's own log-probabilities (GenerateConfig.logprobs, prompt_logprobs; the service's
`logprobs` and `echo`) come from the engine's steps instead, with no second forward.

What the numbers are: log_softmax of the raw model logits at `loops` (full depth for every
token), in fp32. Temperature, top-k/top-p, repetition penalty and grammar masks shape which
token generation picks but are not applied here; early exit, if a request used it, changes
the generated tokens but not their scores.
"""
from __future__ import annotations

import torch

from .errors import ConfigError
from .fields import is_int


def _check(model, tokens, loops: int | None) -> tuple[list[int], int]:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    if not isinstance(tokens, (list, tuple)) or not all(is_int(t) for t in tokens):
        raise ConfigError("score: tokens must be a list of token ids (ints)")
    if not tokens:
        raise ConfigError("score: tokens is empty")
    vocab = model.cfg.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"score: token id(s) {bad[:5]} outside the vocabulary 0..{vocab - 1}")
    if len(tokens) > model.max_seq_len:
        raise ConfigError(f"score: {len(tokens)} tokens exceed the model's max_seq_len {model.max_seq_len}")
    loops = model.cfg.default_loops if loops is None else loops
    if not is_int(loops) or not 1 <= loops <= model.cfg.max_loops:
        raise ConfigError(f"score: loops must be an integer in 1..{model.cfg.max_loops}, got {loops!r}")
    return list(tokens), loops


def score(model, tokens: list[int], loops: int | None = None) -> torch.Tensor:
    """Logits of every position, shape [len(tokens), vocab], fp32: row i predicts token i + 1.

    `loops` defaults to the model's default loop count. Raises ConfigError on bad input and
    BusyError when another thread is using the model.
    """
    ids, loops = _check(model, tokens, loops)
    with model.busy(), torch.inference_mode():
        x = torch.tensor([ids], device=model.device)
        return model.net(x, loops)[0].float()


def token_logprobs(model, context: list[int], targets: list[int], loops: int | None = None,
                   top: int = 0, score_context: bool = False) -> dict:
    """Log-probabilities of `targets` following `context` (plain lists, ready for the wire).

    Returns {"tokens", "text", "logprobs", "top"} for the targets and, with score_context, the
    same for the context tokens under "context" (its first token has no prediction: logprob and
    top None). `top` holds per position the `top` most likely [token id, text, logprob], best first.
    """
    seq = list(context) + list(targets)
    if len(seq) < 2:  # nothing predicts a lone first token; score it as an empty sequence
        logp = torch.empty(0, model.cfg.vocab_size)
    else:
        logp = torch.log_softmax(score(model, seq[:-1], loops), dim=-1)  # row i predicts seq[i + 1]

    def piece(token: int) -> str:  # one token decoded alone (a partial UTF-8 character shows as U+FFFD)
        return model.codec.decode([token])

    def part(start: int, stop: int) -> dict:
        ids = seq[start:stop]
        rows = range(start - 1, stop - 1)
        values = [None if r < 0 else float(logp[r, t]) for r, t in zip(rows, ids)]
        alts: list[list[list[object]] | None] = []
        for r in rows:
            if r < 0 or top <= 0:
                alts.append(None if r < 0 else [])
                continue
            v, i = torch.topk(logp[r], min(top, logp.shape[-1]))
            alts.append([[int(a), piece(int(a)), float(b)] for a, b in zip(i, v)])
        return {"tokens": ids, "text": [piece(t) for t in ids], "logprobs": values, "top": alts}

    out = part(len(context), len(seq))
    if score_context:
        out["context"] = part(0, len(context))
    return out
