"""Compile and time the Triton weight-only products (tinyloop/kernels/wlinear.py) on CUDA.

    .venv/bin/python scripts/gpu_wlinear_check.py            # check + time, ~1-2 min on one GPU
    .venv/bin/python scripts/gpu_wlinear_check.py --sweep    # also try a few tiles per case (+ ~2-3 min)
    .venv/bin/python scripts/gpu_wlinear_check.py --json out.json

Per (format, N x K, B): the largest error against formats.reference_linear relative to max|reference|, and
the median time of
  triton       linear_triton (default tiles, precision "ieee")
  tf32x3       linear_triton with tl.dot's "tf32x3" (B > 8 only: the broadcast path has no tl.dot)
  deq+mm       torch: F.linear(x, dequantize(w)), the reference path (dequantises every call)
  mm fp32      torch: F.linear(x, w_fp32) with the weights already dequantised (reads 4 bytes a weight)
  mm bf16      torch: F.linear(x.bf16, w_bf16), cuBLAS on bf16 (2 bytes a weight; not fp32-accurate)
with the stored weight bytes per triton microsecond (GB/s; H200 HBM3e peaks near 4800). Without CUDA it runs
tiny shapes under TRITON_INTERPRET=1 as a smoke test of this script (times meaningless).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch.nn.functional as F  # noqa: E402

from tinyloop import formats  # noqa: E402
from tinyloop.kernels.wlinear import linear_triton, tiles  # noqa: E402

FORMATS = [("bf16", 0), ("int8", 0), ("int4", 32), ("int4", 128)]
SHAPES = [(4096, 4096), (14336, 4096)] if CUDA else [(64, 128)]
BATCHES = (1, 4, 16, 64) if CUDA else (1, 20)
SWEEP_SMALL = [(None, 16, 64), (None, 16, 128), (None, 32, 128), (None, 64, 64), (None, 8, 256)]  # B <= 8
SWEEP_DOT = [(None, 32, 64), (None, 64, 64), (None, 64, 128), (None, 128, 64), (16, 64, 64)]       # B > 8


def bench(fn) -> float:
    """Median microseconds of fn()."""
    if CUDA:
        import triton.testing
        return 1000.0 * triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time a few other tiles per case")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    dev = torch.device("cuda" if CUDA else "cpu")
    print(f"device: {torch.cuda.get_device_name() if CUDA else 'cpu (interpreted smoke test)'}; torch {torch.__version__}",
          flush=True)
    rows = []
    head = f"{'fmt':7} {'N x K':>12} {'B':>3} {'tile':>14} {'rel err':>8} {'triton':>8} {'GB/s':>6} " \
           f"{'tf32x3':>8} {'deq+mm':>8} {'mm fp32':>8} {'mm bf16':>8}  (us)"
    print(head, flush=True)
    for fmt, group in FORMATS:
        for N, K in SHAPES:
            torch.manual_seed(0)
            w = torch.randn(N, K, device=dev) * 0.02
            q = formats.quantize(w, fmt, group or formats.DEFAULT_GROUP)
            wd, wb = formats.dequantize(q), formats.dequantize(q).to(torch.bfloat16)
            for B in BATCHES:
                x = torch.randn(B, K, device=dev)
                ref = formats.reference_linear(x, q)
                scale = ref.abs().max().item()
                err = ((linear_triton(x, q) - ref).abs().max().item()) / scale
                t = bench(lambda: linear_triton(x, q))
                row = dict(fmt=f"{fmt}{group or ''}", N=N, K=K, B=B, tile=tiles(fmt, B), rel_err=err, triton_us=t,
                           gbps=q.nbytes / t / 1e3,
                           deq_mm_us=bench(lambda: formats.reference_linear(x, q)),
                           mm_fp32_us=bench(lambda: F.linear(x, wd)),
                           mm_bf16_us=bench(lambda: F.linear(x.to(torch.bfloat16), wb)))
                if B > 8:
                    row["tf32x3_err"] = (linear_triton(x, q, precision="tf32x3") - ref).abs().max().item() / scale
                    row["tf32x3_us"] = bench(lambda: linear_triton(x, q, precision="tf32x3"))
                if args.sweep:
                    best = (t, row["tile"])
                    for bm, bn, bk in (SWEEP_SMALL if B <= 8 else SWEEP_DOT):
                        tile = (bm or tiles(fmt, B)[0], bn, bk)
                        try:
                            ts = bench(lambda: linear_triton(x, q, tile=tile))
                        except Exception as e:  # e.g. out of registers / shared memory for this tile
                            print(f"  tile {tile}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                            continue
                        best = min(best, (ts, tile))
                    row["best_us"], row["best_tile"] = best
                rows.append(row)
                print(f"{row['fmt']:7} {f'{N}x{K}':>12} {B:>3} {str(row['tile']):>14} {err:8.1e} {t:8.1f} "
                      f"{row['gbps']:6.0f} {row.get('tf32x3_us', float('nan')):8.1f} {row['deq_mm_us']:8.1f} "
                      f"{row['mm_fp32_us']:8.1f} {row['mm_bf16_us']:8.1f}"
                      + (f"  best {row['best_tile']} {row['best_us']:.1f}" if args.sweep else ""), flush=True)
                assert err < 1e-4, f"{row['fmt']} B={B}: error {err:.1e} against the reference"
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("all errors < 1e-4 of max|reference|")


if __name__ == "__main__":
    main()
