"""The one sampler: how every token is chosen, whoever chooses it.

Rows [B, V] go through the repetition penalty, temperature, top-k, top-p and min-p as tensor operations over all
rows at once; each row keeps its own settings. The rarer adjustments (presence and frequency penalties, a logit
bias, tokens banned until min_tokens) are added for the rows that ask for them (`adjust`). Then, per row:
- a greedy lane takes `greedy_choice` of its adjusted row: the argmax, the first token among equal maxima. A lane
  whose adjusted row is its raw one (LaneSampling.plain_argmax) may have that choice made inside the C decode passes
  (the scheduler's run-ahead): cpu_block.c's argmax is the same rule;
- a sampled lane draws from `distribution` (its filtered softmax) by `race`: argmax(p / E) with E ~ Exp(1) from the
  lane's own generator picks token j with probability p_j, and a seeded lane draws the same tokens alone or in any
  batch.
Speculative decoding proposes drafts with `greedy_proposals` or `draw` from `distribution`, and accepts them with
`accepts` and `residual` (speculative sampling) or `greedy_choice`; beam search expands a hypothesis by
`beam_candidates`. All of them read the same adjusted logits.

Numerically safe for every value the field table admits (tinyloop/fields.py):
- a temperature below MIN_TEMPERATURE samples greedily, since logits / T would overflow float32;
- a penalised logit is kept within +-MAX_LOGIT, so an extreme penalty never makes an infinity or a NaN.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

MIN_TEMPERATURE = 1e-5
MAX_LOGIT = 1e30


@dataclass
class LaneSampling:
    """One lane's settings for a draw."""

    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seen: list[int]  # the tokens the repetition penalty sees (prompt + output so far)
    generator: torch.Generator | None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    output: list[int] = field(default_factory=list)  # the tokens the presence / frequency penalties count
    bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    banned: list[int] = field(default_factory=list)  # tokens it may not draw now (EOS before min_tokens)
    constrained: bool = False  # a grammar masks its logits before they come here (Sequence.masked)

    @property
    def adjusts(self) -> bool:
        """Whether `adjust` changes its row beyond the repetition penalty."""
        return bool(self.presence_penalty or self.frequency_penalty or self.bias or self.banned)

    @property
    def greedy(self) -> bool:
        """Whether it chooses by `greedy_choice`: a temperature below MIN_TEMPERATURE (0 asks for it), where
        logits / T would overflow float32."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def plain_argmax(self) -> bool:
        """Whether its next token is `greedy_choice` of its raw logits: greedy, with no repetition penalty, no other
        adjustment and no grammar mask. Such a choice needs nothing the sampler keeps (history, bias, mask), so the
        C decode passes may make it themselves and go on with the token (the scheduler's run-ahead)."""
        return self.greedy and self.repetition_penalty == 1.0 and not self.adjusts and not self.constrained


def adjust(logits: torch.Tensor, lanes: list[LaneSampling]) -> torch.Tensor:
    """Every logit adjustment a lane asks for, rows [B, V]: the repetition penalty (all rows at once), then presence
    and frequency penalties over its output, its logit bias and its banned tokens."""
    logits = penalise(logits, [lane.seen for lane in lanes], [lane.repetition_penalty for lane in lanes])
    rows = [i for i, lane in enumerate(lanes) if lane.adjusts]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        lane, row = lanes[i], logits[i]
        if lane.output and (lane.presence_penalty or lane.frequency_penalty):
            counts = torch.bincount(torch.tensor(lane.output, device=row.device), minlength=row.shape[-1]).to(row.dtype)
            row -= lane.presence_penalty * (counts > 0).to(row.dtype) + lane.frequency_penalty * counts
        if lane.bias:
            ids = torch.tensor(list(lane.bias), device=row.device)
            row[ids] += torch.tensor(list(lane.bias.values()), dtype=row.dtype, device=row.device)
        if lane.banned:
            row[torch.tensor(lane.banned, device=row.device)] = float("-inf")
    return logits


def penalise(logits: torch.Tensor, seen: list[list[int]], penalties: list[float]) -> torch.Tensor:
    """CTRL-style, every row at once: a seen token's positive logit is divided by its row's penalty, a negative one
    multiplied. logits [B, V]."""
    rows = [i for i, p in enumerate(penalties) if p != 1.0 and seen[i]]
    if not rows:
        return logits
    B, V = logits.shape
    where = torch.zeros(B * V, dtype=torch.bool, device=logits.device)
    where[torch.tensor([i * V + t for i in rows for t in seen[i]], device=logits.device)] = True
    p = torch.tensor(penalties, dtype=logits.dtype, device=logits.device).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / p, logits * p).clamp(-MAX_LOGIT, MAX_LOGIT)
    return torch.where(where.view(B, V), penalised, logits)


def filter_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled logits [B, V] (fp32) with everything outside each row's top-k, top-p nucleus and min-p floor set to
    -inf. temperature [B] (at least MIN_TEMPERATURE is used), top_k [B] (0: off), top_p [B] (1: off), min_p [B]
    (0: off; a token stays when its probability is at least min_p times the most likely one's)."""
    logits = logits.float() / temperature.clamp_min(MIN_TEMPERATURE).unsqueeze(1)
    V = logits.shape[-1]
    if bool(((top_k > 0) & (top_k < V)).any()):
        ranked = logits.sort(dim=-1, descending=True).values
        kth = ranked.gather(1, (top_k.clamp(1, V) - 1).unsqueeze(1))
        kth = torch.where(((top_k > 0) & (top_k < V)).unsqueeze(1), kth, torch.full_like(kth, float("-inf")))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if bool((top_p < 1.0).any()):
        ranked, order = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(ranked, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    if min_p is not None and bool((min_p > 0).any()):
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        floor = logits.max(dim=-1, keepdim=True).values + torch.log(min_p.clamp_min(1e-30)).unsqueeze(1)
        logits = logits.masked_fill((logits < floor) & (min_p > 0).unsqueeze(1), float("-inf"))
    return logits


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
                  ) -> torch.Tensor:
    """filter_rows for one row [V]."""
    one = lambda v, dtype: torch.tensor([v], dtype=dtype, device=logits.device)  # noqa: E731
    return filter_rows(logits.unsqueeze(0), one(temperature, torch.float32), one(top_k, torch.long),
                       one(top_p, torch.float32), one(min_p, torch.float32))[0]


# --- the rules: each way a token is chosen --------------------------------------------------------------------
def greedy_choice(adjusted: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row of adjusted logits [..., V]: the most likely one, the lowest id among equal
    maxima (torch.argmax's rule). The C decode passes draw a plain_argmax lane's tokens by the same rule
    (cpu_block.c: argmax, a strict > from the first index), so a token drawn there is the one chosen here. (They
    part only on a NaN logit, which torch takes for the maximum and C passes over: a model gone wrong either way.)"""
    return adjusted.argmax(dim=-1)


def distribution(adjusted: torch.Tensor, lanes: list[LaneSampling]) -> torch.Tensor:
    """What each row of adjusted logits [B, V] is sampled from: the softmax (fp32) of the row at its lane's
    temperature, zero outside its top-k, top-p nucleus and min-p floor. A plain lane's draws and a speculative
    lane's drafts, acceptances and corrections are all taken from it, so they agree on the target."""
    dev = adjusted.device
    scaled = filter_rows(adjusted, torch.tensor([s.temperature for s in lanes], device=dev),
                         torch.tensor([s.top_k for s in lanes], device=dev),
                         torch.tensor([s.top_p for s in lanes], device=dev),
                         torch.tensor([s.min_p for s in lanes], device=dev))
    return torch.softmax(scaled, dim=-1)


def race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [B, V], row i with generators[i]: argmax(p / E), E ~ Exp(1), picks token j with
    probability p_j. Each row's noise comes from its own (CPU) generator alone, so a seeded lane draws the same
    tokens alone or in any batch."""
    noise = torch.stack([torch.empty(probs.shape[-1]).exponential_(generator=g) for g in generators])
    return (probs / noise.to(probs.device)).argmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None, k: int = 1) -> list[int]:
    """k independent tokens from one distribution probs [V] (with replacement), with the lane's generator: a
    speculative lane's sampled drafts (a tree's k first tokens), its corrections and its bonus tokens. Its noise is
    the lane's alone, as the race's is (the seeded-lane guarantee); it is not the race so that seeded speculative
    outputs stay what they were."""
    return torch.multinomial(probs, k, replacement=True, generator=generator).tolist()


def greedy_proposals(adjusted: torch.Tensor, k: int) -> tuple[list[int], float]:
    """A greedy speculative lane's k drafts after a node, from its adjusted draft logits [V]: its greedy choice
    (k = 1) or its k likeliest tokens (a tree's first level), and the draft's probability of the first at
    temperature 1 (how sure it is: a doubtful draft ends a chain)."""
    probs = torch.softmax(adjusted, -1)
    if k == 1:
        top = int(greedy_choice(adjusted))
        return [top], float(probs[top])
    best = probs.topk(k)
    return best.indices.tolist(), float(best.values[0])


def accepts(token: int, target: torch.Tensor, draft: torch.Tensor, generator: torch.Generator | None) -> bool:
    """Speculative sampling's test of a token drawn from the draft distribution q = `draft` [V] against the target
    p = `target` [V]: keep it with probability min(1, p/q) (u q < p, u ~ U[0, 1) from the lane's generator, is that
    test without a division). With `residual` after a rejection the output keeps the target distribution."""
    return float(torch.rand((), generator=generator)) * float(draft[token]) < float(target[token])


def residual(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """What a rejected draft leaves to draw from: max(0, p - q) normalised, the mass the target has beyond the draft
    (the target itself where it has none: p <= q everywhere)."""
    rest = (target - draft).clamp_min(0)
    return rest / rest.sum() if rest.sum() > 0 else target


def beam_candidates(adjusted: torch.Tensor, k: int, mask: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> list[tuple[float, int]]:
    """A beam hypothesis's expansions from its adjusted logits [V]: the k likeliest next tokens as (log-probability,
    token), best first, by the model's log-probabilities after the penalties (a grammar's `mask` sets the tokens it
    forbids to -inf without renormalising: the scores stay the model's), leaving out the forbidden ones."""
    logp = torch.log_softmax(adjusted.float(), dim=-1)
    if mask is not None:
        logp = mask(logp)
    top = torch.topk(logp, min(k, logp.shape[-1]))
    return [(lp, t) for lp, t in zip(top.values.tolist(), top.indices.tolist()) if lp != float("-inf")]


def sample(logits: torch.Tensor, lanes: list[LaneSampling]) -> list[int]:
    """The next token of every row of logits [B, V], row i under lanes[i]'s settings: `greedy_choice` of the
    adjusted row for a greedy lane, a `race` over its `distribution` for the others."""
    logits = adjust(logits, lanes)
    tokens = greedy_choice(logits)
    hot = [i for i, lane in enumerate(lanes) if not lane.greedy]
    if hot:
        settings = [lanes[i] for i in hot]
        drawn = race(distribution(logits[hot], settings), [s.generator for s in settings])
        tokens[hot] = drawn.to(tokens.device)
    return tokens.tolist()
