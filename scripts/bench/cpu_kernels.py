"""CPU products of the d768 config's matrices: tinyloop/kernels/cpu.py vs torch, in GB/s of stored weight bytes.

  .venv/bin/python scripts/bench/cpu_kernels.py [--batches 1,2,4,8,16] [--threads 1,2] [--formats ...] [--reps 15]
  .venv/bin/python scripts/bench/cpu_kernels.py --gemm [--batches 48,256] [--threads 1,2]

--gemm: the many-row products (prefill chunks, issue 34) in GF/s (Gop/s for integer activations) over the
--matrices summed, best of --reps: the tiled GEMM (cpu.linear(tiled=True)), the row kernels, and the path before
the tiles (fp32 F.linear; the others formats.reference_linear: quantise x, widen W, MKL); int8 / int4 act_quant.

Each product reads its weight from memory, as in a decode step (which cycles through far more weight than the
last-level cache holds): every call uses the next of several copies of the matrix totalling > 256 MB. A
number is the best call time over at least --reps calls (more for small products; the machine is shared,
the best is the least disturbed).
Ratio = GB/s over the streaming-read bandwidth measured with the same thread count.

torch's products: fp32 F.linear; bf16 F.linear with bf16 weights (x cast to bf16); int8
torch._weight_int8pack_mm; int4 torch._weight_int4pack_mm_for_cpu on its own packing of the same values.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch
import torch.nn.functional as F

from tinyloop import formats
from tinyloop.kernels import cpu

MATRICES = {"qkv": (1280, 768), "o": (768, 768), "gate|up": (4096, 768), "down": (768, 2048), "head": (32000, 768)}
ROTATE_BYTES = 256 << 20  # several times the last-level cache (32 MB here)


def torch_product(fmt: str, w: formats.Matrix, W: torch.Tensor):
    """torch's product for the format, with its own weight layout built once (not timed)."""
    if fmt == "fp32":
        return lambda x: F.linear(x, w)
    if fmt == "bf16":
        return lambda x: F.linear(x.to(torch.bfloat16), w.data)
    if fmt == "int8":
        return lambda x: torch._weight_int8pack_mm(x, w.data, w.scale)
    N, K = w.shape
    b = w.data.view(N, K // 32, 16)
    q = torch.stack((b & 0x0F, b >> 4), dim=2)  # back to one value per element, in order
    packed = torch._convert_weight_to_int4pack_for_cpu(q.reshape(N, K).to(torch.int32), 1)
    sz = torch.stack([w.scale.t(), torch.zeros_like(w.scale.t())], dim=2).contiguous()  # w = (q - 8) * s + 0
    return lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, w.group, sz)


def clone(w: formats.Matrix) -> formats.Matrix:
    if isinstance(w, torch.Tensor):
        return w.clone()
    return dataclasses.replace(w, data=w.data.clone(), scale=None if w.scale is None else w.scale.clone())


def best_time(fn, copies: list, x: torch.Tensor, reps: int, budget_s: float = 0.25) -> float:
    """Best call time over at least `reps` calls, more (up to 2000) while under budget_s: on a shared machine a
    two-thread call is only undisturbed when both threads happen to be scheduled, so small products need many."""
    for c in copies[:2]:
        fn(x, c)  # warm: threads started, code paged in
    best, start, i = float("inf"), time.perf_counter(), 0
    while i < reps or (i < 2000 and time.perf_counter() - start < budget_s):
        c = copies[i % len(copies)]
        t0 = time.perf_counter()
        fn(x, c)
        best = min(best, time.perf_counter() - t0)
        i += 1
    return best


def print_errors(names: list[str], B: int = 4) -> None:
    """max |y - reference| / max |reference| of each product on x ~ randn, W ~ randn * 0.02."""
    print(f"max |y - reference| / max |reference|, B = {B}")
    print(f"{'fmt':5} {'matrix':8} | {'ours':>8} | {'act_quant':>9} | {'torch':>8}")
    torch.manual_seed(0)
    for fmt in formats.FORMATS:
        for name in names:
            W = torch.randn(*MATRICES[name]) * 0.02
            w = formats.quantize(W, fmt)
            x = torch.randn(B, W.shape[1])
            ref = formats.reference_linear(x, w)
            err = lambda y: ((y.float() - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
            aq = f"{err(cpu.linear(x, w, act_quant=True)):9.1e}" if fmt in ("int8", "int4") else f"{'-':>9}"
            print(f"{fmt:5} {name:8} | {err(cpu.linear(x, w)):8.1e} | {aq} | {err(torch_product(fmt, w, W)(x)):8.1e}")


def gemm_rates(fmt: str, names: list[str], B: int, threads: int, reps: int) -> dict[str, float]:
    """GF/s of the three many-row paths over the named matrices (the weights stay in cache: compute-bound)."""
    torch.set_num_threads(threads)
    seconds = {"tiled": 0.0, "row kernels": 0.0, "before (torch)": 0.0}
    flops = 0
    for name in names:
        N, K = MATRICES[name]
        w = formats.quantize(torch.randn(N, K) * 0.02, fmt)
        if fmt in ("int8", "int4"):
            w = dataclasses.replace(w, act_quant=True)
        x = torch.randn(B, K)
        old = (lambda x, c: F.linear(x, c)) if fmt == "fp32" else formats.reference_linear
        seconds["tiled"] += best_time(lambda x, c: cpu.linear(x, c, threads=threads, tiled=True), [w], x, reps)
        seconds["row kernels"] += best_time(lambda x, c: cpu.linear(x, c, threads=threads), [w], x, reps)
        seconds["before (torch)"] += best_time(old, [w], x, reps)
        flops += 2 * B * N * K
    return {k: flops / s / 1e9 for k, s in seconds.items()}


def print_gemm(fmts: list[str], names: list[str], batches: list[int], threads: list[int], reps: int) -> None:
    print(f"many-row products over {'+'.join(names)}, GF/s; load average {os.getloadavg()[0]:.1f}")
    print(f"{'fmt':5} {'B':>4} {'thr':>3} | {'tiled':>7} | {'row kernels':>11} | {'before (torch)':>14} | {'tiled/before':>12}")
    for fmt in fmts:
        for B in batches:
            for t in threads:
                r = gemm_rates(fmt, names, B, t, reps)
                print(f"{fmt:5} {B:4d} {t:3d} | {r['tiled']:7.1f} | {r['row kernels']:11.1f} | "
                      f"{r['before (torch)']:14.1f} | {r['tiled'] / r['before (torch)']:11.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--formats", default=",".join(formats.FORMATS))
    ap.add_argument("--matrices", default=",".join(MATRICES))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--errors", action="store_true", help="only print each product's error against the reference")
    ap.add_argument("--gemm", action="store_true", help="the many-row products: tiled GEMM, row kernels, torch")
    args = ap.parse_args()
    if not cpu.available():
        raise SystemExit("CPU kernels unavailable (see the warning above)")
    if args.errors:
        return print_errors(args.matrices.split(","))
    if args.gemm:
        if not cpu.gemm_available():
            raise SystemExit("the tiled GEMM needs AVX-512 with VNNI")
        names = [n for n in args.matrices.split(",") if n != "head"]
        batches = "48,256" if args.batches == "1,2,4,8,16" else args.batches
        return print_gemm(args.formats.split(","), names, [int(b) for b in batches.split(",")],
                          [int(t) for t in args.threads.split(",")], args.reps)
    threads = [int(t) for t in args.threads.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    stream = {t: max(cpu.stream_bandwidth(threads=t) for _ in range(3)) for t in threads}
    print("stream read GB/s: " + ", ".join(f"{t} thread{'s' * (t > 1)} {stream[t]:.1f}" for t in threads))
    print(f"{'fmt':5} {'matrix':8} {'B':>3} {'thr':>3} | {'ours GB/s':>9} {'frac':>5} | {'act_q GB/s':>10} {'frac':>5} "
          f"| {'torch GB/s':>10} {'frac':>5} | {'ours/torch':>10}")
    torch.manual_seed(0)
    for fmt in args.formats.split(","):
        for name in args.matrices.split(","):
            N, K = MATRICES[name]
            W = torch.randn(N, K) * 0.02
            w = formats.quantize(W, fmt)
            nb = formats.nbytes(w)
            n_copies = max(2, -(-ROTATE_BYTES // nb))
            ws = [w] + [clone(w) for _ in range(n_copies - 1)]
            tp = [torch_product(fmt, c, W) for c in ws]
            for B in batches:
                x = torch.randn(B, K)
                for t in threads:
                    torch.set_num_threads(t)
                    ours = best_time(lambda x, c: cpu.linear(x, c, threads=t), ws, x, args.reps)
                    aq = (best_time(lambda x, c: cpu.linear(x, c, threads=t, act_quant=True), ws, x, args.reps)
                          if fmt in ("int8", "int4") else None)
                    theirs = best_time(lambda x, f: f(x), tp, x, args.reps)
                    g = lambda s: nb / s / 1e9  # noqa: E731
                    aqs = f"{g(aq):10.1f} {g(aq) / stream[t]:5.2f}" if aq else f"{'-':>10} {'-':>5}"
                    print(f"{fmt:5} {name:8} {B:3d} {t:3d} | {g(ours):9.1f} {g(ours) / stream[t]:5.2f} | {aqs} "
                          f"| {g(theirs):10.1f} {g(theirs) / stream[t]:5.2f} | {theirs / ours:10.2f}", flush=True)


if __name__ == "__main__":
    main()
