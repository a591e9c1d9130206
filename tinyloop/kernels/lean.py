"""The lean decode step: one token per lane through the looped model with as little overhead as the math allows.

The plain path (LoopedLM.forward with a KVCache) is general: chunks of any length, tree masks, module calls,
per-layer index tensors and masks rebuilt in every layer. For one token per lane most of that is fixed per
step, so here it is computed once per step and shared by every layer and loop:
  - lane/cell indices, the causal (or window) mask, the rotary factors, and views of every slot's cache rows
    (lanes in lockstep write the cache by slice copy and attend over a view, no index tensors per layer)
  - attention projections fused: one [q|k|v] matmul, one [gate|up] matmul (weights concatenated once per model)
  - RoPE of q and k in one pass, no nn.Module calls; tokens are rows [B*T, d], so products are plain 2-D GEMMs
Every operation is the same arithmetic as the plain path, in the same order, so on CPU the logits are the same
bits (tests check greedy tokens and logits). On CUDA (or TINYLOOP_TRITON=1) the cache write and attention go
through the Triton kernels of this package, and `CudaGraphStep` replays the whole step as one CUDA graph.

TINYLOOP_LEAN=0 turns it off (the plain path, the baseline of `tinyloop bench kernels`).

Weight layouts (TINYLOOP_LEAN_WEIGHTS, CPU fp32 models): `exact` (default) multiplies by the fused weights as
stored, the plain path's bits. `packed` keeps a second, GEMM-friendly copy of every matrix the step multiplies
by (pre-transposed at one lane, oneDNN's blocked layout for more lanes), computes RMSNorm as one LayerNorm
kernel and RoPE as one product with a per-step rotation matrix: still fp32 arithmetic, but the sums run in
another order, so logits differ from the plain path in the last bits (docs/kernels.md).
"""
from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..cache import KVCache, dequant_int4, dequant_int8, encode_entries
from ..env import env_choice
from ..errors import ConfigError
from ..memory import READ_AHEAD_BYTES
from ..model import LoopedLM, Step
from .dispatch import use_triton

_enabled: bool | None = None
_layout: str | None = None
LAYOUTS = ("exact", "packed")


def set_enabled(on: bool | None) -> None:
    """Force the lean step on or off for this process (None: follow TINYLOOP_LEAN)."""
    global _enabled
    _enabled = on


def enabled() -> bool:
    if _enabled is not None:
        return _enabled
    value = os.environ.get("TINYLOOP_LEAN", "").strip() or "1"
    if value not in ("0", "1"):
        raise ConfigError(f"environment TINYLOOP_LEAN={value!r} is not one of ('0', '1')")
    return value == "1"


def set_layout(name: str | None) -> None:
    """Force the lean step's weight layout for this process (None: follow TINYLOOP_LEAN_WEIGHTS)."""
    global _layout
    if name is not None and name not in LAYOUTS:
        raise ConfigError(f"lean weight layout {name!r} is not one of {LAYOUTS}")
    _layout = name


def layout() -> str:
    if _layout is not None:
        return _layout
    return env_choice("TINYLOOP_LEAN_WEIGHTS", LAYOUTS, "exact")


@dataclass
class BlockWeights:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # [d + 2 kv_dim, d]: rows of wq, wk, wv
    wkv: torch.Tensor   # view of the wk|wv rows (int4 store-h recomputes K and V from h)
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    wgu: torch.Tensor   # [2 ffn, d]: rows of w_gate, w_up
    w_down: torch.Tensor
    attn_out_norm: torch.Tensor | None
    mlp_out_norm: torch.Tensor | None


def _fuse(*linears) -> torch.Tensor:
    """Concatenate the linears' weights by rows and rebind each linear's weight to its rows of the result,
    so the fused matrix is the only copy (plan_memory counts the weights once)."""
    fused = torch.cat([lin.weight for lin in linears])
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused[row:row + n], requires_grad=lin.weight.requires_grad)
        row += n
    return fused


def _block_weights(block) -> BlockWeights:
    a, m = block.attn, block.mlp
    wqkv = _fuse(a.wq, a.wk, a.wv)
    return BlockWeights(block.attn_norm.weight, wqkv, wqkv[a.wq.weight.shape[0]:], a.wo.weight, block.mlp_norm.weight,
                        _fuse(m.w_gate, m.w_up), m.w_down.weight,
                        block.attn_out_norm.weight if block.sandwich else None,
                        block.mlp_out_norm.weight if block.sandwich else None)


_weights: "weakref.WeakKeyDictionary[LoopedLM, tuple]" = weakref.WeakKeyDictionary()
_params: "weakref.WeakKeyDictionary[LoopedLM, list]" = weakref.WeakKeyDictionary()


def weights_version(net: LoopedLM) -> tuple[int, ...]:
    """The parameters' version counters: they move on any in-place change (load_state_dict, training). The
    parameter list is kept (walking the modules costs ~60 us, a few percent of a decode step)."""
    params = _params.get(net)
    if params is None:
        params = _params[net] = list(net.parameters())
    return tuple(p._version for p in params)


def model_weights(net: LoopedLM) -> tuple[list[BlockWeights], list[BlockWeights], list[BlockWeights]]:
    """Fused weights of (prelude, core, coda), built once per model and again after an in-place change of its
    parameters; the model's own linear weights become views of them, so nothing is held twice."""
    ws = _weights.get(net)
    if ws is None or ws[0] != weights_version(net):
        with torch.inference_mode(False), torch.no_grad():  # normal tensors: they keep version counters
            blocks = ([_block_weights(b) for b in net.prelude], [_block_weights(b) for b in net.core],
                      [_block_weights(b) for b in net.coda])
        _params.pop(net, None)  # rebinding made new parameters
        ws = _weights[net] = (weights_version(net), *blocks)
    return ws[1], ws[2], ws[3]


def packed_weight(w: torch.Tensor, name: str, lanes: int) -> torch.Tensor:
    """w [N, K] in layout `name` for `lanes` rows, to be multiplied by linear_for(name, lanes)."""
    if name == "exact":
        return w
    if lanes == 1:
        return w.t().contiguous()  # a row times a [K, N] matrix: MKL's faster GEMV form (30 % here), oneDNN's is slower
    # oneDNN's blocked layout for `lanes` rows: its GEMM streams the weights at 80 % of the fp32 matmul peak
    # where MKL reaches 45 % on the same [16 x 768] x [768 x 2048] product (one thread; docs/kernels.md)
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), lanes)


def _onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def linear_for(name: str, lanes: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The product x [rows, K] -> [rows, N] by a weight in packed_weight(w, name, lanes)'s form."""
    return F.linear if name == "exact" else torch.mm if lanes == 1 else _onednn_linear


def packed_norm(x: torch.Tensor, doubled: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as LayerNorm of [x, -x] (doubled = [[w], [w]]): that has mean 0 and variance mean(x^2), so its first
    half is x / sqrt(mean(x^2) + eps) * w. LayerNorm is one fused CPU kernel where rms_norm is ten small ops
    (9.6 -> 6.2 us at d_model 256); the reductions round differently, so only for the packed layout."""
    signs = _signs(x.dtype, x.device)  # [x, -x] as one broadcast product, normalised over both halves
    return F.layer_norm(x.unsqueeze(-2) * signs, doubled.shape, doubled, None, eps)[..., 0, :]


@functools.lru_cache(maxsize=8)
def _signs(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor([[1.0], [-1.0]], dtype=dtype, device=device)


@dataclass
class Layout:
    """The weights one decode step multiplies by, in one weight layout for one lane count, and the operations
    that use them: linear(x, w) for every matrix, norm(x, w, eps) for every RMSNorm, and RoPE either as the plain
    path's elementwise rotation or (rotation=True) as one product with a per-step rotation matrix."""
    name: str
    prelude: list[BlockWeights]
    core: list[BlockWeights]
    coda: list[BlockWeights]
    adapter: torch.Tensor | None
    final_norm: torch.Tensor
    head: torch.Tensor
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    rotation: bool


def exact_layout(net: LoopedLM) -> Layout:
    prelude, core, coda = model_weights(net)
    head = net.embed.weight if net.lm_head is None else net.lm_head.weight
    return Layout("exact", prelude, core, coda, None if net.adapter is None else net.adapter.weight, net.norm.weight,
                  head, F.linear, rms_norm, False)


def packed_layout(exact: Layout, lanes: int) -> Layout:
    """A second copy of every matrix in packed_weight's form, norms doubled for packed_norm."""
    mat = lambda w: packed_weight(w, "packed", lanes)
    dbl = lambda w: None if w is None else torch.stack((w, w))  # [2, d]: packed_norm's weight
    blocks = lambda ws: [BlockWeights(dbl(w.attn_norm), mat(w.wqkv), w.wkv, mat(w.wo), dbl(w.mlp_norm), mat(w.wgu),
                                      mat(w.w_down), dbl(w.attn_out_norm), dbl(w.mlp_out_norm)) for w in ws]
    return Layout("packed", blocks(exact.prelude), blocks(exact.core), blocks(exact.coda),
                  None if exact.adapter is None else mat(exact.adapter), dbl(exact.final_norm), mat(exact.head),
                  linear_for("packed", lanes), packed_norm, True)


def layout_applies(net: LoopedLM, device: torch.device) -> bool:
    """The packed layout is for CPU kernels (MKL, oneDNN) and fp32 models; elsewhere the step runs exact."""
    return device.type == "cpu" and net.embed.weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one call, composed in C++ of the same ops as RMSNorm (same bits in fp32)
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w  # tinyloop.model.RMSNorm, op for op


def rope_factors(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[cos, cos] and [-sin, sin]: rotate-half RoPE as x * cos2 + swap_halves(x) * sin2."""
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """apply_rope with three fewer ops and the same bits: x1 cos + x2 (-sin) == x1 cos - x2 sin in IEEE."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos2 + torch.cat((x2, x1), dim=-1) * sin2


def rotation_matrices(cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """R [B, hd, hd] with x @ R == rotate(x, cos2, sin2) for rows x of one lane (cos2, sin2: [B, hd]): the
    diagonal holds cos2, and column j takes sin2[j] times the element half a head away."""
    return torch.diag_embed(cos2) + _swap(cos2.shape[1], cos2.dtype, cos2.device) * sin2.unsqueeze(1)


@functools.lru_cache(maxsize=8)
def _swap(hd: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[hd, hd]: 1 where row i is column j's partner half a head away."""
    j = torch.arange(hd, device=device)
    return (j.unsqueeze(1) == (j + hd // 2) % hd).to(dtype)


class StepContext:
    """What every layer of one step shares: indices, mask, rotary factors and views of the cache (built once
    per step), and the weight layout the step multiplies by. A step is one token per lane (decode) or, for one
    lane, a chunk of T tokens (speculative drafts and verification: a chain at consecutive positions, or a
    tree's tokens in cells of their own with an ancestor mask, Step.cells / mask / key_pos)."""

    def __init__(self, net: LoopedLM, cache: KVCache, step: Step, layout: Layout):
        pos = step.pos  # [B, T]
        (B, T), dev = pos.shape, pos.device
        self.B, self.T, self.end, self.pos, self.layout = B, T, step.end, pos, layout
        self.lane = torch.arange(B, device=dev).unsqueeze(1)
        self.cos, self.sin = rope_factors(step.cos, step.sin)  # [B, T, 1, hd]: broadcast over heads
        self.rotation = rotation_matrices(self.cos[:, 0, 0], self.sin[:, 0, 0]) if layout.rotation and T == 1 else None
        self.triton = use_triton(dev)
        self.step = step
        # the cells each lane writes this step, on the host once, so blocks are taken before the layers write
        W, tree = cache.window, step.cells is not None  # a speculative tree: cells of their own, an ancestor mask
        self.cells = pos % cache.ring if W else step.cells if tree else pos
        span = pos if W else self.cells
        self.lanes = list(range(B))
        self.lo, self.hi = span.min(1).values.tolist(), span.max(1).values.tolist()
        self.blk, self.row = self.cells // cache.bt, self.cells % cache.bt
        self.one = int(self.cells) if B == 1 and T == 1 else None  # batch-1 decode: plain integer indexing
        self.buf_row = None  # read_ahead
        if self.triton:  # the kernels take positions and block tables directly
            return
        if W:
            self.mask = None  # per slot: the ring's cells carry their own positions
            return
        kpos = torch.arange(step.end, device=dev)
        # one token per lane, every lane at the same length: all keys up to end are visible, SDPA needs no
        # mask (same bits; a boolean mask costs SDPA a conversion per call, half its time at batch 16)
        lockstep = not tree and T == 1 and all(h == step.end - 1 for h in self.hi)
        self.mask = step.mask.unsqueeze(1) if tree else None if lockstep else \
            (kpos.view(1, 1, 1, -1) <= pos.view(B, 1, T, 1))
        if cache.mode == "int4":
            kp = step.key_pos if tree else kpos.expand(B, step.end)
            self.kcos, self.ksin = rope_factors(*step.rope_at(kp))

    def read_ahead(self, cache: KVCache, slots: list[int]) -> None:
        """Decode rows (one token per lane, no window, no tree) whose step reads little: gather every slot's cells
        once per step into one buffer (one index_select per stored tensor instead of one per layer); each layer
        writes its token into the buffer and attends over a view of it, and `flush` stores the step's tokens in
        the blocks afterwards. The buffer is a copy of what the step reads, so it is only built when that is small
        (READ_AHEAD_BYTES); otherwise each layer gathers its own slot."""
        nb = -(-self.end // cache.bt)
        if self.triton or cache.window or self.T != 1 or self.step.cells is not None:
            return
        if len(slots) * self.B * nb * cache.pool.block_bytes > READ_AHEAD_BYTES:
            return
        for slot in slots:  # blocks for this step's cells exist (and are the lane's own) before the gather
            cache.prepare(slot, self.lanes, self.lo, self.hi)
        index = torch.tensor(slots, device=self.pos.device)
        ids = cache.table.index_select(0, index)[:, :self.B, :nb].reshape(-1)
        S, B, end = len(slots), self.B, self.end
        self.buf = {name: t.index_select(0, ids).view(S, B, nb * cache.bt, *t.shape[2:])[:, :, :end]
                    for name, t in cache.store.items()}
        self.buf_row = {slot: i for i, slot in enumerate(slots)}
        self.buf_index = index
        if self.one is not None:
            self.buf_cell = [t[:, 0, self.one] for t in self.buf.values()]  # [S, ...]: the step's cell per slot

    def flush(self, cache: KVCache) -> None:
        """Store the step's tokens from the read-ahead buffer in their blocks (one index_put per stored tensor)."""
        if self.buf_row is None:
            return
        blk = cache.table.index_select(0, self.buf_index)[:, self.lane, self.blk]  # [S, B, 1]
        for name, t in self.buf.items():
            cache.store[name][blk, self.row] = t[:, self.lane, self.cells]

    def write(self, cache: KVCache, slot: int, new: dict[str, torch.Tensor]) -> None:
        """Store this step's entries (each [B, T, ...]) in `slot`, taking or copying blocks first."""
        store = cache.store
        if self.one is not None:  # one token of one lane: integer indexing, and the host check inline
            ids, i = cache.held[slot][0], self.one // cache.bt
            if i >= len(ids) or cache.pool.refs[ids[i]] > 1:
                cache.prepare(slot, self.lanes, self.lo, self.hi)
            b, r = ids[i], self.one % cache.bt
            for name, t in new.items():
                store[name][b, r].copy_(t[0, 0])
        else:
            cache.prepare(slot, self.lanes, self.lo, self.hi)
            blk = cache.table[slot, self.lane, self.blk]
            for name, t in new.items():
                store[name][blk, self.row] = t
        if cache.cell_pos is not None:
            cache.cell_pos[slot, self.lane, self.cells] = self.pos


class LeanStep:
    """One decode step (one token per lane) over `cache`, with the model's weights pre-fused."""

    def __init__(self, net: LoopedLM):
        self.net, self.cfg = net, net.cfg
        self.exact = exact_layout(net)
        self._packed: dict[int, Layout] = {}

    def layout(self, name: str, lanes: int) -> Layout:
        """The step's weights in layout `name` for `lanes` rows (packed: a second copy, built on first use)."""
        if name == "exact":
            return self.exact
        if lanes not in self._packed:
            if len(self._packed) >= 2:  # lane counts change rarely: keep the memory bounded
                self._packed.clear()
            self._packed[lanes] = packed_layout(self.exact, lanes)
        return self._packed[lanes]

    def context(self, step: Step, cache: KVCache, name: str | None = None) -> StepContext:
        """The shared part of a step at `step` in layout `name` (None: TINYLOOP_LEAN_WEIGHTS), exact where the
        packed layout does not apply (CUDA, the Triton path, other dtypes)."""
        name = layout() if name is None else name
        dev = step.pos.device
        if name != "exact" and (use_triton(dev) or not layout_applies(self.net, dev)):
            name = "exact"
        return StepContext(self.net, cache, step, self.layout(name, step.pos.shape[0]))

    def forward(self, ids: torch.Tensor, loops: int, step: Step, cache: KVCache) -> torch.Tensor:
        """Logits [B, 1, V] for ids [B, 1] at step.pos [B, 1]: LoopedLM.forward(ids, loops, step, cache)."""
        ctx = self.context(step, cache)
        cfg = self.cfg
        ctx.read_ahead(cache, [*range(cfg.n_prelude + cfg.n_core * loops), *range(cfg.coda_slot(0), cfg.n_slots())])
        s, _ = self.depth(ids, loops, ctx, cache)
        logits = self.head(s, ctx, cache)
        ctx.flush(cache)
        return logits

    def depth(self, ids: torch.Tensor, loops: int, ctx: StepContext, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding, prelude and `loops` loops of the core for ids [B, T]: the state s and the injected e as
        rows [B*T, d]."""
        x = self.net.embed(ids.reshape(-1))
        for i, w in enumerate(ctx.layout.prelude):
            x = self.block(w, x, ctx, cache, i)
        return self.loops(self.net.init_state(x, ctx.step).reshape(x.shape), x, 0, loops, ctx, cache), x

    def loops(self, s: torch.Tensor, e: torch.Tensor, k0: int, k1: int, ctx: StepContext, cache: KVCache) -> torch.Tensor:
        """Loops k0..k1-1 of the core (0-based) from state rows s with injected rows e."""
        cfg, lay = self.cfg, ctx.layout
        for k in range(k0, k1):
            inj = cfg.injection
            x = s if inj == "none" else s + e if inj == "add" else lay.linear(torch.cat((s, e), dim=-1), lay.adapter)
            for j, w in enumerate(lay.core):
                x = self.block(w, x, ctx, cache, cfg.core_slot(k, j))
            s = x
        return s

    def head(self, s: torch.Tensor, ctx: StepContext, cache: KVCache) -> torch.Tensor:
        """Coda, final norm and LM head of state rows s [B*T, d]: logits [B, T, V]."""
        lay = ctx.layout
        for i, w in enumerate(lay.coda):
            s = self.block(w, s, ctx, cache, self.cfg.coda_slot(i))
        return lay.linear(lay.norm(s, lay.final_norm, self.cfg.norm_eps), lay.head).view(ctx.B, ctx.T, -1)

    def block(self, w: BlockWeights, x: torch.Tensor, ctx: StepContext, cache: KVCache, slot: int) -> torch.Tensor:
        """One pre-norm block over the step's token rows: x [B*T, d] -> [B*T, d]."""
        cfg, eps = self.cfg, self.cfg.norm_eps
        B, T, H, KV, hd = ctx.B, ctx.T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if ctx.triton:  # CUDA: fused kernels (tinyloop/kernels), written to be captured in a CUDA graph
            return self.block_triton(w, x.view(B, T, -1), ctx, cache, slot).view(B * T, -1)
        linear, norm = ctx.layout.linear, ctx.layout.norm
        h = norm(x, w.attn_norm, eps)
        qkv = linear(h, w.wqkv)  # [B*T, d + 2 kv]
        qk = qkv[:, :(H + KV) * hd]
        if ctx.rotation is not None:  # one batched product instead of the rotation's five elementwise ops
            qk = torch.bmm(qk.view(B, H + KV, hd), ctx.rotation).view(B, 1, H + KV, hd)
        else:
            qk = rotate(qk.view(B, T, H + KV, hd), ctx.cos, ctx.sin)
        v = qkv[:, (H + KV) * hd:].view(B, T, KV, hd)
        out = self.attend(w, qk[:, :, :H], h.view(B, T, -1), qk[:, :, H:], v, ctx, cache, slot)
        a = linear(out.transpose(1, 2).reshape(B * T, H * hd), w.wo)
        x = x + (norm(a, w.attn_out_norm, eps) if w.attn_out_norm is not None else a)
        gate, up = linear(norm(x, w.mlp_norm, eps), w.wgu).chunk(2, dim=-1)
        if ctx.layout.name == "exact":  # contiguous like the plain path's gate: silu's vector loop and its scalar
            gate = gate.contiguous()     # tail round differently
        m = linear(F.silu(gate) * up, w.w_down)
        return x + (norm(m, w.mlp_out_norm, eps) if w.mlp_out_norm is not None else m)

    def block_triton(self, w: BlockWeights, x: torch.Tensor, ctx: StepContext, cache: KVCache, slot: int) -> torch.Tensor:
        from .attention import decode_attend
        from .norm import add_rmsnorm
        from .rope import rope
        cfg, eps = self.cfg, self.cfg.norm_eps
        B, H, KV, hd = ctx.B, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        _, h = add_rmsnorm(x, None, w.attn_norm, eps)
        qkv = F.linear(h, w.wqkv)
        qk = rope(qkv[..., :(H + KV) * hd].view(B, 1, H + KV, hd), ctx.pos, ctx.step.table_cos, ctx.step.table_sin)
        v = qkv[..., (H + KV) * hd:].view(B, 1, KV, hd)
        # blocks from the host-side span of the context: no device read, so a CUDA graph captures the step
        # (CudaGraphStep prepares before each replay; during capture the blocks exist and this changes nothing)
        cache.prepare(slot, ctx.lanes, ctx.lo, ctx.hi)
        out = decode_attend(cache, _KVProxy(w), slot, ctx.step, qk[:, :, :H], h, qk[:, :, H:], v, prepare=False)
        a = F.linear(out.transpose(1, 2).reshape(B, 1, H * hd), w.wo)
        if w.attn_out_norm is not None:
            x, h = add_rmsnorm(x, add_rmsnorm(a, None, w.attn_out_norm, eps)[1], w.mlp_norm, eps)
        else:
            x, h = add_rmsnorm(x, a, w.mlp_norm, eps)  # residual add fused with the MLP's norm
        gate, up = F.linear(h, w.wgu).chunk(2, dim=-1)
        m = F.linear(F.silu(gate) * up, w.w_down)
        return x + (rms_norm(m, w.mlp_out_norm, eps) if w.mlp_out_norm is not None else m)

    def attend(self, w: BlockWeights, q, h, k, v, ctx: StepContext, cache: KVCache, slot: int) -> torch.Tensor:
        """KVCache.update + SDPA for T tokens per lane (q [B, T, H, hd], h [B, T, d], k and v [B, T, KV, hd]) with
        the step's shared indices (torch path); the heads' outputs [B, H, T, hd]."""
        mode, B = cache.mode, ctx.B
        new = encode_entries(mode, h, k, v)
        row = ctx.buf_row.get(slot) if ctx.buf_row is not None else None
        if row is not None:  # read-ahead: the token goes into the step's buffer, attention reads a view of it
            if ctx.one is not None:
                for cell, t in zip(ctx.buf_cell, new.values()):
                    cell[row].copy_(t[0, 0])
            else:
                for buf, t in zip(ctx.buf.values(), new.values()):
                    buf[row][ctx.lane, ctx.cells] = t
            keys, values = self.decode(w, {name: t[row] for name, t in ctx.buf.items()}, mode, cache.dtype, B, None, ctx)
            return F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                                  attn_mask=ctx.mask, enable_gqa=True)
        if cache.window:  # as KVCache.update: attend over the ring as it was plus the token, then store it
            data = {name: torch.cat((old, new[name]), dim=1) for name, old in cache.gather(slot, B, cache.ring).items()}
            kpos = torch.cat((cache.cell_pos[slot, :B], ctx.pos), dim=1)
            kp, qp = kpos.unsqueeze(1), ctx.pos.unsqueeze(-1)
            mask = ((kp >= 0) & (kp <= qp) & (kp > qp - cache.window)).unsqueeze(1)
            keys, values = self.decode(w, data, mode, cache.dtype, B, kpos, ctx)
            ctx.write(cache, slot, new)
        else:
            ctx.write(cache, slot, new)
            keys, values = self.decode(w, cache.gather(slot, B, ctx.end), mode, cache.dtype, B, None, ctx)
            mask = ctx.mask
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                              attn_mask=mask, enable_gqa=True)

    def decode(self, w: BlockWeights, data, mode: str, dtype, B: int, kpos, ctx: StepContext):
        if mode == "fp16":
            return data["k"], data["v"]
        if mode == "int8":
            return dequant_int8(data["k"], data["k_scale"], dtype), dequant_int8(data["v"], data["v_scale"], dtype)
        h = dequant_int4(data["h"], data["h_scale"], dtype)
        n, KV, hd = h.shape[1], self.cfg.n_kv_heads, self.cfg.head_dim
        kv = F.linear(h, w.wkv)
        cos, sin = (ctx.kcos, ctx.ksin) if kpos is None else rope_factors(*ctx.step.rope_at(kpos.clamp_min(0)))
        k = rotate(kv[..., :KV * hd].view(B, n, KV, hd), cos, sin)
        return k, kv[..., KV * hd:].view(B, n, KV, hd)


class _KVProxy:
    """What the Triton attention needs of an Attention module: wk and wv (views of the fused weights)."""

    def __init__(self, w: BlockWeights):
        kv = w.wkv.shape[0] // 2
        self.wk, self.wv = _W(w.wkv[:kv]), _W(w.wkv[kv:])


class _W:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight


_steps: "weakref.WeakKeyDictionary[LoopedLM, LeanStep]" = weakref.WeakKeyDictionary()


def lean_step(net: LoopedLM) -> LeanStep:
    s = _steps.get(net)
    if s is None or s.exact.prelude is not model_weights(net)[0]:
        s = _steps[net] = LeanStep(net)
    return s


def decode_threads(lanes: int, cfg) -> int:
    """Intra-op threads for a CPU decode step (0: leave torch's setting).

    A batch-1 step of a small model is hundreds of operations of a few microseconds each; splitting them
    over threads costs more in wake-ups than it saves, and on a busy machine spinning threads wait for
    cores (measured in docs/kernels.md). Below ~262K multiply-adds per d x d projection (batch 1 of a model
    up to d_model 512) one thread runs the step; at batch 16 of the shipped model two threads already win.
    TINYLOOP_DECODE_THREADS=n forces n (0 = torch's setting).
    """
    value = os.environ.get("TINYLOOP_DECODE_THREADS", "").strip()
    if value:
        if not value.isdigit():
            raise ConfigError(f"environment TINYLOOP_DECODE_THREADS={value!r} is not an integer >= 0")
        return int(value)
    return 1 if lanes * cfg.d_model * cfg.d_model < 2 ** 18 else 0


def decode_forward(net: LoopedLM, ids: torch.Tensor, loops: int, step: Step, cache: KVCache) -> torch.Tensor:
    """Drop-in for net(ids, loops, step, cache) when every lane brings one token: lean when enabled."""
    if ids.shape[1] != 1 or not enabled() or getattr(step, "cells", None) is not None \
            or getattr(step, "mask", None) is not None:
        return net(ids, loops, step, cache)
    if ids.device.type == "cuda" and use_triton(ids.device) and graphs_enabled():
        return cuda_graph(net, cache, ids.shape[0], loops).run(ids, step.pos)
    threads = decode_threads(ids.shape[0], net.cfg) if ids.device.type == "cpu" else 0
    before = torch.get_num_threads()
    if threads and threads != before:
        torch.set_num_threads(threads)
    try:
        return lean_step(net).forward(ids, loops, step, cache)
    finally:
        if threads and threads != before:
            torch.set_num_threads(before)


# --- CUDA graphs ------------------------------------------------------------------------------------------
def graphs_enabled() -> bool:
    return os.environ.get("TINYLOOP_CUDA_GRAPHS", "1").strip() != "0"


class CudaGraphStep:
    """The lean step captured once as a CUDA graph and replayed per token (one launch instead of hundreds).

    Shapes must not change between replays, so the graph reads the cache at its full length (Step.end =
    max_len, or the ring's cells): the Triton attention skips cells past each lane's own length, which it
    reads from the positions on the device, so the work still follows the real lengths. Tokens and positions
    are copied into static buffers before each replay; the logits buffer is overwritten by the next replay.
    Blocks are taken and copied on the host, which a graph cannot do: before each replay every slot the step
    writes gets its blocks for the lanes' positions (cache.prepare), and the graph reads the block table, which
    prepare updates in place.
    """

    def __init__(self, net: LoopedLM, cache: KVCache, lanes: int, loops: int):
        self.net, self.cache, self.loops = net, cache, loops
        dev = net.embed.weight.device
        self.ids = torch.zeros(lanes, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(lanes, 1, dtype=torch.long, device=dev)
        self.graph, self.logits = None, None
        cfg = net.cfg
        self.slots = [*range(cfg.n_prelude), *(cfg.core_slot(k, j) for k in range(loops) for j in range(cfg.n_core)),
                      *(cfg.coda_slot(i) for i in range(cfg.n_coda))]

    def prepare(self) -> None:
        """Blocks for this step's cells in every slot it writes (host work, outside the graph)."""
        at = self.pos[:, 0].tolist()
        for slot in self.slots:
            self.cache.prepare(slot, list(range(len(at))), at, at)

    def _context(self) -> StepContext:
        """The step's shared part, built outside a capture: it reads positions on the host. Its device tensors
        are views of (or computed from) the static buffers, and the Triton path uses only those."""
        n = self.cache.ring if self.cache.window else self.cache.max_len
        step = Step(self.pos, n, self.net.rope_cos, self.net.rope_sin)
        return lean_step(self.net).context(step, self.cache)

    def _forward(self, ctx: StepContext) -> torch.Tensor:
        lean = lean_step(self.net)
        s, _ = lean.depth(self.ids, self.loops, ctx, self.cache)
        return lean.head(s, ctx, self.cache)

    def _step(self) -> torch.Tensor:
        """One step run eagerly (what the graph captures)."""
        self.prepare()
        return self._forward(self._context())

    def run(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.prepare()
        if self.graph is None:
            # Warm-up (compiles the Triton kernels) runs the real token: its cache writes are the ones the
            # replay below makes again, so running it twice is harmless.
            ctx = self._context()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(ctx)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._forward(ctx)
        self.graph.replay()
        return self.logits.clone()  # the next replay overwrites the graph's buffer


_graphs: "weakref.WeakKeyDictionary[KVCache, dict]" = weakref.WeakKeyDictionary()


def cuda_graph(net: LoopedLM, cache: KVCache, lanes: int, loops: int) -> CudaGraphStep:
    """One captured step per (cache, model, lanes, loops): the graph holds the cache's addresses."""
    per_cache = _graphs.setdefault(cache, {})
    key = (id(net), lanes, loops)
    if key not in per_cache:
        per_cache[key] = CudaGraphStep(net, cache, lanes, loops)
    return per_cache[key]
