"""tinyloop/kernels/cpu.py: the compiled CPU products against formats.reference_linear, for every format."""
from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch

from tinyloop import formats
from tinyloop.errors import ConfigError
from tinyloop.kernels import cpu



def machine_can_build() -> bool:
    """A C compiler on PATH and a CPU with AVX2 and FMA: what the kernels need. Where both are present the kernels
    must build (test_kernels_build_where_the_machine_can), so a broken build fails here instead of skipping."""
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        return False
    return shutil.which(os.environ.get("CC", "cc")) is not None and "avx2" in flags and "fma" in flags


needs_kernels = pytest.mark.skipif(not machine_can_build(), reason="no C compiler, or a CPU without AVX2 and FMA")


@needs_kernels
def test_kernels_build_where_the_machine_can():
    assert cpu.available()

# (N, K, group): odd N (a one-row tile at the end), K = 100 / 200 (not a multiple of 8 / 64: the tails),
# K = 96 (an odd number of 32-blocks: the unpaired int4 block), groups 32 and 64; int4 K = 544 (group 32: two
# octets of 8 blocks, then the unpaired block) and 768 (octets only).
SHAPES = {
    "fp32": [(37, 100, 32), (64, 768, 32)],
    "bf16": [(37, 100, 32), (64, 200, 32)],
    "int8": [(37, 100, 32), (64, 200, 32), (33, 768, 32)],
    "int4": [(37, 96, 32), (64, 768, 64), (33, 192, 64), (21, 544, 32), (35, 768, 32)],
}
CASES = [(fmt, *shape) for fmt, shapes in SHAPES.items() for shape in shapes]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Max error relative to the output scale (what fp32 rounding of a K-term sum is proportional to)."""
    return ((y - ref).abs().max() / ref.abs().max()).item()


def make(fmt, N, K, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    return formats.quantize(torch.randn(N, K, generator=g) * 0.02, fmt, group)


@needs_kernels
@pytest.mark.parametrize("fmt,N,K,group", CASES)
@pytest.mark.parametrize("B", [1, 3, 16])
def test_matches_reference(fmt, N, K, group, B):
    w = make(fmt, N, K, group)
    x = torch.randn(B, K, generator=torch.Generator().manual_seed(1))
    ref = formats.reference_linear(x, w)
    y = cpu.linear(x, w)
    assert y.shape == (B, N) and y.dtype == torch.float32
    assert rel_err(y, ref) < 1e-5
    if fmt in ("int8", "int4"):  # quantised activations: ~1/254 per x value, averaged over K terms
        assert rel_err(cpu.linear(x, w, act_quant=True), ref) < 2e-2
        # an act_quant matrix: the integer product is its reference (x through quantize_activations) to rounding
        w_aq = dataclasses.replace(w, act_quant=True)
        ref_aq = formats.reference_linear(x, w_aq)
        assert rel_err(cpu.linear(x, w_aq), ref_aq) < 1e-5 and rel_err(ref_aq, ref) > 1e-5


@needs_kernels
@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_act_quant_is_close_not_exact(fmt):
    """act_quant really quantises x (a different, close result) for int8 / int4; fp32 / bf16 ignore it."""
    w = make(fmt, 64, 256, 32)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    ref, y = formats.reference_linear(x, w), cpu.linear(x, w, act_quant=True)
    err = rel_err(y, ref)
    if fmt in ("int8", "int4"):
        assert 1e-5 < err < 2e-2
    else:
        assert err < 1e-5


@needs_kernels
@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_row_view(fmt):
    """QMatrix.rows(a, b) (the k|v rows of a fused qkv) multiplies as the rows it stands for."""
    w = make(fmt, 96, 256, 32)
    part = w[40:71] if fmt == "fp32" else w.rows(40, 71)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    assert rel_err(cpu.linear(x, part), formats.reference_linear(x, w)[:, 40:71]) < 1e-5


@needs_kernels
@pytest.mark.parametrize("fmt", formats.FORMATS)
@pytest.mark.parametrize("act_quant", [False, True])
def test_threads_agree(fmt, act_quant):
    """Rows are split across threads, never the K sum, so the thread count cannot change a single bit."""
    w = make(fmt, 101, 256, 32)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    assert torch.equal(cpu.linear(x, w, threads=1, act_quant=act_quant),
                       cpu.linear(x, w, threads=2, act_quant=act_quant))


# Batch invariance: (format, N, K, group, view) with K not a multiple of 16 / 8 where the format allows it
# (fp32 / bf16 / int8 tails), int4 groups 32 and 64 (K = 96: an odd number of 32-blocks; K = 320: an octet of
# blocks, then a pair), odd N (a lone last weight row) and a QMatrix.rows view (rows of a fused matrix, its own
# strides); K = 1040 walks past the K blocks of the 512-bit fp32 / bf16 tiles (256 on Intel, 1024 on AMD).
INVARIANCE = [("fp32", 37, 100, 32, False), ("fp32", 20, 776, 32, True), ("fp32", 19, 1040, 32, False),
              ("bf16", 37, 200, 32, False), ("bf16", 21, 104, 32, True), ("bf16", 20, 1040, 32, True), ("int8", 37, 100, 32, False), ("int8", 21, 776, 32, True),
              ("int4", 37, 96, 32, False), ("int4", 21, 192, 64, True), ("int4", 19, 320, 32, True)]
BATCHES = (1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 32)


@needs_kernels
@pytest.mark.parametrize("fmt,N,K,group,view,act_quant",  # act_quant is for int8 / int4 weights only
                         [(*case, a) for case in INVARIANCE for a in (False, True) if not a or case[0] in ("int8", "int4")])
def test_batch_invariant(fmt, N, K, group, view, act_quant):
    """Every row of a B-row product has the bits of the same row multiplied alone, for every B up to the engine's
    32 lanes, whichever tile and thread it lands on (continuous batching must not change a request's tokens)."""
    w = make(fmt, N + 7 if view else N, K, group)
    if view:
        w = w[3:3 + N] if fmt == "fp32" else w.rows(3, 3 + N)
    x = torch.randn(32, K, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([cpu.linear(x[i:i + 1], w, threads=1, act_quant=act_quant) for i in range(32)])
    if not act_quant:
        assert rel_err(alone, formats.reference_linear(x, w)) < 1e-5
    for B in BATCHES:
        for t in (1, 2):
            for start in (0, 32 - B):  # the same rows at the front and at the back of a batch
                y = cpu.linear(x[start:start + B], w, threads=t, act_quant=act_quant)
                assert torch.equal(y, alone[start:start + B]), (B, t, start)


@needs_kernels
@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_batch_invariant_beyond_the_lane_cap(fmt):
    """cpu.linear itself takes any B (the dispatcher stops at 32): the rows of a 77-row product are still the
    rows multiplied alone."""
    w = make(fmt, 23, 128, 32)
    x = torch.randn(77, 128, generator=torch.Generator().manual_seed(6))
    y = cpu.linear(x, w)
    for i in (0, 40, 76):
        assert torch.equal(y[i:i + 1], cpu.linear(x[i:i + 1], w))
    assert rel_err(y, formats.reference_linear(x, w)) < 1e-5


@needs_kernels
@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_any_rows_keeps_a_row_the_same_in_a_large_product(fmt):
    """kernels.linear(any_rows=True), used where the row count depends on the batch (the int4 store-h cache's K/V
    recompute over every lane's cells): a row has its bits alone and among 80 rows, past the 32 rows where the
    dispatcher would otherwise hand the product to torch."""
    from tinyloop.kernels.linear import linear

    w = make(fmt, 48, 96, 32)
    x = torch.randn(80, 96, generator=torch.Generator().manual_seed(7))
    many = linear(x, w, any_rows=True)
    for i in (0, 33, 79):
        assert torch.equal(many[i:i + 1], linear(x[i:i + 1], w))
    assert rel_err(many, formats.reference_linear(x, w)) < 1e-5


@needs_kernels
def test_strided_x_is_made_contiguous():
    w = make("int8", 16, 64, 32)
    xt = torch.randn(64, 3).t()  # [3, 64], not contiguous
    assert rel_err(cpu.linear(xt, w), formats.reference_linear(xt.contiguous(), w)) < 1e-5


@needs_kernels
def test_bad_inputs_raise_config_error():
    w = make("int4", 16, 64, 32)
    with pytest.raises(ConfigError, match="width"):
        cpu.linear(torch.randn(2, 32), w)
    with pytest.raises(ConfigError, match="float32"):
        cpu.linear(torch.randn(2, 64, dtype=torch.float64), w)
    with pytest.raises(ConfigError, match="float32"):
        cpu.linear(torch.randn(64), w)
    bad = formats.QMatrix("int4", w.data, w.scale[:, :1].contiguous(), 32, 64)
    with pytest.raises(ConfigError, match="scale"):
        cpu.linear(torch.randn(2, 64), bad)
    with pytest.raises(ConfigError, match="strided"):
        cpu.linear(torch.randn(2, 16), torch.randn(16, 16).t())
    with pytest.raises(ConfigError):
        cpu.max_rows("int2")


@needs_kernels
def test_one_openmp_runtime():
    """The kernels run on torch's own libgomp (one thread pool), not a second copy from the system compiler."""
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomp) == 1, gomp


@needs_kernels
def test_stream_bandwidth_is_positive():
    assert cpu.stream_bandwidth(8 << 20, repeats=1) > 0


def test_switch_off(monkeypatch, caplog):
    monkeypatch.setenv("TINYLOOP_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu, "_warned_off", False)
    with caplog.at_level("WARNING", logger="tinyloop.kernels.cpu"):
        assert not cpu.available()
        assert not cpu.available()
    assert len([r for r in caplog.records if "TINYLOOP_CPU_KERNELS=0" in r.getMessage()]) == 1
    monkeypatch.setattr(cpu, "_state", "unknown")  # not loaded yet: linear() refuses too
    with pytest.raises(ConfigError, match="not available"):
        cpu.linear(torch.randn(1, 64), torch.randn(8, 64))


def test_failed_build_logs_one_warning_and_reports_unavailable(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu, "_state", "unknown")
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setenv("TINYLOOP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-tinyloop")
    with caplog.at_level("WARNING", logger="tinyloop.kernels.cpu"):
        assert not cpu.available()
        assert not cpu.available()
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1


# The build's cache by content (one library per source, flags, compiler and CPU, renamed into place) is checked
# beside the worker's cold build in test_worker_speed_budget.py: one cold build (40 s here) proves both.


@needs_kernels
def test_huge_pages_keep_the_contents(monkeypatch):
    """Backing weights by 2 MiB pages (where Linux allows) changes no value, collapses whole huge pages only, and
    TINYLOOP_HUGEPAGES=0 leaves memory alone."""
    t = torch.randn(3 << 20)  # 12 MiB: at least four whole huge pages inside
    before = t.clone()
    done = cpu.huge_pages(t)
    assert done % (2 << 20) == 0 and 0 <= done <= t.numel() * 4 + (4 << 20)
    assert torch.equal(t, before)
    monkeypatch.setenv("TINYLOOP_HUGEPAGES", "0")
    assert cpu.huge_pages(torch.randn(3 << 20)) == 0
