"""The one sampler: every lane's logits to its next token in one pass per step.

Rows [B, V] go through the repetition penalty, temperature, top-k, top-p and min-p as tensor operations over all
rows at once; each row keeps its own settings. The rarer adjustments (presence and frequency penalties, a logit
bias, tokens banned until min_tokens) are added for the rows that ask for them. The draw is an exponential race, argmax(p / E) with E ~ Exp(1) drawn from
the lane's own generator, which picks token j with probability p_j. A seeded lane therefore draws the same tokens
alone or in any batch. Beam search and speculative decoding use the same penalty and filter.

Numerically safe for every value the field table admits (tinyloop/fields.py):
- a temperature below MIN_TEMPERATURE samples greedily, since logits / T would overflow float32;
- a penalised logit is kept within +-MAX_LOGIT, so an extreme penalty never makes an infinity or a NaN.
"""
from __future__ import annotations

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

    @property
    def adjusts(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.bias or self.banned)


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
    """filter_rows for one row [V] (speculative decoding's draft and target distributions)."""
    one = lambda v, dtype: torch.tensor([v], dtype=dtype, device=logits.device)  # noqa: E731
    return filter_rows(logits.unsqueeze(0), one(temperature, torch.float32), one(top_k, torch.long),
                       one(top_p, torch.float32), one(min_p, torch.float32))[0]


def sample(logits: torch.Tensor, lanes: list[LaneSampling]) -> list[int]:
    """The next token of every row of logits [B, V], row i under lanes[i]'s settings."""
    logits = adjust(logits, lanes)
    tokens = logits.argmax(dim=-1)
    hot = [i for i, lane in enumerate(lanes) if lane.temperature >= MIN_TEMPERATURE]
    if hot:
        dev = logits.device
        settings = [lanes[i] for i in hot]
        scaled = filter_rows(logits[hot], torch.tensor([s.temperature for s in settings], device=dev),
                             torch.tensor([s.top_k for s in settings], device=dev),
                             torch.tensor([s.top_p for s in settings], device=dev),
                             torch.tensor([s.min_p for s in settings], device=dev))
        probs = torch.softmax(scaled, dim=-1)
        # each lane's noise from its own (CPU) generator, so its draws do not depend on its batch-mates
        race = torch.stack([torch.empty(probs.shape[-1]).exponential_(generator=s.generator) for s in settings])
        race = race.to(dev)
        tokens[hot] = (probs / race).argmax(dim=-1).to(tokens.device)
    return tokens.tolist()
