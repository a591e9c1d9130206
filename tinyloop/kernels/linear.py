"""The product every cached forward multiplies its matrices by: y = x @ W^T in fp32, W in any weight format.

Which implementation runs (the weights are held once, in their format's layout, tinyloop/formats.py):
  CUDA, Triton on    bf16/int8/int4: tinyloop/kernels/wlinear.py; fp32: cuBLAS (F.linear)
  CPU, few rows      tinyloop/kernels/cpu.py's kernels (weights streamed once for all rows, both cores), up to
                     cpu.max_rows(format) = 32 rows, the engine's lane cap: their result for a row does not depend
                     on the batch it is in, so a decode step gives a request the same bits alone or batched
  CPU, more rows     fp32: MKL (F.linear); bf16/int8/int4: widened to fp32 per product, then MKL (a prefill chunk
                     is compute-bound, so the widening is paid once for all its rows; torch's int8 weight-only
                     GEMM took 634 ms where this takes 16, 256 rows x a 4096 x 768 matrix)
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..formats import Matrix, QMatrix, dequantize
from . import cpu
from .dispatch import use_triton


def linear(x: torch.Tensor, w: Matrix) -> torch.Tensor:
    """x [..., K] @ w.T -> [..., N] in x's dtype."""
    lead, K = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, K)
    if isinstance(w, QMatrix) and w.fmt == "int4" and w.padded_width != K:  # kernels see the zero-padded width
        rows, w = w.pad(rows), dataclasses.replace(w, width=w.padded_width)
    return _product(rows, w).to(x.dtype).view(*lead, -1)


def _product(x: torch.Tensor, w: Matrix) -> torch.Tensor:
    on_cpu = x.device.type == "cpu"
    if isinstance(w, torch.Tensor):
        if on_cpu and w.dtype == torch.float32 and x.shape[0] <= cpu.max_rows("fp32") and cpu.available():
            return cpu.linear(x.float(), w)
        return F.linear(x, w)
    if not on_cpu and use_triton(x.device):
        from .wlinear import linear_triton
        return linear_triton(x, w)
    if on_cpu and x.shape[0] <= cpu.max_rows(w.fmt) and cpu.available():
        return cpu.linear(x.float(), w)
    return F.linear(x.float(), dequantize(w))
