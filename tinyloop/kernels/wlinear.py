"""Weight-only products on the GPU: y = x @ W^T with W stored as bf16, int8 or int4 (tinyloop/formats.py).

The weights stay in their stored form in memory and are widened in registers, tile by tile:
  bf16  w = data                                  (exact in fp32)
  int8  w = q * scale[n]                          (the scale multiplies the fp32 sums once, at the end)
  int4  w = ((byte & 15) - 8) * scale[n, k // g]  for value 32 b + j of a row, j < 16
          ((byte >> 4) - 8) * scale[n, k // g]   for value 32 b + j + 16 (same byte, same group)
x is read in its own dtype and widened to fp32; sums are fp32; y is fp32 [..., N].

Decode is the target (B = 1 .. ~64 rows of x against a large W), so the grid tiles N (BLOCK_N rows of W per
program) and B (BLOCK_M rows of x), and each program walks all of K in BLOCK_K steps: W is read exactly once
when B <= BLOCK_M, which is what decode is bound by. Two ways to multiply a tile, chosen by BLOCK_M:
  BLOCK_M <  16  broadcast multiply and sum over K on the CUDA cores, exact fp32. tl.dot needs 16 rows, and
                 padding one decode row to 16 would do 16x the arithmetic for nothing.
  BLOCK_M >= 16  tl.dot (tensor cores) with `precision` ("ieee" exact fp32 like the attention kernel, or
                 "tf32x3", ~fp32 and faster); the rows past B are masked to zero.
int4 never reorders nibbles in registers: the low nibbles of a tile's BLOCK_K / 2 bytes are one product and
the high nibbles another, each against the columns of x they belong to (x is small; gathering it is cheap).
"""
from __future__ import annotations

import os

import torch
import triton.language as tl

from ..errors import ConfigError
from ..formats import INT4_BLOCK, QMatrix, quantize_activations
from .dispatch import lazy_jit, next_pow2

FMTS = {"bf16": 0, "int8": 1, "int4": 2}
PRECISIONS = ("ieee", "tf32x3", "tf32")


@lazy_jit
def _wlinear_kernel(X, W, S, Y, B, N, K, GROUP, sx, sw, ss,
                    FMT: tl.constexpr, PREC: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of x (and y)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of W (columns of y)
    m_ok, n_ok = (m < B)[:, None], (n < N)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if FMT == 2:
        # byte i of the tile holds tile values lo[i] (low nibble) and lo[i] + 16 (high): block i // 16, slot i % 16
        i = tl.arange(0, BLOCK_K // 2)
        lo = (i // 16) * 32 + i % 16
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // 2 + i  # byte columns of W
            kl = k0 + lo      # value columns of the low nibbles; the high ones are kl + 16
            w_ok = n_ok & (kb < K // 2)[None, :]
            byte = tl.load(W + n[:, None] * sw + kb[None, :], mask=w_ok, other=0)
            s = tl.load(S + n[:, None] * ss + (kl // GROUP)[None, :], mask=w_ok, other=0.0)  # one group per 32 values
            w_lo = ((byte & 15).to(tl.float32) - 8.0) * s
            w_hi = ((byte >> 4).to(tl.float32) - 8.0) * s
            x_ok = m_ok & (kl < K)[None, :]
            x_lo = tl.load(X + m[:, None] * sx + kl[None, :], mask=x_ok, other=0.0).to(tl.float32)
            x_hi = tl.load(X + m[:, None] * sx + kl[None, :] + 16, mask=x_ok, other=0.0).to(tl.float32)
            if BLOCK_M >= 16:
                acc += tl.dot(x_lo, tl.trans(w_lo), input_precision=PREC)
                acc += tl.dot(x_hi, tl.trans(w_hi), input_precision=PREC)
            else:  # [M, 1, K/2] * [1, N, K/2] summed over K/2
                acc += tl.sum(x_lo[:, None, :] * w_lo[None, :, :], 2) + tl.sum(x_hi[:, None, :] * w_hi[None, :, :], 2)
    else:
        k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + k < K)[None, :]
            w = tl.load(W + n[:, None] * sw + k0 + k[None, :], mask=n_ok & k_ok, other=0).to(tl.float32)
            x = tl.load(X + m[:, None] * sx + k0 + k[None, :], mask=m_ok & k_ok, other=0.0).to(tl.float32)
            if BLOCK_M >= 16:
                acc += tl.dot(x, tl.trans(w), input_precision=PREC)
            else:
                acc += tl.sum(x[:, None, :] * w[None, :, :], 2)
        if FMT == 1:  # int8: one scale per row of W is one per column of y, applied to the finished sums
            acc = acc * tl.load(S + n, mask=n < N, other=0.0)[None, :]
    tl.store(Y + m[:, None] * N + n[None, :], acc, mask=m_ok & (n < N)[None, :])


def tiles(fmt: str, B: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for B rows of x.

    Broadcast (B <= 8): the [M, N, K] product tile lives in registers, so M * N * K stays <= 8192 values
    (64 per thread at 4 warps); BLOCK_K 128 reads 64 int4 bytes / 128 int8 / 256 bf16 bytes per row per step.
    Small BLOCK_N gives a decode-sized N (1-10k) hundreds of programs to spread over the SMs.
    tl.dot (B > 8): rows padded to a power of two >= 16, up to 64 per program; 64 x 64 tiles.
    A GPU run may retune these (scripts/gpu_wlinear_check.py --sweep); the kernel is correct for any
    powers of two with BLOCK_K a multiple of 32 (int4) and BLOCK_M >= 16 or <= 8.
    """
    if B <= 8:
        bm = next_pow2(B)
        bn = 32 if bm <= 2 else 16
        return bm, bn, min(128, 8192 // (bm * bn))
    return min(64, max(16, next_pow2(B))), 64, 64


def linear_triton(x: torch.Tensor, w: QMatrix, *, precision: str = "ieee",
                  tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] (any float dtype) @ dequantize(w).T -> fp32 [..., N], w a bf16 / int8 / int4 QMatrix; x first
    through formats.quantize_activations when w.act_quant (formats.reference_linear's product).

    precision: how tl.dot multiplies fp32 tiles when B > 8 ("ieee" exact, "tf32x3" close to fp32 and faster);
    tile: (BLOCK_M, BLOCK_N, BLOCK_K) instead of `tiles(fmt, B)` (tuning).
    """
    if not isinstance(w, QMatrix):
        raise ConfigError(f"linear_triton takes a bf16/int8/int4 QMatrix, not {type(w).__name__} "
                          "(fp32 weights: use torch's F.linear)")
    if w.fmt not in FMTS:
        raise ConfigError(f"linear_triton: weight format {w.fmt!r} is not one of {', '.join(FMTS)}")
    if precision not in PRECISIONS:
        raise ConfigError(f"linear_triton: precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    N, K = w.shape
    if x.shape[-1] != K:
        raise ConfigError(f"linear_triton: x has {x.shape[-1]} features but the {w.fmt} weight is [{N}, {K}]")
    if not x.is_floating_point():
        raise ConfigError(f"linear_triton: x must be a float tensor, not {x.dtype}")
    devices = {x.device, w.data.device} | ({w.scale.device} if w.scale is not None else set())
    if len(devices) > 1:
        raise ConfigError(f"linear_triton: x and the weight are on different devices ({', '.join(map(str, devices))})")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(f"linear_triton on {x.device.type}: Triton runs on CPU only interpreted (TRITON_INTERPRET=1)")
    if w.fmt == "int8" and (w.scale is None or tuple(w.scale.shape) != (N,)):
        raise ConfigError(f"linear_triton: an int8 [{N}, {K}] weight needs a scale of shape [{N}]")
    if w.fmt == "int4":
        g = w.group
        if g <= 0 or g % INT4_BLOCK or K % g or w.scale is None or tuple(w.scale.shape) != (N, K // max(g, 1)):
            raise ConfigError(f"linear_triton: int4 [{N}, {K}] weight with group {g} needs a group that is a multiple "
                              f"of {INT4_BLOCK} dividing {K} and a scale of shape [{N}, {K} / group]")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if w.act_quant:
        x2 = quantize_activations(x2)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    data = w.data if w.data.stride(-1) == 1 else w.data.contiguous()  # rows() views keep unit column stride
    scale = data if w.scale is None else (w.scale if w.scale.stride(-1) == 1 else w.scale.contiguous())
    B = x2.shape[0]
    bm, bn, bk = tile or tiles(w.fmt, B)
    if (8 < bm < 16) or (w.fmt == "int4" and bk % INT4_BLOCK):
        raise ConfigError(f"linear_triton: tile {(bm, bn, bk)} needs BLOCK_M <= 8 or >= 16, and BLOCK_K a multiple "
                          f"of {INT4_BLOCK} for int4")
    y = torch.empty(B, N, device=x.device, dtype=torch.float32)
    if B and N:
        grid = (-(-N // bn), -(-B // bm))
        _wlinear_kernel[grid](x2, data, scale, y, B, N, K, max(w.group, 1), x2.stride(0), data.stride(0),
                              scale.stride(0) if w.fmt == "int4" else 0, FMT=FMTS[w.fmt], PREC=precision,
                              BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y.view(*lead, N)
