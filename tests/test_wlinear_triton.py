"""The Triton weight-only products (tinyloop/kernels/wlinear.py) against formats.reference_linear.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (set below, before it is first launched: lazy_jit decorates
it then). B = 1 and 5 take the broadcast path, B = 20 the tl.dot path; K = 96 leaves a partial K tile.
"""
from __future__ import annotations

import dataclasses

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tinyloop import formats  # noqa: E402
from tinyloop.errors import ConfigError  # noqa: E402
from tinyloop.formats import QMatrix  # noqa: E402
from tinyloop.kernels.wlinear import linear_triton  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FORMATS = [("bf16", 0), ("int8", 0), ("int4", 32), ("int4", 64)]
SHAPES = [(48, 64), (48, 128), (40, 96)]  # (N, K); 40 x 96: N and K both leave partial tiles
# rms(quantised product - fp32 product) / rms(fp32 product) for Gaussian weights: a kernel that drops or
# misplaces the scales, or multiplies by the unquantised weights, lands outside these bands
QUANT_ERROR = {"bf16": (3e-4, 6e-3), "int8": (1.5e-3, 2e-2), "int4": (3e-2, 0.3)}


def check(x: torch.Tensor, q: QMatrix, w: torch.Tensor | None = None, **kw) -> torch.Tensor:
    """Kernel vs reference within the fp32 dot-product error bound K * eps * (|x| @ |W|^T), which is far below
    any quantisation error; with the original weights w, also check the quantisation error is of the format's order."""
    got = linear_triton(x, q, **kw)
    dq = formats.dequantize(q)
    want = formats.reference_linear(x, q)
    assert got.dtype == torch.float32 and got.shape == want.shape
    bound = 1e-5 * (x.float().abs() @ dq.abs().T) + 1e-7  # K <= 128: K * 2^-24 < 1e-5
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()
    if w is not None:
        exact = x.float() @ w.T
        rel = ((got - exact).norm() / exact.norm()).item()
        lo, hi = QUANT_ERROR[q.fmt]
        assert lo < rel < hi, f"{q.fmt}: relative error {rel:.2e} vs the fp32 weights is not in ({lo}, {hi})"
        assert bound.max() < 0.1 * (want - exact).abs().max()  # the tolerance cannot hide a quantisation error
    return got


@pytest.mark.parametrize("fmt,group", FORMATS, ids=[f"{f}{g or ''}" for f, g in FORMATS])
@pytest.mark.parametrize("B", (1, 5, 20))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"n{s[0]}k{s[1]}")
def test_matches_reference(fmt, group, B, shape):
    N, K = shape
    torch.manual_seed(N * K + B)
    w = torch.randn(N, K, device=DEV)
    q = formats.quantize(w, fmt, group or formats.DEFAULT_GROUP)
    x = torch.randn(B, K, device=DEV)
    if K % max(group, 1):  # stored zero-padded: the kernel gets x padded and the padded width (kernels/linear.py)
        got = check(q.pad(x), dataclasses.replace(q, width=q.padded_width), None)
        torch.testing.assert_close(got, formats.reference_linear(x, q), atol=1e-4, rtol=1e-4)
        return
    check(x, q, w)


@pytest.mark.parametrize("fmt,group", FORMATS, ids=[f"{f}{g or ''}" for f, g in FORMATS])
@pytest.mark.parametrize("B", (1, 20))
def test_row_view(fmt, group, B):
    """QMatrix.rows(a, b) (the fused q|k|v matrix's k|v rows): data and scales start mid-tensor."""
    torch.manual_seed(3)
    full = formats.quantize(torch.randn(112, 128, device=DEV), fmt, group or formats.DEFAULT_GROUP)
    view = full.rows(40, 88)
    x = torch.randn(B, 128, device=DEV)
    check(x, view)
    torch.testing.assert_close(linear_triton(x, view), linear_triton(x, full)[:, 40:88], rtol=1e-4, atol=1e-4)


def test_input_layouts():
    """Leading dims, a bf16 x (widened in the kernel), a strided x, an explicit tile and the tf32x3 precision."""
    torch.manual_seed(5)
    q = formats.quantize(torch.randn(48, 128, device=DEV), "int4", 32)
    x = torch.randn(2, 3, 128, device=DEV)
    assert check(x, q).shape == (2, 3, 48)
    check(x.to(torch.bfloat16), q)
    wide = torch.randn(5, 160, device=DEV)[:, 16:144]  # row stride 160, not 128
    check(wide, q)
    check(wide, q, tile=(2, 16, 32))
    check(torch.randn(20, 128, device=DEV), q, precision="tf32x3", tile=(16, 16, 32))


def test_bad_inputs_raise(monkeypatch):
    q = formats.quantize(torch.randn(48, 64, device=DEV), "int8")
    x = torch.randn(2, 64, device=DEV)
    with pytest.raises(ConfigError, match="features"):
        linear_triton(torch.randn(2, 32, device=DEV), q)
    with pytest.raises(ConfigError, match="different devices"):
        linear_triton(torch.randn(2, 64, device="meta"), q)
    with pytest.raises(ConfigError, match="QMatrix"):
        linear_triton(x, torch.randn(48, 64, device=DEV))  # fp32 weights: F.linear's job
    with pytest.raises(ConfigError, match="format 'fp8'"):
        linear_triton(x, QMatrix("fp8", q.data, q.scale))
    with pytest.raises(ConfigError, match="float"):
        linear_triton(x.long(), q)
    with pytest.raises(ConfigError, match="precision"):
        linear_triton(x, q, precision="fp16")
    with pytest.raises(ConfigError, match="scale"):
        linear_triton(x, QMatrix("int8", q.data, q.scale[:10]))
    q4 = formats.quantize(torch.randn(48, 64, device=DEV), "int4", 32)
    with pytest.raises(ConfigError, match="group"):
        linear_triton(x, QMatrix("int4", q4.data, q4.scale, 48, 64))
    with pytest.raises(ConfigError, match="tile"):
        linear_triton(x, q4, tile=(12, 16, 32))
    if DEV.type == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
            linear_triton(x, q)


@pytest.mark.parametrize("fmt,group", [("int8", 0), ("int4", 32)])
def test_act_quant_matrices_quantise_x_first(fmt, group):
    """An act_quant matrix (load_model(act_quant=True) on CUDA) multiplies formats.quantize_activations(x), as the
    CPU kernels do: its reference, not the weight-only product."""
    torch.manual_seed(3)
    q = dataclasses.replace(formats.quantize(torch.randn(48, 96, device=DEV), fmt, group or 32), act_quant=True)
    x = torch.randn(5, 96, device=DEV)
    got = check(x, q)
    assert (got - formats.reference_linear(x, dataclasses.replace(q, act_quant=False))).abs().max() > 1e-3
