"""Rotary position embedding (RoPE), rotate-half convention: x = [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin].

The tables and the math that the model (tinyloop/model.py), the cached forward (tinyloop/engine/forward.py) and the
kernels (tinyloop/kernels/rope.py, cpu_block.py) share, so that every path rotates with the same bits.
"""
from __future__ import annotations

import torch


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Computed on the CPU in float64 whatever the default device (the caller moves them)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64, device="cpu"), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, hd]; cos/sin: [B, T, 1, hd/2] already gathered at the tokens' positions."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_factors(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[cos, cos] and [-sin, sin]: rotate-half RoPE as x * cos2 + swap_halves(x) * sin2."""
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """apply_rope with three fewer ops and the same bits: x1 cos + x2 (-sin) == x1 cos - x2 sin in IEEE."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos2 + torch.cat((x2, x1), dim=-1) * sin2
