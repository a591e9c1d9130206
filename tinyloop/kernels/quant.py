"""Quantise-on-write: new tokens go into the cache's stored layout in one launch per tensor.

  int8  K and V: one scale per token and KV head, q = round(x / scale), scale = max|x| / 127
  int4  store-h: h in groups of 32 along d_model, scale = max|x| / 7, q + 8 packed two nibbles per byte
        (even index in the low nibble)
fp16 needs no arithmetic and is a plain indexed copy. Entries go to the cache's paged layout: cell c of
(slot, lane) is row c % BT of block table[slot, lane, c // BT] of the pool; the blocks are taken (or copied, when
shared) on the host by cache.prepare before anything is written. The torch reference is the cache's own quantisers
(tinyloop/cache.py quant_int8 / quant_int4); the kernels round half to even like torch.round so both write
the same bytes.
"""
from __future__ import annotations

import torch
import triton.language as tl

from ..cache import encode_entries
from .dispatch import lazy_jit, next_pow2, use_triton


@lazy_jit
def _write_int8_kernel(X, QOUT, SOUT, POS, TABLE, slot, T,
                       sq_block, sq_row, ss_block, ss_row, st_slot, st_lane,
                       BT: tl.constexpr, RING: tl.constexpr, N_KV: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr):
    tok = tl.program_id(0)  # lane * T + t
    kvh = tl.program_id(1)
    b = tok // T
    p = tl.load(POS + tok)
    if RING > 0:
        cell = p % RING
    else:
        cell = p
    r = tl.arange(0, HD_P)
    m = r < HD
    x = tl.load(X + (tok * N_KV + kvh) * HD + r, mask=m, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), 1e-8), 127.0)
    y = tl.math.div_rn(x, scale)
    # round half to even (torch.round): floor, then up when the fraction is > .5, or == .5 and floor is odd
    f = tl.floor(y)
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    y = tl.where((y - f > 0.5) | ((y - f == 0.5) & odd), f + 1.0, f)
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    blk = tl.load(TABLE + slot * st_slot + b * st_lane + cell // BT)
    tl.store(QOUT + blk * sq_block + (cell % BT) * sq_row + kvh * HD + r, y.to(tl.int8), mask=m)
    tl.store(SOUT + blk * ss_block + (cell % BT) * ss_row + kvh, scale.to(tl.float16))


@lazy_jit
def _write_int4_kernel(X, HOUT, SOUT, POS, TABLE, slot, T,
                       sh_block, sh_row, ss_block, ss_row, st_slot, st_lane,
                       BT: tl.constexpr, RING: tl.constexpr, D: tl.constexpr):
    tok = tl.program_id(0)
    grp = tl.program_id(1)  # one group of 32 values along d_model
    b = tok // T
    p = tl.load(POS + tok)
    if RING > 0:
        cell = p % RING
    else:
        cell = p
    i = tl.arange(0, 16)
    src = X + tok * D + grp * 32 + 2 * i
    xe = tl.load(src).to(tl.float32)
    xo = tl.load(src + 1).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xe), 0), tl.max(tl.abs(xo), 0))
    scale = tl.math.div_rn(tl.maximum(amax, 1e-8), 7.0)
    ye = tl.math.div_rn(xe, scale)
    yo = tl.math.div_rn(xo, scale)
    fe = tl.floor(ye)
    fo = tl.floor(yo)
    ye = tl.where((ye - fe > 0.5) | ((ye - fe == 0.5) & ((fe - 2.0 * tl.floor(fe * 0.5)) == 1.0)), fe + 1.0, fe)
    yo = tl.where((yo - fo > 0.5) | ((yo - fo == 0.5) & ((fo - 2.0 * tl.floor(fo * 0.5)) == 1.0)), fo + 1.0, fo)
    qe = (tl.minimum(tl.maximum(ye, -8.0), 7.0) + 8.0).to(tl.uint8)
    qo = (tl.minimum(tl.maximum(yo, -8.0), 7.0) + 8.0).to(tl.uint8)
    blk = tl.load(TABLE + slot * st_slot + b * st_lane + cell // BT)
    tl.store(HOUT + blk * sh_block + (cell % BT) * sh_row + grp * 16 + i, qe | (qo << 4))
    tl.store(SOUT + blk * ss_block + (cell % BT) * ss_row + grp, scale.to(tl.float16))


def _launch(kernel, x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, table: torch.Tensor, slot: int,
            pos: torch.Tensor, ring: int, grid_y: int, **meta) -> None:
    B, T = pos.shape
    kernel[(B * T, grid_y)](x.contiguous(), q_out, s_out, pos.contiguous(), table, slot, T,
                            q_out.stride(0), q_out.stride(1), s_out.stride(0), s_out.stride(1),
                            table.stride(0), table.stride(1), BT=q_out.shape[1], RING=ring, **meta)


def write_int8_triton(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor, table: torch.Tensor, slot: int,
                      pos: torch.Tensor, ring: int = 0) -> None:
    """x [B, T, n_kv, hd] -> int8 q_out and fp16 scales s_out (pool tensors [blocks, BT, ...]) at the cells
    pos (% ring) of lanes 0..B-1 in `slot`, through the block table [S, lanes, max_blocks]."""
    n_kv, hd = x.shape[2], x.shape[3]
    _launch(_write_int8_kernel, x, q_out, s_out, table, slot, pos, ring, n_kv, N_KV=n_kv, HD=hd, HD_P=next_pow2(hd))


def write_int4_triton(h: torch.Tensor, h_out: torch.Tensor, s_out: torch.Tensor, table: torch.Tensor, slot: int,
                      pos: torch.Tensor, ring: int = 0) -> None:
    """h [B, T, d] -> packed nibbles h_out and fp16 group scales s_out, addressed as in write_int8_triton."""
    D = h.shape[-1]
    _launch(_write_int4_kernel, h, h_out, s_out, table, slot, pos, ring, D // 32, D=D)


def require_cells(cache, slot: int, pos: torch.Tensor) -> None:
    """Check that the cells lanes 0..B-1 write at positions pos [B, T] have their blocks (taken by the step's
    scheduler): host work, one read of pos from the device."""
    cache.require([(slot, list(range(pos.shape[0])), pos.min(1).values.tolist(), pos.max(1).values.tolist())])


def write_tokens_ref(cache, slot: int, pos: torch.Tensor, h: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     check: bool = True) -> None:
    """The cache's own encode-and-store, for a chunk whose positions map to distinct cells."""
    if check:
        require_cells(cache, slot, pos)
    lane = torch.arange(pos.shape[0], device=pos.device).unsqueeze(1)
    cells = pos % cache.ring if cache.window else pos
    blk, row = cache.locate(slot, lane, cells)
    for name, t in encode_entries(cache.mode, h, k, v).items():
        cache.store[name][blk, row] = t
    if cache.window:
        cache.cell_pos[slot, lane, cells] = pos


def write_tokens(cache, slot: int, pos: torch.Tensor, h: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 check: bool = True) -> None:
    """Store a chunk (pos [B, T], h [B, T, d], k/v [B, T, n_kv, hd]) in `slot` in the cache's mode.

    Positions of one lane must land in distinct cells (with a window: T <= the ring's cells), as in decode.
    check=False: the caller already checked these cells' blocks (cache.require; no device read here: CUDA graphs).
    """
    if not use_triton(pos.device) or cache.mode == "fp16":
        return write_tokens_ref(cache, slot, pos, h, k, v, check=check)
    if check:
        require_cells(cache, slot, pos)
    st, tab, W = cache.store, cache.table, (cache.ring if cache.window else 0)
    if cache.mode == "int8":
        write_int8_triton(k, st["k"], st["k_scale"], tab, slot, pos, W)
        write_int8_triton(v, st["v"], st["v_scale"], tab, slot, pos, W)
    else:
        write_int4_triton(h, st["h"], st["h_scale"], tab, slot, pos, W)
    if W:
        lane = torch.arange(pos.shape[0], device=pos.device).unsqueeze(1)
        cache.cell_pos[slot, lane, pos % W] = pos
