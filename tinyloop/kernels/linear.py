"""The product every cached forward multiplies its matrices by: y = x @ W^T in fp32, W in any weight format.

Which implementation runs (the weights are held once, in their format's layout, tinyloop/formats.py):
  CUDA, Triton on    bf16/int8/int4: tinyloop/kernels/wlinear.py; fp32: cuBLAS (F.linear)
  CPU, few rows      tinyloop/kernels/cpu.py's kernels (weights streamed once for all rows, both cores), up to
                     cpu.max_rows(format) = 32 rows, the engine's lane cap: their result for a row does not depend
                     on the batch it is in, so a decode step gives a request the same bits alone or batched
  CPU, more rows     cpu.py's tiled GEMM (tl_gemm), for every format: prefill chunks and batches past the lanes are
                     compute-bound. AVX-512 + VNNI: x rows in tiles of 16, each weight broadcast over 48 rows,
                     act_quant int8/int4 on integer dot products, bf16 on AMX tiles where the CPU has them (x split
                     into three bf16 parts, so still fp32's product); AVX2 + FMA (any CPU the kernels run on): tiles of 8
                     rows, each weight over 24, blocked by 64 weight rows and 256 of K as BLIS blocks, act_quant int4
                     on integers (maddubs, int16 sums per block), the rest on fp32 fmas over widened blocks. At MKL's
                     fp32 rate or above (docs/kernels.md). Not the row
                     kernels' summation order, hence only past the lanes.
  CPU, more rows,    fp32: MKL (F.linear); bf16/int8/int4: widened to fp32 per product, then MKL; an act_quant
  TINYLOOP_CPU_GEMM=0  matrix's rows are quantised first (formats.reference_linear): every path computes one product
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..formats import Matrix, QMatrix, reference_linear
from . import cpu
from .dispatch import use_triton


def linear(x: torch.Tensor, w: Matrix, any_rows: bool = False) -> torch.Tensor:
    """x [..., K] @ w.T -> [..., N] in x's dtype. any_rows: on the CPU, the batch-invariant kernels for any number
    of rows, for products whose row count depends on the batch (the int4 store-h cache recomputes K and V from the
    gathered h of all lanes: a lane's keys must not change with who else is in the batch)."""
    lead, K = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, K)
    if isinstance(w, QMatrix) and w.fmt == "int4" and w.padded_width != K:  # kernels see the zero-padded width
        rows, w = w.pad(rows), dataclasses.replace(w, width=w.padded_width)
    return _product(rows, w, any_rows).to(x.dtype).view(*lead, -1)


def _product(x: torch.Tensor, w: Matrix, any_rows: bool = False) -> torch.Tensor:
    on_cpu = x.device.type == "cpu"
    fmt = w.fmt if isinstance(w, QMatrix) else "fp32"
    c_kernel = on_cpu and (any_rows or x.shape[0] <= cpu.max_rows(fmt)) and cpu.available()
    if on_cpu and not c_kernel and _tiled_ok(x, w):
        return cpu.linear(x, w, tiled=True)
    if isinstance(w, torch.Tensor):
        if c_kernel and w.dtype == torch.float32:
            return cpu.linear(x.float(), w)
        return F.linear(x, w)
    if not on_cpu and use_triton(x.device):
        from .wlinear import linear_triton
        return linear_triton(x, w)
    if c_kernel:
        return cpu.linear(x.float(), w)
    return reference_linear(x, w)


def _tiled_ok(x: torch.Tensor, w: Matrix) -> bool:
    """The tiled GEMM takes fp32 rows and no autograd (a product that trains keeps torch's)."""
    wt = w if isinstance(w, torch.Tensor) else None
    if x.dtype != torch.float32 or (wt is not None and wt.dtype != torch.float32):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (wt is not None and wt.requires_grad)):
        return False
    return cpu.gemm_available()
