"""Turning one lane's logits into a token: repetition penalty, temperature, top-k, top-p."""
from __future__ import annotations

import torch


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style: a seen token's positive logit is divided by the penalty, a negative one multiplied."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    picked = logits[seen]
    logits = logits.clone()
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Scaled logits with everything outside top-k / the top-p nucleus set to -inf (temperature > 0)."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                 generator: torch.Generator | None) -> int:
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
