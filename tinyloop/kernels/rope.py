"""Rotary embedding of q and k in one launch, reading cos/sin from the model's tables at each token's position.

Rotate-half convention of tinyloop.rotary.apply_rope: x = [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin].
"""
from __future__ import annotations

import torch
import triton.language as tl

from ..rotary import apply_rope
from .dispatch import lazy_jit, next_pow2, use_triton


def rope_ref(x: torch.Tensor, pos: torch.Tensor, table_cos: torch.Tensor, table_sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, hd] rotated at positions pos [B, T]."""
    return apply_rope(x, table_cos[pos].unsqueeze(2), table_sin[pos].unsqueeze(2))


@lazy_jit
def _rope_kernel(X, OUT, POS, COS, SIN, H: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
                 H_P: tl.constexpr):
    tok = tl.program_id(0)
    p = tl.load(POS + tok)
    hh = tl.arange(0, H_P)
    i = tl.arange(0, HALF_P)
    m = (hh[:, None] < H) & (i[None, :] < HALF)
    base = (tok * H + hh[:, None]) * (2 * HALF) + i[None, :]
    x1 = tl.load(X + base, mask=m, other=0.0)
    x2 = tl.load(X + base + HALF, mask=m, other=0.0)
    dt = X.dtype.element_ty
    c = tl.load(COS + p * HALF + i, mask=i < HALF, other=0.0)[None, :]
    s = tl.load(SIN + p * HALF + i, mask=i < HALF, other=0.0)[None, :]
    # products rounded to the model dtype like the torch path, which multiplies in that dtype
    tl.store(OUT + base, ((x1 * c).to(dt) - (x2 * s).to(dt)).to(OUT.dtype.element_ty), mask=m)
    tl.store(OUT + base + HALF, ((x2 * c).to(dt) + (x1 * s).to(dt)).to(OUT.dtype.element_ty), mask=m)


def rope_triton(x: torch.Tensor, pos: torch.Tensor, table_cos: torch.Tensor, table_sin: torch.Tensor) -> torch.Tensor:
    B, T, H, hd = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    _rope_kernel[(B * T,)](x, out, pos.contiguous(), table_cos, table_sin, H=H, HALF=hd // 2,
                           HALF_P=next_pow2(hd // 2), H_P=next_pow2(H))
    return out


def rope(x: torch.Tensor, pos: torch.Tensor, table_cos: torch.Tensor, table_sin: torch.Tensor) -> torch.Tensor:
    return (rope_triton if use_triton(x.device) else rope_ref)(x, pos, table_cos, table_sin)
