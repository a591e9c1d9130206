"""Single-request decoding beyond plain sampling: beam search and grammar-constrained decode.

generate_stream dispatches here when beam_size > 1 or a grammar is set.

Beam search keeps `beam_size` hypotheses as lanes of one KV cache. Each step every live beam proposes its
top `beam_size` next tokens; the best `beam_size` (beam, token) pairs by total log-probability survive and
the cache lanes are gathered so each child inherits its parent's K/V. A child that ends (EOS, a stop
sequence, a complete grammar, max_tokens) moves to the finished list and keeps its slot, so the live beam
shrinks and the search ends when no live beam is left; with beam_size = 1 this is exactly greedy decode.

Scores: `logprob` is the sum of the model's log-probabilities of the scored tokens (after the repetition
penalty; EOS is scored when the hypothesis ended on it). Finished hypotheses are ranked by the
length-normalised `score = logprob / n ** LENGTH_PENALTY`, n = the number of scored tokens, so a short
hypothesis does not win only because it adds fewer negative terms.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from .batch import decode_lanes
from .cache import KVCache
from .errors import ConfigError
from .generate import Decoder, GenerateConfig, GenerateResult, GenerateStats, OnToken, check_length
from .grammar import GrammarState
from .kernels.lean import decode_forward
from .modes import check_modes
from .runtime import Model
from .sampling import apply_repetition_penalty
from .stops import StopMatcher

LENGTH_PENALTY = 1.0


@dataclass
class Hypothesis:
    """One entry of GenerateResult.n_best."""
    tokens: list[int]
    text: str
    logprob: float
    score: float
    stop_reason: str


@dataclass
class Beam:
    tokens: list[int]  # every token chosen (the matcher's list is cut when a stop sequence completes)
    logprob: float
    matcher: StopMatcher
    grammar: GrammarState | None
    seen: torch.Tensor

    def child(self, token: int, logprob: float) -> "Beam":
        m = copy.copy(self.matcher)  # shallow: the decode function is shared, the lists are not
        m.tokens, m.text_len = list(m.tokens), list(m.text_len)
        g = self.grammar.fork() if self.grammar is not None else None
        return Beam(self.tokens + [token], logprob, m, g, self.seen)


def length_normalised(logprob: float, n: int) -> float:
    return logprob / max(n, 1) ** LENGTH_PENALTY


def generate_special(model: Model, prompt, cfg: GenerateConfig, on_token: OnToken | None = None) -> GenerateResult:
    """Beam search (beam_size > 1, with or without a grammar) or single-lane grammar decode."""
    cfg = cfg.validate(model)
    check_modes("single", model.cache_mode, cfg)
    if cfg.beam_size > 1:
        return beam_search(model, prompt, cfg, on_token)
    with model.busy():
        ids = model.encode_prompt(prompt)
        check_length(model, len(ids), cfg)
        cache = single_cache(model, 1, cfg, len(ids))
        lane_cb = None if on_token is None else (lambda lane, token, index: on_token(token, index))
        return decode_lanes(model, [ids], [cfg], cache, lane_cb)[0]


def single_cache(model: Model, lanes: int, cfg: GenerateConfig, prompt_len: int) -> KVCache:
    if lanes == 1 and cfg.cache_window == 0:
        return model.decode_cache
    return model.new_cache(lanes, prompt_len + cfg.max_tokens, cfg.cache_window)


def beam_search(model: Model, prompt, cfg: GenerateConfig, on_token: OnToken | None = None) -> GenerateResult:
    """Best hypothesis as tokens/text/stats, and the n-best list (best first) in result.n_best."""
    cfg = cfg.validate(model)
    check_modes("single", model.cache_mode, cfg)
    if cfg.temperature != 0 or cfg.top_k != 0 or cfg.top_p != 1.0:
        raise ConfigError("beam search is deterministic: GenerateConfig.temperature must be 0 and top_k/top_p off "
                          f"when beam_size > 1 (got temperature={cfg.temperature}, top_k={cfg.top_k}, top_p={cfg.top_p})")
    with model.busy():
        ids = model.encode_prompt(prompt)
        check_length(model, len(ids), cfg)
        grammar = GrammarState.for_model(model, cfg.grammar) if cfg.grammar is not None else None
        cache = single_cache(model, cfg.beam_size, cfg, len(ids))
        cache.reset()
        return _beam_search(model, ids, cfg, cache, grammar, on_token)


@torch.inference_mode()
def _beam_search(model: Model, ids: list[int], cfg: GenerateConfig, cache: KVCache, grammar: GrammarState | None,
                 on_token: OnToken | None) -> GenerateResult:
    t0 = time.perf_counter()
    K, net, dev, eos = cfg.beam_size, model.net, model.device, model.eos_id
    loops = cfg.resolved_loops(model)
    stats = GenerateStats(prompt_tokens=len(ids), cache_mode=model.cache_mode)
    decoder = Decoder(model, loops, cache.lane_view(0), cfg.early_exit_threshold)
    logits = decoder.forward(ids, 0)[-1:]  # [1, V]: one live beam, the prompt
    loop_counts = list(decoder.loop_counts)
    t_prefill = time.perf_counter()
    stats.prefill_ms = (t_prefill - t0) * 1000
    adaptive = cfg.early_exit_threshold > 0 or net.exit_gate is not None
    beams = [Beam([], 0.0, StopMatcher(model.codec.decode, cfg.stop_sequences), grammar,
                  torch.tensor(ids, device=dev))]
    finished: list[tuple[Beam, str]] = []
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

    for i in range(cfg.max_tokens):
        cands = []  # (total logprob, beam index, token)
        for b, beam in enumerate(beams):
            row = apply_repetition_penalty(logits[b], beam.seen, cfg.repetition_penalty)
            logp = torch.log_softmax(row.float(), dim=-1)
            if beam.grammar is not None:
                logp = beam.grammar.mask(logp)
            top = torch.topk(logp, min(K, logp.shape[-1]))
            cands += [(beam.logprob + lp, b, t) for lp, t in zip(top.values.tolist(), top.indices.tolist())
                      if lp != float("-inf")]
        cands.sort(key=lambda c: -c[0])
        live, parents = [], []
        for total, b, t in cands[:K]:
            child = beams[b].child(t, total)
            if child.grammar is not None:
                child.grammar.accept(t)
            if t == eos:
                finished.append((child, "grammar_complete" if child.grammar is not None else "eos"))
                continue
            _, stopped = child.matcher.push(t)
            if stopped:
                finished.append((child, "stop_sequence"))
            elif child.grammar is not None and child.grammar.must_end():
                finished.append((child, "grammar_complete"))
            elif i == cfg.max_tokens - 1:
                finished.append((child, "max_tokens"))
            else:
                if cfg.repetition_penalty != 1.0:
                    child.seen = torch.cat((beams[b].seen, torch.tensor([t], device=dev)))
                live.append(child)
                parents.append(b)
        # Stream what every hypothesis that can still win agrees on (released tokens only: no stop-sequence parts).
        if on_token is not None:
            agreed = [bm.matcher.tokens[:bm.matcher.emitted] for bm in live] + [final_tokens(bm, r) for bm, r in finished]
            n = common_prefix(agreed)
            if n > emitted and not emit_upto(agreed[0], n):
                cancelled = True
                break
        if not live:
            break
        beams = live
        cache.reorder_lanes(torch.tensor(parents))
        x = torch.tensor([[bm.tokens[-1]] for bm in beams], device=dev)
        step = net.make_step(torch.full((len(beams), 1), pos, device=dev), pos + 1)
        if adaptive:
            out, used = net.forward_adaptive(x, loops, step, cache, cfg.early_exit_threshold)
            loop_counts += [int(u) for u in used]
        else:
            out = decode_forward(net, x, loops, step, cache)
            loop_counts += [loops] * len(beams)
        logits = out[:, -1]
        pos += 1

    ranked = sorted((to_hypothesis(model, bm, r) for bm, r in finished), key=lambda h: -h.score)[:K]
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


def final_tokens(beam: Beam, reason: str) -> list[int]:
    """A finished hypothesis's output: cut before a stop sequence, without EOS."""
    return beam.matcher.tokens  # the matcher never sees EOS and cuts a completed stop sequence


def to_hypothesis(model: Model, beam: Beam, reason: str) -> Hypothesis:
    tokens = final_tokens(beam, reason)
    m = beam.matcher
    text = m.text if reason == "stop_sequence" and m.strings else model.codec.decode(tokens)
    return Hypothesis(tokens, text, beam.logprob, length_normalised(beam.logprob, len(beam.tokens)), reason)


def common_prefix(seqs: list[list[int]]) -> int:
    if not seqs:
        return 0
    n = min(len(s) for s in seqs)
    for j in range(n):
        t = seqs[0][j]
        if any(s[j] != t for s in seqs):
            return j
    return n
