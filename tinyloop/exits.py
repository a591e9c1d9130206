"""Exit rules: when a token's loops may stop (early exit), as data each request carries.

A rule looks at the token after each loop k (1-based: k loops done) and says whether it may stop there; the token
then takes its logits from that loop's state, and its skipped loops' K/V follow the family's exit_kv policy
(docs/engine.md). What each rule compares, with the request's threshold t:

  latent   relative latent change |s_k - s_{k-1}| / |s_k| < t (every position of the chunk), or the model's exit
           gate >= 0.5 (a gated model, even at t = 0)
  cdf      Ouro's gate: lambda_k = sigmoid(gate(s_k)) gives p_k = lambda_k prod_{j<k} (1 - lambda_j), the last loop
           the mass left; stop once sum_{j<=k} p_j >= t (needs an exit gate)
  entropy  Huginn's entropy-diff: |H(softmax(logits_k)) - H_{k-1}| < t, H_0 = 100
  kl       Huginn's KL: KL(p_{k-1} || p_k) < t between successive loops' next-token distributions, p_0 uniform
  argmax   Huginn's argmax-stability: the most likely token is the same for t loops in a row

entropy, kl and argmax read each loop's logits, so the coda and head run after every loop of such a token (as
Huginn's reference does); the logits of the loop it stops at are its logits. No token stops before `min_loops`
loops, nor after the request's `loops` (its max_loops). Huginn's reference skips the rule's bookkeeping before
min_steps; here it runs every loop, which is the same for min_loops <= 1. A prompt's chunks run every loop (the cdf
rule still takes each position's logits from its exit loop, as Ouro's reference does).

`schedule` (not a request field on the wire: GenerateConfig.exit_schedule, in process) forces the pattern instead:
generated token i stops after exit_schedule[i % len] loops, for benchmarks of depth patterns on random weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


HEAD_RULES = ("entropy", "kl", "argmax")  # decided on each loop's logits
TRACKED = ("cdf", *HEAD_RULES)  # the rules that remember something between loops (a Track)
NO_ENTROPY = 100.0  # Huginn's entropy before the first loop


@dataclass(frozen=True)
class ExitRule:
    """A request's early exit: its rule, threshold (0: off, but a gated model's latent rule still uses its gate)
    and the fewest loops a token runs."""

    rule: str = "latent"
    threshold: float = 0.0
    min_loops: int = 1

    @property
    def reads_logits(self) -> bool:
        return self.rule in HEAD_RULES and self.threshold > 0

    @staticmethod
    def of(value: "ExitRule | float", model_rule: str = "latent") -> "ExitRule":
        """An ExitRule from a plain threshold (the model's own rule), or the rule itself."""
        return value if isinstance(value, ExitRule) else ExitRule(model_rule, float(value))


@dataclass
class Track:
    """What rows' rules remember between loops: the cdf rule's sums [B, T] and the Huginn rules' last entropy [B],
    log-probabilities [B, V], argmax and how long it held [B]."""

    cdf: torch.Tensor
    rest: torch.Tensor
    entropy: torch.Tensor
    logp: torch.Tensor
    argmax: torch.Tensor
    stable: torch.Tensor

    @staticmethod
    def start(B: int, T: int, vocab: int, device) -> "Track":
        return Track(torch.zeros(B, T, device=device), torch.ones(B, T, device=device),
                     torch.full((B,), NO_ENTROPY, device=device), torch.full((B, vocab), -math.log(vocab), device=device),
                     torch.full((B,), -1, dtype=torch.long, device=device),
                     torch.zeros(B, dtype=torch.long, device=device))

    def rows(self, idx: torch.Tensor) -> "Track":
        return Track(*(getattr(self, f)[idx] for f in FIELDS))

    def put(self, idx: torch.Tensor, new: "Track") -> None:
        for f in FIELDS:
            getattr(self, f)[idx] = getattr(new, f)

    @staticmethod
    def cat(tracks: list["Track"]) -> "Track":
        return Track(*(torch.cat([getattr(t, f) for t in tracks]) for f in FIELDS))


FIELDS = ("cdf", "rest", "entropy", "logp", "argmax", "stable")


def exit_stops(net, rules: list[ExitRule], done: list[int], last: torch.Tensor, s_old: torch.Tensor | None,
               s_new: torch.Tensor, track: Track | None, logits: torch.Tensor | None = None) -> torch.Tensor:
    """One loop's exit decision for rows [B] of tokens [T]: states s_old -> s_new [B, T, d] (s_old None: a chunk,
    where only the cdf rule acts), `done` the loops each row has now run, `last` [B, 1] its last loop, `logits`
    [B, V] of this loop where a row's rule reads them. Updates `track` (None where no row's rule is TRACKED);
    returns which tokens may stop [B, T]. One
    decision for the loop-iteration steps (engine/executor.py) and a chunk's choice per token (model.ChunkExits)."""
    B, T, dev = s_new.shape[0], s_new.shape[1], s_new.device
    stop = torch.zeros(B, T, dtype=torch.bool, device=dev)
    thr = torch.tensor([r.threshold for r in rules], dtype=torch.float32, device=dev)
    for name in dict.fromkeys(r.rule for r in rules):
        rows = [b for b, r in enumerate(rules) if r.rule == name]
        idx = torch.tensor(rows, device=dev)
        t = thr[idx]
        if name == "cdf":
            assert track is not None  # (the rules that remember something between loops come with a Track)
            lam = net.exit_prob(s_new[idx]).float()
            cdf = track.cdf[idx] + torch.where(last[idx], track.rest[idx], lam * track.rest[idx])
            track.cdf[idx], track.rest[idx] = cdf, track.rest[idx] * (1 - lam)
            stop[idx] = (cdf >= t.unsqueeze(1)) & (t > 0).unsqueeze(1)
        elif name == "schedule":  # a forced exit pattern (GenerateConfig.exit_schedule): the threshold is the depth
            stop[idx] = (torch.tensor([done[b] for b in rows], device=dev) >= t).unsqueeze(1).expand(-1, T)
        elif name == "latent":
            if s_old is not None:
                stop[idx] = net.exit_mask(s_old[idx], s_new[idx], t).unsqueeze(1).expand(-1, T)
        elif name in HEAD_RULES:
            on = [b for b in rows if rules[b].threshold > 0]
            if not on or logits is None:  # (no logits: every such row's exit is chosen already)
                continue
            assert track is not None  # (as for cdf)
            idx, t = torch.tensor(on, device=dev), thr[torch.tensor(on, device=dev)]
            row_logits = logits[idx].float()
            if name == "entropy":
                p = torch.softmax(row_logits, dim=-1)
                entropy = -(p * torch.log(p + 1e-10)).sum(-1)
                fires = (entropy - track.entropy[idx]).abs() < t
                track.entropy[idx] = entropy
            elif name == "kl":
                logp = torch.log_softmax(row_logits, dim=-1)
                prev = track.logp[idx]
                fires = (prev.exp() * (prev - logp)).sum(-1) < t
                track.logp[idx] = logp
            else:  # argmax
                top = row_logits.argmax(-1)
                stable = torch.where(top == track.argmax[idx], track.stable[idx] + 1, 0)
                fires = stable >= t
                track.argmax[idx], track.stable[idx] = top, stable
            stop[idx] = fires.unsqueeze(1).expand(-1, T)
    if all(r.min_loops <= 1 for r in rules):
        return stop
    floor = torch.tensor([d >= r.min_loops for d, r in zip(done, rules)], device=dev)
    return stop & floor.unsqueeze(1)
