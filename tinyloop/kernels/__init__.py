"""Triton kernels for the decode hot path, each beside its plain torch reference (docs/kernels.md).

  attention.py  decode attention over the stored cache layout, fp16 / int8 / int4 store-h
  quant.py      quantise-on-write into the int8 and int4 caches
  norm.py       residual add + RMSNorm
  rope.py       rotary embedding at per-token positions
  dispatch.py   Triton on CUDA, torch on CPU; TINYLOOP_TRITON=1 forces Triton (interpreted on CPU)
  linear.py     x @ W^T in the weight's format: the CPU products below, Triton (wlinear.py) on CUDA
  cpu.py        CPU products x @ W^T for every weight format (fp32 / bf16 / int8 / int4) at decode batch sizes:
                cpu_gemv.c (AVX2 + FMA, OpenMP), compiled with the system C compiler at first use
  cpu_block.py  a CPU decode step's blocks as C calls, one per loop pass (cpu_block.c, built into the same library)

Kernels sit below the model and the engine that call them: they import only the runtime's core (errors, formats,
the cache layout, tinyloop/rotary.py), never the model, the engine or the loader. The forward that drives them over
the paged cache is tinyloop/engine/forward.py. The Triton modules import triton; the engine loads them lazily.
"""
