"""The peers bench's matmul peak and prefill ratios (scripts/bench/peers.py, docs/kernels.md "Peers"): what each
row's "of peak" divides by, and which rows each TinyLoop prefill row is held against."""
from __future__ import annotations

import pytest

from scripts.bench.peers import matmul_peak, of_peak, prefill_ratios
from tinyloop.kernels import cpu


def test_matmul_peak_is_the_faster_of_torch_and_the_tiles():
    peak = matmul_peak(n=128, repeats=1)
    assert {"fp32_torch", "bf16_torch", "fp32", "bf16"} <= set(peak)
    assert ("fp32_tiled" in peak) == ("bf16_tiled" in peak) == cpu.gemm_available()
    for fmt in ("fp32", "bf16"):
        parts = [v for k, v in peak.items() if k.startswith(f"{fmt}_")]
        assert all(v > 0 for v in parts) and peak[fmt] == max(parts)


def test_rows_as_a_fraction_of_the_peak():
    peak = {"fp32": 50e9, "bf16": 25e9}
    fp32, bf16 = {"format": "fp32", "flop_s": 10e9}, {"format": "bf16", "flop_s": 10e9}
    of_peak(fp32, peak)
    of_peak(bf16, peak)
    assert fp32["peak_fraction"] == pytest.approx(0.2) and "bf16_peak_fraction" not in fp32
    assert bf16["peak_fraction"] == pytest.approx(0.2) and bf16["bf16_peak_fraction"] == pytest.approx(0.4)


def test_prefill_ratios_hold_each_format_against_its_own_peers():
    rows = [{"config": "c", "system": s, "format": f, "prompt_len": 40, "tok_s": t} for s, f, t in (
        ("tinyloop", "fp32", 300.0), ("tinyloop", "fp32 (no tiles)", 150.0), ("tinyloop", "int8", 600.0),
        ("tinyloop", "int8 (no tiles)", 100.0), ("transformers", "fp32", 200.0), ("llama.cpp", "Q8_0", 400.0))]
    got = {(r["tinyloop"], r["against"]): r["ratio"] for r in prefill_ratios(rows)}
    assert got == pytest.approx({("fp32", "tinyloop fp32 (no tiles)"): 2.0, ("fp32", "transformers fp32"): 1.5,
                                 ("int8", "tinyloop int8 (no tiles)"): 6.0, ("int8", "tinyloop fp32"): 2.0,
                                 ("int8", "llama.cpp Q8_0"): 1.5, ("int8", "transformers fp32"): 3.0})
