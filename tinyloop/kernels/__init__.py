"""Triton kernels for the decode hot path, each beside its plain torch reference (docs/kernels.md).

  attention.py  decode attention over the stored cache layout, fp16 / int8 / int4 store-h
  quant.py      quantise-on-write into the int8 and int4 caches
  norm.py       residual add + RMSNorm
  rope.py       rotary embedding at per-token positions
  dispatch.py   Triton on CUDA, torch on CPU; TINYLOOP_TRITON=1 forces Triton (interpreted on CPU)
  lean.py       the lean decode step (fewer ops, fused and optionally packed weights, CUDA graph on CUDA)

The kernel modules import triton; nothing here is imported by `import tinyloop` except dispatch.
"""
