"""Residual add fused with the RMSNorm that follows it: x = x + r; y = rmsnorm(x) * w, one read of each row.

In a pre-norm block this is the seam between the attention branch and the MLP (and between blocks), so
decode makes one launch there instead of five.
"""
from __future__ import annotations

import torch
import triton.language as tl

from .dispatch import lazy_jit, next_pow2, use_triton


def add_rmsnorm_ref(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + r, RMSNorm(x + r) * w) exactly as tinyloop.model.RMSNorm computes it; r=None skips the add."""
    if r is not None:
        x = x + r
    return x, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@lazy_jit
def _add_rmsnorm_kernel(X, R, W, XOUT, Y, eps, D: tl.constexpr, D_P: tl.constexpr, HAS_R: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, D_P)
    m = i < D
    x = tl.load(X + row * D + i, mask=m, other=0.0).to(tl.float32)
    if HAS_R:
        x = (x + tl.load(R + row * D + i, mask=m, other=0.0).to(tl.float32)).to(X.dtype.element_ty).to(tl.float32)
        tl.store(XOUT + row * D + i, x.to(XOUT.dtype.element_ty), mask=m)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.load(W + i, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + row * D + i, ((x * inv).to(X.dtype.element_ty).to(tl.float32) * w).to(Y.dtype.element_ty), mask=m)


def add_rmsnorm_triton(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    D = x.shape[-1]
    x = x.contiguous()
    x_out = torch.empty_like(x) if r is not None else x
    y = torch.empty_like(x)
    _add_rmsnorm_kernel[(x.numel() // D,)](x, r.contiguous() if r is not None else x, w, x_out, y, eps,
                                          D=D, D_P=next_pow2(D), HAS_R=r is not None)
    return x_out, y


def add_rmsnorm(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (add_rmsnorm_triton if use_triton(x.device) else add_rmsnorm_ref)(x, r, w, eps)
