"""Decode attention straight over the loop-aware cache's paged layout (tinyloop/cache.py), in every mode.

The cache's entries live in blocks of one pool (store[name]: [num_blocks + 1, BT, ...]); cell c of (slot, lane)
is row c % BT of block table[slot, lane, c // BT]. Both implementations read through that table, so a lane's
blocks may lie anywhere in the pool (shared with other lanes or handles, copied on write, taken in any order).

One query token per lane attends to everything its lane holds in one slot:
  fp16  K/V read as stored (the model's dtype)
  int8  K/V int8, dequantised inside the kernel with the per-token, per-KV-head scales
  int4  store-h: h unpacked (two nibbles per byte, one scale per group of 32), and K = RoPE(h Wk^T),
        V = h Wv^T recomputed inside the kernel, so full-precision K/V never touch memory
Grouped-query heads share one K/V read per KV head; lanes have their own lengths (pos[b] + 1 keys, or the
ring cells whose cell_pos lies in (pos - window, pos]).

The Triton kernel is flash-decoding: the keys of a lane are cut into splits, each program (lane, KV head,
split) keeps a running max / sum / weighted V for the G query heads of its group, and a small second kernel
merges the splits. `decode_attention_ref` is the same computation in plain torch.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton.language as tl

from ..cache import dequant_int4, dequant_int8
from ..rotary import apply_rope
from .dispatch import lazy_jit, next_pow2, use_triton
from .quant import write_tokens

MODES = {"fp16": 0, "int8": 1, "int4": 2}


def decode_attention_ref(q: torch.Tensor, store: dict[str, torch.Tensor], table: torch.Tensor, slot: int,
                         pos: torch.Tensor, n_cells: int, *, mode: str, window: int = 0,
                         cell_pos: torch.Tensor | None = None, wk: torch.Tensor | None = None,
                         wv: torch.Tensor | None = None, rope_cos: torch.Tensor | None = None,
                         rope_sin: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, hd] (already rotated), pos [B] positions of the queries -> out [B, H, hd].

    store: the pool's tensors by name, [num_blocks + 1, BT, ...]; table [S, lanes, max_blocks]: the cache's block
    ids (lanes 0..B-1 are read). n_cells: how many cells to read: 1 + the largest position, or with a window all
    the ring's cells (the ring may hold more cells than the window; cell_pos says which position each holds).
    """
    B, H, hd = q.shape
    n = n_cells
    bt = next(iter(store.values())).shape[1]
    nb = -(-n // bt)
    ids = table[slot, :B, :nb].reshape(-1)
    data = {name: t.index_select(0, ids).view(B, nb * bt, *t.shape[2:])[:, :n] for name, t in store.items()}
    if window:
        assert cell_pos is not None  # (a ring's cells carry their positions)
        kpos = cell_pos[slot, :B, :n]
        valid = (kpos >= 0) & (kpos <= pos[:, None]) & (kpos > pos[:, None] - window)
    else:
        kpos = torch.arange(n, device=q.device).expand(B, n)
        valid = kpos <= pos[:, None]
    if mode == "fp16":
        k, v = data["k"], data["v"]
    elif mode == "int8":
        k, v = dequant_int8(data["k"], data["k_scale"], q.dtype), dequant_int8(data["v"], data["v_scale"], q.dtype)
    else:
        assert wk is not None and wv is not None and rope_cos is not None and rope_sin is not None  # (int4 store-h)
        h = dequant_int4(data["h"], data["h_scale"], q.dtype)
        cp = kpos.clamp_min(0)
        k = apply_rope(F.linear(h, wk).view(B, n, -1, hd), rope_cos[cp].unsqueeze(2), rope_sin[cp].unsqueeze(2))
        v = F.linear(h, wv).view(B, n, -1, hd)
    G = H // k.shape[2]
    k = k.repeat_interleave(G, dim=2).float()  # [B, n, H, hd]
    v = v.repeat_interleave(G, dim=2).float()
    scores = torch.einsum("bhd,bnhd->bhn", q.float(), k) / math.sqrt(hd)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhn,bnhd->bhd", scores.softmax(-1), v).to(q.dtype)


@lazy_jit
def _decode_attn_kernel(Q, K, V, KS, VS, WK, WV, COS, SIN, CELLPOS, POS, TABLE, ACC, ML,
                        slot, n_cells, cells_per_split, n_split, sm_scale,
                        sk_block, sk_row, ss_block, ss_row, sc_slot, sc_lane, st_slot, st_lane,
                        BT: tl.constexpr, MODE: tl.constexpr, WINDOW: tl.constexpr, N_KV: tl.constexpr, G: tl.constexpr,
                        G_P: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr, D: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    qpos = tl.load(POS + b)
    if WINDOW > 0:
        n_valid = n_cells
    else:
        n_valid = qpos + 1  # this lane's length: later cells hold other lanes' or stale entries
    start = sp * cells_per_split
    stop = tl.minimum(start + cells_per_split, n_valid)

    g = tl.arange(0, G_P)
    r = tl.arange(0, HD_P)
    gmask = g < G
    rmask = r < HD
    H = N_KV * G
    q = tl.load(Q + (b * H + kvh * G + g)[:, None] * HD + r[None, :], mask=gmask[:, None] & rmask[None, :], other=0.0)
    q = q.to(tl.float32) * sm_scale  # G_P >= 16 rows (padded) so tl.dot applies; padding rows are zero
    m_i = tl.full([G_P], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P], tl.float32)
    acc = tl.zeros([G_P, HD_P], tl.float32)
    dt = Q.dtype.element_ty

    for n0 in range(start, stop, BLOCK_N):
        cells = n0 + tl.arange(0, BLOCK_N)
        inside = cells < stop
        if WINDOW > 0:
            kpos = tl.load(CELLPOS + slot * sc_slot + b * sc_lane + cells, mask=inside, other=-1)
            valid = inside & (kpos >= 0) & (kpos <= qpos) & (kpos > qpos - WINDOW)
        else:
            kpos = cells
            valid = inside
        # the block holding each cell (the null block 0 past the lane's cells: masked anyway)
        blk = tl.load(TABLE + slot * st_slot + b * st_lane + cells // BT, mask=inside, other=0)
        base = blk * sk_block + (cells % BT) * sk_row
        sbase = blk * ss_block + (cells % BT) * ss_row
        if MODE == 2:
            # store-h: K = RoPE(h Wk^T), V = h Wv^T for this block of keys, D in chunks of BLOCK_D.
            # The rotate-half partner of K column r is column (r + HD/2) % HD: a second product with Wk's rows
            # in that order gives it without shuffling columns.
            rsw = (r + HD // 2) % HD
            kacc = tl.zeros([BLOCK_N, HD_P], tl.float32)
            ksacc = tl.zeros([BLOCK_N, HD_P], tl.float32)
            vacc = tl.zeros([BLOCK_N, HD_P], tl.float32)
            for d0 in range(0, D, BLOCK_D):
                dd = d0 + tl.arange(0, BLOCK_D)
                byte = tl.load(K + base[:, None] + dd[None, :] // 2, mask=inside[:, None], other=0x88)
                nib = (byte >> ((dd[None, :] % 2) * 4).to(tl.uint8)) & 0xF
                scale = tl.load(KS + sbase[:, None] + dd[None, :] // 32, mask=inside[:, None], other=0.0)
                h = ((nib.to(tl.float32) - 8.0) * scale.to(tl.float32)).to(dt)
                w_off = dd[:, None] + (kvh * HD + r)[None, :] * D
                wk = tl.load(WK + w_off, mask=rmask[None, :], other=0.0)
                wks = tl.load(WK + dd[:, None] + (kvh * HD + rsw)[None, :] * D, mask=rmask[None, :], other=0.0)
                wv = tl.load(WV + w_off, mask=rmask[None, :], other=0.0)
                kacc = tl.dot(h, wk, kacc, input_precision="ieee")
                ksacc = tl.dot(h, wks, ksacc, input_precision="ieee")
                vacc = tl.dot(h, wv, vacc, input_precision="ieee")
            half = r % (HD // 2)
            cpos = tl.maximum(kpos, 0)
            tmask = inside[:, None] & rmask[None, :]
            c = tl.load(COS + cpos[:, None] * (HD // 2) + half[None, :], mask=tmask, other=0.0).to(tl.float32)
            s = tl.load(SIN + cpos[:, None] * (HD // 2) + half[None, :], mask=tmask, other=0.0).to(tl.float32)
            sign = tl.where(r < HD // 2, -1.0, 1.0)
            k = kacc.to(dt).to(tl.float32) * c + (ksacc.to(dt).to(tl.float32) * s) * sign[None, :]
            k = k.to(dt).to(tl.float32)
            v = vacc.to(dt).to(tl.float32)
        else:
            off = base[:, None] + kvh * HD + r[None, :]
            lmask = inside[:, None] & rmask[None, :]
            k = tl.load(K + off, mask=lmask, other=0.0).to(tl.float32)
            v = tl.load(V + off, mask=lmask, other=0.0).to(tl.float32)
            if MODE == 1:
                ks = tl.load(KS + sbase + kvh, mask=inside, other=0.0).to(tl.float32)
                vs = tl.load(VS + sbase + kvh, mask=inside, other=0.0).to(tl.float32)
                k = (k * ks[:, None]).to(dt).to(tl.float32)
                v = (v * vs[:, None]).to(dt).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [G_P, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    row = (b * H + kvh * G + g) * n_split + sp
    tl.store(ACC + row[:, None] * HD_P + r[None, :], acc, mask=gmask[:, None])
    tl.store(ML + row * 2, m_i, mask=gmask)
    tl.store(ML + row * 2 + 1, l_i, mask=gmask)


@lazy_jit
def _combine_splits_kernel(ACC, ML, OUT, n_split, HD: tl.constexpr, HD_P: tl.constexpr, S_P: tl.constexpr):
    """out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s for one (lane, head)."""
    row = tl.program_id(0)
    sidx = tl.arange(0, S_P)
    r = tl.arange(0, HD_P)
    smask = sidx < n_split
    m = tl.load(ML + (row * n_split + sidx) * 2, mask=smask, other=float("-inf"))
    denom = tl.load(ML + (row * n_split + sidx) * 2 + 1, mask=smask, other=0.0)
    big = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - big))
    acc = tl.load(ACC + (row * n_split + sidx)[:, None] * HD_P + r[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(denom * w, 0)
    tl.store(OUT + row * HD + r, out.to(OUT.dtype.element_ty), mask=r < HD)


def _split_plan(cells: int, programs: int, block_n: int) -> tuple[int, int]:
    """(cells per split, splits): enough programs to fill a GPU, at least a few blocks of keys each."""
    want = max(1, min(64, 128 // max(1, programs), -(-cells // (4 * block_n))))
    per = -(-cells // want)
    per = -(-per // block_n) * block_n
    return per, -(-cells // per)


def decode_attention_triton(q: torch.Tensor, store: dict[str, torch.Tensor], table: torch.Tensor, slot: int,
                            pos: torch.Tensor, n_cells: int, *, mode: str, window: int = 0,
                            cell_pos: torch.Tensor | None = None, wk: torch.Tensor | None = None,
                            wv: torch.Tensor | None = None, rope_cos: torch.Tensor | None = None,
                            rope_sin: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as decode_attention_ref, as two Triton launches and no host sync."""
    B, H, hd = q.shape
    q = q.contiguous()
    if mode == "int4":
        assert wk is not None  # (int4 store-h recomputes K and V from h)
        n_kv, D = wk.shape[0] // hd, wk.shape[1]
        K = V = store["h"]
        KS = VS = store["h_scale"]
        block_n = 16
    else:
        n_kv, D = store["k"].shape[2], hd
        K, V = store["k"], store["v"]
        KS, VS = (store["k_scale"], store["v_scale"]) if mode == "int8" else (K, V)
        block_n = 32
    per, n_split = _split_plan(n_cells, B * n_kv, block_n)
    G, HD_P = H // n_kv, max(16, next_pow2(hd))
    acc = torch.empty(B * H * n_split * HD_P, device=q.device, dtype=torch.float32)
    ml = torch.empty(B * H * n_split * 2, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    cp = cell_pos if window and cell_pos is not None else pos  # any tensor: unused without a window
    assert not window or cp is cell_pos  # (a ring's cells carry their positions)
    dummy = q if wk is None else wk
    _decode_attn_kernel[(B, n_kv, n_split)](
        q, K, V, KS, VS, dummy if wk is None else wk, dummy if wv is None else wv,
        rope_cos if rope_cos is not None else q, rope_sin if rope_sin is not None else q, cp, pos, table, acc, ml,
        slot, n_cells, per, n_split, 1.0 / math.sqrt(hd),
        K.stride(0), K.stride(1), KS.stride(0), KS.stride(1),
        cp.stride(0) if window else 0, cp.stride(1) if window else 0, table.stride(0), table.stride(1),
        BT=K.shape[1], MODE=MODES[mode], WINDOW=window, N_KV=n_kv, G=G, G_P=max(16, next_pow2(G)), HD=hd, HD_P=HD_P, D=D,
        BLOCK_N=block_n, BLOCK_D=64 if D % 64 == 0 else 32)  # int4 d_model is a multiple of 32
    _combine_splits_kernel[(B * H,)](acc, ml, out, n_split, HD=hd, HD_P=HD_P, S_P=next_pow2(n_split))
    return out


def decode_attention(q: torch.Tensor, store: dict[str, torch.Tensor], table: torch.Tensor, slot: int,
                     pos: torch.Tensor, n_cells: int, **kw) -> torch.Tensor:
    """Triton on CUDA (or when forced), the torch reference otherwise."""
    fn = decode_attention_triton if use_triton(q.device) else decode_attention_ref
    return fn(q, store, table, slot, pos, n_cells, **kw)


def decode_attend(cache, attn, slot: int, step, q: torch.Tensor, h: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """KVCache.attend's fused path for one token per lane: write the token, attend over the slot.

    q, k, v: [B, 1, heads, hd] (q and k rotated), h: [B, 1, d]. Returns [B, H, 1, hd] like SDPA.
    Writing first is exact for the ring too: the cell the token lands in held position pos - ring <= pos - window,
    which the window already excludes. check=False: the caller has checked the token's blocks (cache.require)
    from host-side positions, so nothing here reads the device (a CUDA graph can capture it).
    """
    B = q.shape[0]
    pos = step.pos[:, 0]
    write_tokens(cache, slot, step.pos, h, k, v, check=check)
    n_cells = cache.ring if cache.window else step.end
    out = decode_attention(q[:, 0], cache.store, cache.table, slot, pos, n_cells, mode=cache.mode,
                           window=cache.window, cell_pos=cache.cell_pos, wk=attn.wk.weight, wv=attn.wv.weight,
                           rope_cos=step.table_cos, rope_sin=step.table_sin)
    return out.view(B, -1, 1, q.shape[-1])
