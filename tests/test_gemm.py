"""The tiled many-row CPU product (cpu_gemv.c: tl_gemm) against formats.reference_linear, and where the dispatcher
(kernels/linear.py) sends products of many rows."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tinyloop import formats
from tinyloop.errors import ConfigError
from tinyloop.kernels import cpu
from tinyloop.kernels.linear import linear


def tiled(x: torch.Tensor, w, **kw) -> torch.Tensor | None:
    """The tiled product; where it is unavailable (CPU kernels off, TINYLOOP_CPU_GEMM=0) the ConfigError the
    dispatcher relies on to keep the row kernels (then None: nothing tiled to compare)."""
    if cpu.gemm_available():
        return cpu.linear(x, w, tiled=True, **kw)
    with pytest.raises(ConfigError):
        cpu.linear(x, w, tiled=True, **kw)
    return None


# (fmt, N, K, group): N not a multiple of the panels (8 fp32 rows, 4 integer rows, 32 bf16 rows on AMX), K tails for
# fp32 / bf16 / int8 (100: not a multiple of 32, the int8 tail in fp32; 20: not one whole block, so act_quant int8 has
# nothing to quantise), int4 groups 32 and 64 and an odd count of 32-blocks (96); bf16 64 x 768: whole AMX panels,
# their tiles loaded straight from the stored rows; fp32 / int8 77: two super-panels of 64 rows (the 512-bit fp32
# tiles), the second partial; 29: 256-bit panels of 6 rows (for the last 2 x tiles) ending in one of 5.
SHAPES = [("fp32", 37, 100, 32), ("fp32", 29, 100, 32), ("int8", 29, 768, 32), ("fp32", 64, 768, 32), ("fp32", 77, 768, 32), ("bf16", 37, 200, 32),
          ("bf16", 21, 768, 32), ("bf16", 64, 768, 32), ("bf16", 37, 20, 32), ("int8", 37, 100, 32), ("int8", 77, 100, 32),
          ("int8", 33, 768, 32), ("int8", 37, 20, 32), ("int4", 37, 96, 32), ("int4", 64, 768, 64), ("int4", 21, 544, 32)]
# partial tiles of 16 rows, one and several 48-row tiles, several chunks; on AVX2 (tiles of 8 rows, groups of 3):
# 2 tiles, 4 (as 2 + 2), 5 (3 + 2), 7 (3 + 2 + 2)
ROWS = (1, 15, 29, 33, 48, 49, 100, 300)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).abs().max() / ref.abs().max()).item()


def make(fmt: str, N: int, K: int, group: int, act_quant: bool = False) -> formats.Matrix:
    w = formats.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.02, fmt, group)
    return dataclasses.replace(w, act_quant=True) if act_quant else w


CASES = [(*shape, act_quant) for shape in SHAPES for act_quant in (False, True)
         if not act_quant or shape[0] in ("int8", "int4")]  # activations are quantised for integer weights only


@pytest.mark.parametrize("fmt,N,K,group,act_quant", CASES)
def test_tiled_matches_reference(fmt, N, K, group, act_quant):
    w = make(fmt, N, K, group, act_quant)
    for B in ROWS:
        x = torch.randn(B, K, generator=torch.Generator().manual_seed(B))
        y = tiled(x, w)
        if y is None:
            return
        assert y.shape == (B, N)
        assert rel_err(y, formats.reference_linear(x, w)) < 1e-5, B


def test_tiled_in_a_long_chunk_of_rows():
    """Rows past one chunk of x tiles (about 1 MiB: 512 fp32 rows of K = 2048 are four chunks) come out right."""
    w = make("fp32", 24, 2048, 32)
    x = torch.randn(512, 2048, generator=torch.Generator().manual_seed(1))
    y = tiled(x, w)
    assert y is None or rel_err(y, formats.reference_linear(x, w)) < 1e-5


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_tiled_threads_agree(fmt):
    """Threads split the weight rows, never the K sum: the thread count changes no bit."""
    w = make(fmt, 101, 256, 32, act_quant=fmt in ("int8", "int4"))
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(2))
    one = tiled(x, w, threads=1)
    assert one is None or torch.equal(one, tiled(x, w, threads=2))


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_tiled_row_view(fmt):
    """QMatrix.rows(a, b) (the k|v rows of a fused qkv) multiplies as the rows it stands for."""
    w = make(fmt, 96, 256, 32)
    part = w[40:71] if fmt == "fp32" else w.rows(40, 71)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(3))
    y = tiled(x, part)
    assert y is None or rel_err(y, formats.reference_linear(x, w)[:, 40:71]) < 1e-5


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_dispatcher_sends_many_rows_to_the_tiles(fmt):
    """Up to the 32 lanes the batch-invariant row kernels run; past them the tiles (where the CPU has them, else the
    row kernels); any_rows keeps the row kernels."""
    w = make(fmt, 48, 256, 32, act_quant=fmt in ("int8", "int4"))
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(4))
    many = tiled(x, w)
    assert torch.equal(linear(x, w), cpu.linear(x, w) if many is None else many)
    assert torch.equal(linear(x[:32], w), cpu.linear(x[:32], w))
    assert torch.equal(linear(x, w, any_rows=True), cpu.linear(x, w))


def test_dispatcher_keeps_autograd():
    """A product that trains (x or W needs a gradient) stays torch's, so gradients flow."""
    g = torch.Generator().manual_seed(5)
    W = (torch.randn(48, 64, generator=g) * 0.02).requires_grad_()
    x = torch.randn(40, 64, generator=g)
    linear(x, W).sum().backward()
    # the gradient is a product too (ones^T x, its own summation order): equal to the plain sum to fp32 rounding
    assert W.grad is not None and torch.allclose(W.grad, x.sum(0).expand(48, 64), atol=1e-5)


def test_tiled_where_unavailable_raises(monkeypatch):
    """tiled=True without the tiles is a ConfigError, never a wrong product."""
    assert cpu.available(), "the CPU kernels must build here (a C compiler: setup_env.sh)"
    monkeypatch.setattr(cpu, "_gemm", False)
    with pytest.raises(ConfigError):
        cpu.linear(torch.randn(40, 64), torch.randn(8, 64), tiled=True)
    x, W = torch.randn(40, 64), torch.randn(8, 64)
    assert rel_err(linear(x, W), x @ W.T) < 1e-5  # the dispatcher falls back to torch


def test_tiles_wherever_the_kernels_run():
    """The tiles need only what the row kernels need (AVX2 + FMA): 512-bit tiles where AVX-512 VNNI is compiled in
    and present, else 256-bit ones; TINYLOOP_CPU_GEMM=0 switches them off on every call."""
    assert cpu.available(), "the CPU kernels must build here (a C compiler: setup_env.sh)"
    assert cpu.gemm_available() and cpu.gemm_isa() in (256, 512)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINYLOOP_CPU_GEMM", "0")
        assert not cpu.gemm_available() and cpu.gemm_isa() == 0
        with pytest.raises(ConfigError):
            cpu.linear(torch.randn(40, 64), torch.randn(8, 64), tiled=True)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_tiled_integer_sums_at_the_extremes(fmt):
    """Every weight at the format's largest code and every x value at +-127 after rounding: the largest block sums
    (AVX2 int4 adds a block's 32 products in int16: 8 x 2 x 15 x 127 = 30480 < 2^15) come out exact."""
    K = 256
    w = make(fmt, 24, K, 32, act_quant=True)
    w = dataclasses.replace(w, data=torch.full_like(w.data, 0xFF if fmt == "int4" else 127))
    for sign in (1.0, -1.0):
        x = torch.full((40, K), sign)
        y = tiled(x, w)
        assert y is None or rel_err(y, formats.reference_linear(x, w)) < 1e-5  # a wrapped sum is off by far more


def test_tiled_bf16_keeps_x_in_fp32():
    """bf16 weights on AMX tiles split x into three bf16 parts: the product is fp32's to about 1e-6, where x rounded to
    bf16 once would be off by ~1e-3. x spans six orders of magnitude within each row, so a lost part shows."""
    K = 768
    w = make("bf16", 96, K, 32)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(200, K, generator=g) * 10.0 ** torch.randint(-3, 3, (200, K), generator=g)
    y = tiled(x, w)
    if y is None:
        return
    ref = formats.reference_linear(x, w)
    assert rel_err(y, ref) < 2e-6
    rounded = formats.reference_linear(x.bfloat16().float(), w)  # what one bf16 part would give
    assert rel_err(rounded, ref) > 1e-4


def test_gemm_amx_where_the_cpu_has_it():
    """AMX runs only under the 512-bit tiles, and where /proc/cpuinfo lists amx_bf16 Linux normally grants it."""
    if not cpu.gemm_available():
        assert not cpu.gemm_isa()
        return
    amx = cpu.gemm_amx()
    assert not amx or cpu.gemm_isa() == 512
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    if cpu.gemm_isa() == 512 and "amx_bf16" in flags and "amx_tile" in flags:
        assert amx


def test_act_quant_rounds_as_the_kernels_at_a_near_tie():
    """x * (127 / max) is -46.5 with IEEE division and -46.500004 with torch's scalar-over-tensor division (a
    reciprocal times 127): formats.quantize_activations divides as the kernels do, so q is -46 (half to even) in
    every path, and the product of the identity equals the reference's rounded x."""
    K = 64
    x = torch.zeros(40, K)
    x[:, 0], x[:, 1] = 3.000990867614746, -1.0987880229949951
    x[:, 32:] = torch.randn(40, 32, generator=torch.Generator().manual_seed(7))
    q = formats.quantize_activations(x)
    d = 3.000990867614746 / 127
    assert abs(q[0, 1].item() / d - -46) < 1e-3
    eye = dataclasses.replace(formats.quantize(torch.eye(K), "int8", 32), act_quant=True)
    for y in (cpu.linear(x, eye), tiled(x, eye)):
        if y is not None:
            assert (y - q).abs().max().item() < 1e-6  # one step of q is d = 0.024


def test_bf16_rows_on_amx_are_batch_invariant_and_keep_x_in_fp32():
    """Where bf16 rows run on AMX (cpu.rows_amx), x's parts lie as columns of one tile up to 5 rows and as tiles of
    their own past that, each summed on its own: a row has the same bits alone, in any batch up to the lanes and in a
    product of 80 rows (chunks of 32), and x keeps its three bf16 parts (x spans six orders of magnitude, as above).
    Without AMX the rows keep the fp32 row kernels."""
    if not cpu.rows_amx():
        assert not cpu.gemm_amx() or os.environ.get("TINYLOOP_CPU_AMX") == "0"
        return
    K = 200  # not a multiple of 32: the zero-padded panel and x tails
    w = make("bf16", 75, K, 32)  # 75 rows: two whole panels of 32 and a padded one
    g = torch.Generator().manual_seed(8)
    x = torch.randn(80, K, generator=g) * 10.0 ** torch.randint(-3, 3, (80, K), generator=g)
    alone = torch.cat([cpu.linear(x[i:i + 1], w) for i in range(80)])
    assert rel_err(alone, formats.reference_linear(x, w)) < 2e-6
    for B in (2, 5, 6, 16, 17, 32, 80):
        for t in (1, 2):
            assert torch.equal(cpu.linear(x[80 - B:], w, threads=t), alone[80 - B:]), (B, t)
    cpu.set_amx_rows(False)  # the row kernels: the same product to fp32 rounding, not the same bits
    try:
        rows = torch.cat([cpu.linear(x[i:i + 1], w) for i in range(4)])
        assert rel_err(rows, alone[:4]) < 2e-6 and not torch.equal(rows, alone[:4])
    finally:
        cpu.set_amx_rows(True)
