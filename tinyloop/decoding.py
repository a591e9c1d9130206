"""Beam search: several hypotheses of one request, each a Sequence (tinyloop/engine) in a lane of one cache.

generate_stream dispatches here when beam_size > 1.

Beam search keeps `beam_size` hypotheses as lanes of one KV cache. Each step every live beam proposes its
top `beam_size` next tokens; the best `beam_size` (beam, token) pairs by total log-probability survive and
the cache lanes are reordered so each child inherits its parent's blocks (shared, copied on write). A child that ends (EOS, a stop
sequence, a complete grammar, max_tokens) moves to the finished list and keeps its slot, so the live beam
shrinks and the search ends when no live beam is left; with beam_size = 1 this is exactly greedy decode.

Scores: `logprob` is the sum of the model's log-probabilities of the scored tokens (after the repetition
penalty; EOS is scored when the hypothesis ended on it). Finished hypotheses are ranked by the
length-normalised `score = logprob / n ** LENGTH_PENALTY`, n = the number of scored tokens, so a short
hypothesis does not win only because it adds fewer negative terms.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .engine.calls import checked, lanes
from .engine.runner import Runner
from .engine.sequence import Sequence
from .errors import ConfigError
from .types import GenerateConfig, GenerateResult, GenerateStats, OnToken

LENGTH_PENALTY = 1.0


@dataclass
class Hypothesis:
    """One entry of GenerateResult.n_best."""
    tokens: list[int]
    text: str
    logprob: float
    score: float
    stop_reason: str


def length_normalised(logprob: float, n: int) -> float:
    return logprob / max(n, 1) ** LENGTH_PENALTY


def beam_search(model, prompt, cfg: GenerateConfig, on_token: OnToken | None = None) -> GenerateResult:
    """Best hypothesis as tokens/text/stats, and the n-best list (best first) in result.n_best."""
    cfg = checked(model, cfg, "single")
    if cfg.temperature != 0 or cfg.top_k != 0 or cfg.top_p != 1.0:
        raise ConfigError("beam search is deterministic: GenerateConfig.temperature must be 0 and top_k/top_p off "
                          f"when beam_size > 1 (got temperature={cfg.temperature}, top_k={cfg.top_k}, top_p={cfg.top_p})")
    with model.busy():
        ids = model.encode_prompt(prompt)
        with lanes(model, [ids], [cfg], n_lanes=cfg.beam_size, what="beam hypothesis") as cache:
            return _beam_search(model, ids, cfg, cache, on_token)


@torch.inference_mode()
def _beam_search(model, ids: list[int], cfg: GenerateConfig, cache, on_token: OnToken | None) -> GenerateResult:
    t0 = time.perf_counter()
    K = cfg.beam_size
    root = Sequence(model, ids, cfg, None, t0)
    runner = Runner(model, cache, root.loops, cfg.early_exit_threshold)
    logits = runner.first_logits(root, 0, 0, None)[None]  # [1, V]: one live beam, the prompt
    stats = GenerateStats(prompt_tokens=len(ids), cache_mode=model.cache_mode, prefill_ms=root.stats.prefill_ms,
                          prefix_hit_tokens=root.stats.prefix_hit_tokens)
    loop_counts = list(root.loop_counts)
    t_prefill = time.perf_counter()
    beams: list[tuple[Sequence, float]] = [(root, 0.0)]  # (hypothesis, total log-probability)
    finished: list[tuple[Sequence, float]] = []
    emitted, cancelled, pos = 0, False, len(ids)

    def emit_upto(tokens: list[int], n: int) -> bool:
        nonlocal emitted
        while emitted < n:
            if emitted == 0:
                stats.first_token_ms = (time.perf_counter() - t0) * 1000
            keep = on_token(tokens[emitted], emitted) if on_token is not None else True
            emitted += 1
            if keep is False:
                return False
        return True

    for _ in range(cfg.max_tokens):
        cands = []  # (total logprob, beam index, token)
        for b, (beam, total) in enumerate(beams):
            logp = torch.log_softmax(beam.penalised(logits[b]).float(), dim=-1)
            if beam.grammar is not None:
                logp = beam.grammar.mask(logp)
            top = torch.topk(logp, min(K, logp.shape[-1]))
            cands += [(total + lp, b, t) for lp, t in zip(top.values.tolist(), top.indices.tolist())
                      if lp != float("-inf")]
        cands.sort(key=lambda c: -c[0])
        live, parents = [], []
        for total, b, t in cands[:K]:
            child = beams[b][0].fork()
            if child.take(t):  # the Sequence's bookkeeping: grammar, EOS, stop sequences, max_tokens
                live.append((child, total))
                parents.append(b)
            else:
                finished.append((child, total))
        # Stream what every hypothesis that can still win agrees on (released tokens only: no stop-sequence parts).
        if on_token is not None:
            agreed = [bm.matcher.tokens[:bm.matcher.emitted] for bm, _ in live] + [bm.tokens for bm, _ in finished]
            n = common_prefix(agreed)
            if n > emitted and not emit_upto(agreed[0], n):
                cancelled = True
                break
        if not live:
            break
        beams = live
        cache.reorder_lanes(torch.tensor(parents))
        logits, used = runner.decode([bm.token for bm, _ in beams], [pos] * len(beams))
        loop_counts += used
        pos += 1

    ranked = sorted((to_hypothesis(bm, lp) for bm, lp in finished), key=lambda h: -h.score)[:K]
    if cancelled:
        best_tokens, reason, text = agreed[0][:emitted], "cancelled", None
    else:
        best = ranked[0]
        best_tokens, reason, text = best.tokens, best.stop_reason, best.text
        if not emit_upto(best_tokens, len(best_tokens)):
            best_tokens, reason, text = best_tokens[:emitted], "cancelled", None
    t_end = time.perf_counter()
    stats.generated_tokens, stats.stop_reason = len(best_tokens), reason
    stats.decode_ms, stats.total_ms = (t_end - t_prefill) * 1000, (t_end - t0) * 1000
    stats.loops_mean = sum(loop_counts) / len(loop_counts)
    text = model.codec.decode(best_tokens) if text is None else text
    return GenerateResult(best_tokens, text, stats, n_best=ranked if not cancelled else [])


def to_hypothesis(seq: Sequence, logprob: float) -> Hypothesis:
    """A finished hypothesis; its length (for the normalised score) counts every token chosen, EOS included."""
    return Hypothesis(seq.tokens, seq.text, logprob, length_normalised(logprob, seq.count), seq.stop_reason)


def common_prefix(seqs: list[list[int]]) -> int:
    if not seqs:
        return 0
    n = min(len(s) for s in seqs)
    for j in range(n):
        t = seqs[0][j]
        if any(s[j] != t for s in seqs):
            return j
    return n
