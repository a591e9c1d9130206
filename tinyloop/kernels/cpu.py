"""Fast CPU products y = x @ W^T for every weight format (cpu_gemv.c), built with the system C compiler.

Decode at batch 1 is bound by reading weight bytes, and torch's CPU products stream the small matrices of a
decode step well below the machine's read bandwidth (int8 and int4 worst). cpu_gemv.c streams W once for any
batch, in its stored format, split over threads by rows.
Past the engine's lanes (prefill chunks) a product is bound by multiply-adds instead: `linear(..., tiled=True)` runs
cpu_gemv.c's tiled GEMM: 512-bit tiles with VNNI integer dot products for act_quant int8 / int4 where the CPU has
AVX-512 VNNI, else 256-bit tiles (AVX2 + FMA; act_quant int4 on integers, int8 through fp32); gemm_isa() says which.
bf16 weights take AMX tiles where the CPU has them: past the lanes (gemm_amx()) and, with their own batch-invariant
sums, for decode rows too (rows_amx()).
A prefill chunk's attention reads the paged cache in place (cpu_attention.c: prefill_attention).

The C file compiles at first use (`$CC` or `cc`, -O3 -march=native -fopenmp) into a cache directory, keyed by
a hash of the source, flags, compiler and CPU, and loads with ctypes (which releases the GIL during a call).
Nothing here is required: with no compiler, a failed build, a CPU without AVX2/FMA, or TINYLOOP_CPU_KERNELS=0,
`available()` is False (one warning is logged) and callers keep torch's products.

Threads: the kernels run on torch's OpenMP pool (the .so's libgomp.so.1 resolves to the copy torch loaded). On a
machine whose cores are busy with other processes, libgomp's default spin-waiting lets a second thread be
descheduled for whole time slices (calls of 4-8 ms instead of 50 us were measured); OMP_WAIT_POLICY=PASSIVE, set
before torch is imported, trades ~10-40 us of wake-up for no such stalls. Several worker processes on one machine
should split the cores (threads = cores / workers) rather than each use them all.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from ..errors import ConfigError
from ..formats import INT4_BLOCK, Matrix

log = logging.getLogger(__name__)

# The products (cpu_gemv.c), a decode step's whole block in one call (cpu_block.c) and a prefill chunk's attention
# over the paged cache (cpu_attention.c), built into one library.
SOURCES = [Path(__file__).with_name(name) for name in ("cpu_gemv.c", "cpu_block.c", "cpu_attention.c")]
# -ffp-contract=off: the scalar K tails stay mul-then-add, as written (batch invariance, see cpu_gemv.c).
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]

# Largest batch B that linear() takes (the dispatcher, kernels/linear.py, uses torch above it). 32 for every
# format: it is the engine's lane cap, and a decode step of any batch up to it must run these kernels, whose
# per-element summation does not depend on B (cpu_gemv.c), so a request's output is the same alone or batched;
# torch's products sum differently per batch shape. Above 32 rows (prefill chunks) torch may run.
# Speed (2-core Zen3, 2 threads, torch 2.13 CPU, d768 qkv / gate|up / down, best of 3 runs, 2026-11-30): fp32
# ours / F.linear (oneDNN sgemm, both FMA-bound there) 1.4-1.6 at B = 16 and 1.1-1.3 at B = 32; bf16 / int8 /
# int4 beat torch's products of the same format 4-70x at every B up to 32.
MAX_ROWS = {"fp32": 32, "bf16": 32, "int8": 32, "int4": 32}

_lib: ctypes.CDLL | None = None
_state: str = "unknown"  # "unknown" -> "ok" | "off"
_warned_off = False
_amx_rows = os.environ.get("TINYLOOP_CPU_AMX", "").strip() != "0"
_gemm: int | None = None  # tl_gemm_ok(): 512, 256 or 0, asked once


def _cache_dir() -> Path:
    if os.environ.get("TINYLOOP_CACHE_DIR"):
        return Path(os.environ["TINYLOOP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tinyloop"


def _cpu_signature() -> str:
    """-march=native differs per CPU, so a cache shared by machines keys the build by the CPU too."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({line for line in f if line.startswith(("model name", "flags"))}))
    except OSError:
        return ""


def _build() -> Path:
    """The compiled library's path, compiling it once per (source, flags, compiler, CPU)."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not found)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([*(src.read_text() for src in SOURCES), " ".join(FLAGS), cc, version, _cpu_signature()])
                         .encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_gemv-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Several worker processes may build at once: each writes its own temp file, and rename is atomic.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300)
        if r.returncode:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load() -> ctypes.CDLL | None:
    global _lib, _state, _warned_off
    if os.environ.get("TINYLOOP_CPU_KERNELS", "").strip() == "0":
        if not _warned_off:
            _warned_off = True
            log.warning("tinyloop CPU kernels disabled by TINYLOOP_CPU_KERNELS=0, using torch's products")
        return None  # read on every call so tests (and users) can switch it off at any time
    if _state != "unknown":
        return _lib
    try:
        # torch is imported (above), so its libgomp.so.1 is loaded; the dynamic loader resolves our
        # libgomp.so.1 dependency to that same library: one OpenMP runtime, one thread pool.
        lib = ctypes.CDLL(str(_build()))
        if not lib.tl_cpu_ok():
            raise RuntimeError("the CPU lacks AVX2/FMA")
    except Exception as e:  # noqa: BLE001 - any failure means "use torch", never a crash
        _state = "off"
        log.warning("tinyloop CPU kernels unavailable, using torch's products: %s", e)
        return None
    p, i, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.tl_linear_f32.argtypes = [p, p, p, L, L, L, i]
    lib.tl_linear_bf16.argtypes = [p, p, p, L, L, L, i]
    lib.tl_linear_int8.argtypes = [p, p, p, p, L, L, L, i, i]
    lib.tl_linear_int4.argtypes = [p, p, p, p, L, L, L, L, i, i]
    lib.tl_gemm.argtypes = [i, p, p, p, p, L, L, L, L, i, i]
    lib.tl_gemm.restype = None
    lib.tl_gemm_ok.restype = i
    lib.tl_gemm_amx.restype = i
    lib.tl_stream_read.argtypes = [p, L, i]
    lib.tl_stream_read.restype = ctypes.c_double
    lib.tl_huge_pages.argtypes = [p, L]
    lib.tl_huge_pages.restype = L
    lib.tl_blocks_rows.argtypes = [L, p, p, p, p, p, p]
    lib.tl_blocks_rows.restype = None
    lib.tl_blocks_chunk.argtypes = [L, p, p, p, L, L, p, p, p]
    lib.tl_blocks_chunk.restype = None
    lib.tl_rms_norm_rows.argtypes = [p, p, ctypes.c_double, L, L, p]
    lib.tl_rms_norm_rows.restype = None
    lib.tl_block_scratch.argtypes = [p, L]
    lib.tl_block_scratch.restype = L
    lib.tl_block_ok.argtypes = [L, L, L]
    lib.tl_step_work.argtypes = [L, L, L]
    lib.tl_step_work.restype = L
    lib.tl_forward_rows.argtypes = [p, p, p, L, p, p, L, L, p, p, p, p]
    lib.tl_forward_rows.restype = None
    lib.tl_prefill_attention.argtypes = [p, L, L, L, p, p, p, L, L, p, L, L, L, L, L, L, p, i]
    lib.tl_prefill_attention.restype = None
    lib.tl_prefill_attention_ok.argtypes = [L, L, L]
    for f in (lib.tl_linear_f32, lib.tl_linear_bf16, lib.tl_linear_int8, lib.tl_linear_int4):
        f.restype = None
    lib.tl_set_amx.argtypes = [i]
    lib.tl_set_amx.restype = None
    lib.tl_set_amx(int(os.environ.get("TINYLOOP_CPU_AMX", "").strip() != "0"))
    _lib, _state = lib, "ok"
    return lib


def available() -> bool:
    """True when the compiled kernels can run here (the dispatcher falls back to torch otherwise)."""
    return _load() is not None


def gemm_available() -> bool:
    """True when the tiled many-row product (cpu_gemv.c: tl_gemm) runs here: wherever the kernels do (AVX2 + FMA),
    unless TINYLOOP_CPU_GEMM=0."""
    return gemm_isa() > 0


def gemm_isa() -> int:
    """The vector width in bits of the tiled GEMM that runs here: 512 (AVX-512 with VNNI), 256 (AVX2 + FMA), or 0
    (none: the kernels are off, or TINYLOOP_CPU_GEMM=0)."""
    global _gemm
    if os.environ.get("TINYLOOP_CPU_GEMM", "").strip() == "0":
        return 0  # read on every call, like TINYLOOP_CPU_KERNELS: benches compare both paths in one process
    lib = _load()
    if lib is None:
        return 0
    if _gemm is None:
        _gemm = int(lib.tl_gemm_ok())
    return _gemm


def gemm_amx() -> bool:
    """True when the tiled GEMM multiplies bf16 weights on AMX tiles (cpu_gemv.c: gemm_amx_bf16; Intel Sapphire Rapids
    and later, where Linux grants the tile state), x split into three bf16 parts so the product stays fp32's."""
    return gemm_isa() == 512 and bool(loaded().tl_gemm_amx())


def rows_amx() -> bool:
    """True when bf16 products of up to 32 rows (decode rows) run on AMX tiles too (cpu_gemv.c: amx_rows_bf16), with
    the sums gemm_amx_bf16 makes: then a bf16 product's rows have the same bits at every row count. Where gemm_amx(),
    unless TINYLOOP_CPU_AMX=0 (read when the library loads; set_amx_rows switches it later)."""
    return gemm_amx() and _amx_rows


def set_amx_rows(on: bool) -> None:
    """Whether bf16 products of up to 32 rows take AMX tiles where the CPU has them (a bench's switch; both kinds of
    product are batch-invariant, but a process should not switch while requests decode: their bits would change)."""
    global _amx_rows
    _lib_or_raise().tl_set_amx(int(on))
    _amx_rows = on


def loaded() -> ctypes.CDLL:
    """The loaded library, for a caller that checked available() (else it loads it, or raises ConfigError): one
    comparison once loaded."""
    return _lib if _state == "ok" and _lib is not None else _lib_or_raise()


def _lib_or_raise() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise ConfigError("the tinyloop CPU kernels are not available (see the logged warning, "
                          "or TINYLOOP_CPU_KERNELS=0)")
    return lib


def _check(t: torch.Tensor, dtype: torch.dtype, shape: tuple, what: str) -> None:
    if t.dtype is dtype and t.shape == shape and t.is_cpu and t.is_contiguous():
        return  # the common case first: this runs up to 3 times per product
    raise ConfigError(f"{what} must be a contiguous CPU {dtype} tensor of shape {list(shape)}, got "
                      f"{t.dtype} {list(t.shape)} on {t.device}{'' if t.is_contiguous() else ' (strided)'}")


def linear(x: torch.Tensor, w: Matrix, threads: int = 0, act_quant: bool | None = None, tiled: bool = False
           ) -> torch.Tensor:
    """y [B, N] fp32 = x [B, K] @ dequantize(w).T, streaming w once in its stored format.

    act_quant (int8 / int4 weights only; None: the matrix's own act_quant): quantise x to int8 per block of 32 and
    multiply on integers, faster than widening the weights (docs/kernels.md; the max difference from the weight-only
    product is ~0.5% of the output scale). The result is formats.reference_linear of the matrix with that act_quant,
    up to fp32 rounding; a row's result is bitwise the same whatever the batch it is multiplied in and whatever the
    thread count (batch invariance: one summation order per element).
    threads 0 = torch.get_num_threads().
    tiled: the GEMM for many rows (tl_gemm; only where gemm_available()): x rows packed into tiles of 16 (AVX-512)
    or 8 (AVX2), each weight broadcast over 48 or 24 rows, act_quant on integers (VNNI; on AVX2 int4 only), bf16 on
    AMX tiles where gemm_amx(). The same
    product to fp32 rounding, but not the row kernels' summation order, so the dispatcher uses it only past the
    engine's lanes (kernels/linear.py).
    Dispatchers ask available() first (it reads TINYLOOP_CPU_KERNELS); once the library is loaded this call does
    not, to keep the per-call cost (a few us) down.
    """
    lib = loaded()
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype is not torch.float32 or not x.is_cpu:
        raise ConfigError(f"x must be a CPU float32 tensor [B, K], got "
                          f"{getattr(x, 'dtype', type(x))} {list(getattr(x, 'shape', []))}")
    if tiled and not gemm_available():
        raise ConfigError("the tiled CPU product is not available here (cpu.gemm_available() is False: the CPU kernels "
                          "are off, or TINYLOOP_CPU_GEMM=0)")
    if not x.is_contiguous():
        x = x.contiguous()
    B, K = x.shape
    t = threads or torch.get_num_threads()
    # Checks read the tensors' own attributes once (QMatrix.shape is a Python property): ~80 calls per decode step.
    if isinstance(w, torch.Tensor):
        N, Kw = w.shape
        if K != Kw:
            raise ConfigError(f"x width {K} does not match the fp32 weight's width {Kw} (weight {N}x{Kw})")
        y = torch.empty(B, N, dtype=torch.float32)
        if B and N:
            _check(w, torch.float32, (N, K), "fp32 weight")
            if tiled:
                lib.tl_gemm(0, x.data_ptr(), w.data_ptr(), None, y.data_ptr(), B, N, K, 0, 0, t)
            else:
                lib.tl_linear_f32(x.data_ptr(), w.data_ptr(), y.data_ptr(), B, N, K, t)
        return y
    fmt, data, scale = w.fmt, w.data, w.scale
    N = data.shape[0]
    if act_quant is None:
        act_quant = w.act_quant
    Kw = w.width if fmt == "int4" else data.shape[1]
    if K != Kw:
        raise ConfigError(f"x width {K} does not match the {fmt} weight's width {Kw} (weight {N}x{Kw})")
    y = torch.empty(B, N, dtype=torch.float32)
    if B == 0 or N == 0:
        return y
    if fmt == "bf16":
        _check(data, torch.bfloat16, (N, K), "bf16 weight data")
        if tiled:
            lib.tl_gemm(1, x.data_ptr(), data.data_ptr(), None, y.data_ptr(), B, N, K, 0, 0, t)
            return y
        lib.tl_linear_bf16(x.data_ptr(), data.data_ptr(), y.data_ptr(), B, N, K, t)
    elif fmt == "int8":
        _check(data, torch.int8, (N, K), "int8 weight data")
        assert scale is not None  # (an int8 matrix has one)
        _check(scale, torch.float32, (N,), "int8 weight scale")
        if tiled:
            lib.tl_gemm(2, x.data_ptr(), data.data_ptr(), scale.data_ptr(), y.data_ptr(), B, N, K, 0,
                        int(act_quant), t)
            return y
        lib.tl_linear_int8(x.data_ptr(), data.data_ptr(), scale.data_ptr(), y.data_ptr(), B, N, K,
                           int(act_quant), t)
    elif fmt == "int4":
        if w.group <= 0 or w.group % INT4_BLOCK or K % w.group:
            raise ConfigError(f"int4 group {w.group} must be a positive multiple of {INT4_BLOCK} dividing K={K}")
        _check(data, torch.uint8, (N, K // 2), "int4 weight data")
        assert scale is not None  # (an int4 matrix has one)
        _check(scale, torch.float32, (N, K // w.group), "int4 weight scale")
        if tiled:
            lib.tl_gemm(3, x.data_ptr(), data.data_ptr(), scale.data_ptr(), y.data_ptr(), B, N, K, w.group,
                        int(act_quant), t)
            return y
        lib.tl_linear_int4(x.data_ptr(), data.data_ptr(), scale.data_ptr(), y.data_ptr(), B, N, K, w.group,
                           int(act_quant), t)
    else:
        raise ConfigError(f"weight format {fmt!r} has no CPU kernel")
    return y


def attention_available(H: int, KV: int, hd: int) -> bool:
    """True when prefill chunks attend through cpu_attention.c here (these head sizes, the kernels on), unless
    TINYLOOP_CPU_ATTENTION=0 (read on every call, so a bench compares both paths in one process)."""
    if os.environ.get("TINYLOOP_CPU_ATTENTION", "").strip() == "0":
        return False
    lib = _load()
    return lib is not None and bool(lib.tl_prefill_attention_ok(H, KV, hd))


def prefill_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, table: torch.Tensor,
                      pos: torch.Tensor, end: int, threads: int = 0) -> torch.Tensor:
    """Causal attention of a chunk over a paged fp32 store (cpu_attention.c): out [B, T, H, hd], where row (b, t)
    attends over cells 0..min(pos[b, t], end - 1) of lane b, cell c in block table[b, c // bt], row c % bt.
    q [B, T, H, hd] fp32 (any strides but the last); k_store, v_store [blocks, bt, KV, hd]; table [B, blocks per lane]
    (any lane stride); pos [B, T] >= 0. The caller checked attention_available(H, KV, hd)."""
    lib = loaded()
    B, T, H, hd = q.shape
    blocks, bt, KV, _ = k_store.shape
    _check(k_store, torch.float32, (blocks, bt, KV, hd), "k store")
    _check(v_store, torch.float32, (blocks, bt, KV, hd), "v store")
    if q.dtype is not torch.float32 or not q.is_cpu or q.stride(3) != 1 or table.dtype is not torch.long \
            or table.stride(1) != 1 or table.shape[0] < B or table.shape[1] * bt < end:
        raise ConfigError(f"prefill_attention: q {q.dtype} on {q.device} strides {q.stride()}, table {table.dtype} "
                          f"{list(table.shape)} strides {table.stride()} do not fit {B} lanes of {end} cells")
    pos = pos.contiguous()
    _check(pos, torch.long, (B, T), "positions")
    out = torch.empty(B, T, H, hd, dtype=torch.float32)
    lib.tl_prefill_attention(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k_store.data_ptr(),
                             v_store.data_ptr(), table.data_ptr(), table.stride(0), bt, pos.data_ptr(), B, T, H, KV,
                             hd, end, out.data_ptr(), threads or torch.get_num_threads())
    return out


def huge_pages(t: torch.Tensor) -> int:
    """Back a CPU tensor's memory by 2 MiB pages where Linux allows (cpu_gemv.c: tl_huge_pages), so the products
    stream it faster; bytes collapsed (0: left as it was). Weights only: it is worth it for memory read every step."""
    if os.environ.get("TINYLOOP_HUGEPAGES", "1") == "0":
        return 0
    lib = _load()
    if lib is None or not t.is_cpu or t.numel() * t.element_size() < (1 << 20):
        return 0
    return lib.tl_huge_pages(t.data_ptr(), t.numel() * t.element_size())


def max_rows(fmt: str) -> int:
    """Largest batch the dispatcher sends to linear() for this format: the engine's 32 lanes (see MAX_ROWS)."""
    if fmt not in MAX_ROWS:
        raise ConfigError(f"weight format {fmt!r} is not one of {', '.join(MAX_ROWS)}")
    return MAX_ROWS[fmt]


def stream_bandwidth(nbytes: int = 512 << 20, threads: int = 0, repeats: int = 5) -> float:
    """GB/s of a streaming read of nbytes (much larger than the caches), best of `repeats`: the roofline the
    products are measured against."""
    lib = _lib_or_raise()
    a = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
    t = threads or torch.get_num_threads()
    lib.tl_stream_read(a.data_ptr(), a.numel(), t)  # warm: pages touched, threads started
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        lib.tl_stream_read(a.data_ptr(), a.numel(), t)
        best = min(best, time.perf_counter() - t0)
    return a.numel() * 4 / best / 1e9
