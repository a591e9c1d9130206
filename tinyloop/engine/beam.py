"""A beam-search request as lanes of the runner (tinyloop/engine/runner.py), beside every other request.

The request is its root Sequence. Once admitted it holds `beam_size` lanes; its hypotheses are forks of the root,
one per lane, and they decode in the runner's forward with the other lanes. At each step every live hypothesis
proposes its top `beam_size` next tokens; the best `beam_size` (hypothesis, token) pairs by total log-probability
survive, and the lanes are re-assigned so each child inherits its parent's blocks (shared, copied on write). A child
that ends (EOS, a stop sequence, a complete grammar, max_tokens) is set aside, so the live beam shrinks; the request
ends when none is live. With beam_size 1 this is exactly greedy decode.

Scores: `logprob` is the sum of the model's log-probabilities of the scored tokens (after the repetition penalty;
EOS is scored when the hypothesis ended on it). Finished hypotheses are ranked by the length-normalised
`score = logprob / n ** LENGTH_PENALTY`, n the number of scored tokens, so a short hypothesis does not win only
because it adds fewer negative terms. The stream carries what every hypothesis that can still win agrees on.
With GenerateConfig.logprobs the result carries the best hypothesis's tokens' log-probabilities, each under its
parent's logits before any penalty (Sequence.score_all, as for any other request).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..request import GenerateResult
from ..sampling import beam_candidates
from .sequence import AssignsLanes, Sequence, with_scores

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


class BeamGroup:
    def __init__(self, root: Sequence):
        self.root, self.width = root, root.cfg.beam_size
        self.on_token, root.on_token = root.on_token, None  # hypotheses stream nothing themselves; the group does
        self.lanes: list[int] = []  # the lanes it holds once admitted
        self.live: list[tuple[Sequence, float]] = []  # (hypothesis, total log-probability), in their lanes
        self.finished: list[tuple[Sequence, float]] = []
        self.emitted = 0
        self.agreed: list[list[int]] = []  # what each hypothesis that can still win holds (for the stream)
        self.outcome: GenerateResult | None = None

    @property
    def members(self) -> list[Sequence]:
        """The sequences holding its lanes now: the root until its prompt is in, then the live hypotheses."""
        return [seq for seq, _ in self.live] if self.live or self.outcome is not None else [self.root]

    def advance(self, lanes_of: AssignsLanes) -> list[Sequence]:
        """Expand every member's fresh logits into the next live beam (re-assigning lanes: lanes_of.assign_lanes, the
        executor's or a cache's); returns the new members, empty when the search is over (self.outcome is then
        set)."""
        parents = self.live or [(self.root, 0.0)]
        cands = []  # (total logprob, parent index, token)
        fresh = [seq.place.fresh() for seq, _ in parents]
        for b, (seq, total) in enumerate(parents):
            expansions = beam_candidates(seq.penalised(fresh[b]), self.width, seq.masked)
            cands += [(total + lp, b, t) for lp, t in expansions]
            seq.place.logits = None
        cands.sort(key=lambda c: -c[0])
        chosen = cands[:self.width]
        children = [parents[b][0].fork() for _, b, _ in chosen]
        # (with cfg.logprobs: each child's token scored under its parent's logits, as a sampled token is)
        Sequence.score_all(children, [fresh[b] for _, b, _ in chosen], [t for *_, t in chosen])
        live, sources = [], []
        for (total, b, token), child in zip(chosen, children):
            if child.take(token):  # the Sequence's bookkeeping: grammar, EOS, stop sequences, max_tokens
                live.append((child, total))
                sources.append(parents[b][0].place.lane)
            else:
                self.finished.append((child, total))
        if not self.stream(live):
            return self.end(cancelled=True)
        if not live:
            return self.end()
        lanes = self.lanes[:len(live)]
        lanes_of.assign_lanes(lanes, sources)
        for (child, _), lane in zip(live, lanes):
            child.place.lane = lane
        self.live = live
        return [child for child, _ in live]

    def stream(self, live: list[tuple[Sequence, float]]) -> bool:
        """Stream what every hypothesis that can still win agrees on (released tokens only: no stop-sequence
        parts); False when the caller cancels."""
        if self.on_token is None:
            return True
        self.agreed = [s.matcher.tokens[:s.matcher.emitted] for s, _ in live] + [s.tokens for s, _ in self.finished]
        return self.emit(self.agreed[0], common_prefix(self.agreed))

    def emit(self, tokens: list[int], n: int) -> bool:
        while self.emitted < n:
            if self.emitted == 0:
                self.root.stats.first_token_ms = (time.perf_counter() - self.root.t_call) * 1000
            keep = self.on_token(tokens[self.emitted], self.emitted) if self.on_token is not None else True
            self.emitted += 1
            if keep is False:
                return False
        return True

    def end(self, cancelled: bool = False) -> list[Sequence]:
        """Rank the finished hypotheses and settle the request's result on its root."""
        root, st = self.root, self.root.stats
        pairs = sorted(((to_hypothesis(s, lp), s) for s, lp in self.finished), key=lambda p: -p[0].score)[:self.width]
        ranked = [h for h, _ in pairs]
        scores = None  # the best hypothesis's (Sequence.scores), where the request asks for them
        if cancelled or not ranked:
            tokens, reason, text = self.agreed[0][:self.emitted] if self.agreed else [], "cancelled", None
            ranked = []
        else:
            best, scores = ranked[0], pairs[0][1].scores
            tokens, reason, text = best.tokens, best.stop_reason, best.text
            if not self.emit(tokens, len(tokens)):
                tokens, reason, text = tokens[:self.emitted], "cancelled", None
        counts = [c for s, _ in self.finished for c in s.loop_counts] or root.loop_counts
        root.done, root.stop_reason, root.t_end = True, reason, time.perf_counter()
        st.generated_tokens, st.stop_reason = len(tokens), reason
        st.decode_ms, st.total_ms = (root.t_end - root.t_prefilled) * 1000, (root.t_end - root.t_call) * 1000
        st.loops_mean = sum(counts) / len(counts) if counts else float(root.loops)
        self.outcome = GenerateResult(tokens, root.model.codec.decode(tokens) if text is None else text, st,
                                      n_best=ranked)
        if root.cfg.logprobs is not None and scores is not None:
            with_scores(self.outcome, scores)
        self.live = []
        return []

    def cancel(self) -> None:
        if self.outcome is None:
            self.end(cancelled=True)


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
