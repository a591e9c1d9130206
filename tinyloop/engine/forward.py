"""The cached step: how tinyloop.model's forward reads and writes the paged KV cache.

The model's math is written once (tinyloop/model.py: `block`, `LoopedLM.encode/loop/decode_head`); it runs over a
chunk of B lanes x T tokens and leaves two things to the chunk's context: rotating q and k, and attention. `Cached`
is that context for every call with a cache (prefill chunks, decode rows, speculative chains and trees, early exit).
What every layer of a chunk shares is computed once per chunk, not per layer: lane and cell indices, the blocks
the chunk writes, the mask, the rotary factors.

The forward over a loop range (`LoopForward`: first and last loop, latent states in and out, its backend chosen per
call) is the one primitive every cached path runs: a decode step or a prefill chunk is the range 0..loops from the
tokens; speculative decoding drafts a token from loop 0 to draft_loops and continues the drafted chunk from there to
verify_loops; a resume handle deepens its prompt from its depth to a deeper one; an early-exit token's head is the
range 0..0 from its state. Its torch backend (`loop_range`) runs the model's loops through LoopedLM.run_loops, the
one loop driver, which the iteration steps' passes (engine/iteration.py) call too.

Backends:
  C       token rows on CPU (the fp16 cache mode holding fp32, no ring): decode rows (one token per lane) and
          speculative chunks and trees (rows of one lane): each block is one call of kernels/cpu_block.c, attending
          over the paged cache through the block tables; with every row at the same loops and no early exit, the
          whole forward (or loop range) is one call (cpu_block.DecodeStep)
  torch   SDPA over the slot's cells, gathered from the blocks (CPU; CUDA with TINYLOOP_TRITON=0). Decode rows
          that read little gather every slot once per step into one buffer (`read_ahead`). On the CPU a causal chunk
          (prefill) over the fp16 mode holding fp32 attends in C straight over the blocks instead
          (kernels/cpu_attention.c; TINYLOOP_CPU_ATTENTION=0: SDPA).
  Triton  decode rows on CUDA (or TINYLOOP_TRITON=1): fused attention over the block tables and quantise-on-write
          kernels (tinyloop/kernels/attention.py, quant.py), RoPE and RMSNorm kernels; `CudaGraphStep` replays a
          whole decode step as one CUDA graph.

Products: every matrix is multiplied through tinyloop/kernels/linear.py, in the format the model holds it in
(fp32, bf16, int8, int4; tinyloop/formats.py), held once: no second copy for a faster layout.
"""
from __future__ import annotations

import dataclasses
import os
import weakref

import torch
import torch.nn.functional as F

from ..cache import KVCache, decode_entries, encode_entries
from ..errors import ConfigError
from ..exits import ExitRule, exit_stops
from ..formats import QMatrix
from ..memory import READ_AHEAD_BYTES, READ_AHEAD_GROWTH
from ..model import BlockWeights, LoopedLM, Step, Weights, fused_weights
from ..rotary import rope_factors, rotate
from ..kernels import cpu, cpu_block
from ..kernels.dispatch import use_triton
from ..kernels.linear import linear

def _triton_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    from ..kernels.norm import add_rmsnorm
    return add_rmsnorm(x, None, w, eps)[1]


# --- the context ---------------------------------------------------------------------------------------------
class Cached:
    """The context of a chunk (B lanes x T tokens at step.pos) over `cache`: what model.block asks of it (rope,
    attend, and the chunk's tokens where its layers read them: `ids`, value embeddings). A tree chunk (speculative
    decoding) brings its own
    cells, key positions and ancestor mask (Step.cells / key_pos / mask)."""

    ids: torch.Tensor | None = None  # the chunk's token ids [B*T] (set by encode), read by value-embedding layers

    def __init__(self, net: LoopedLM, cache: KVCache, step: Step, weights: Weights, triton: bool):
        pos = step.pos  # [B, T]
        (B, T), dev = pos.shape, pos.device
        self.net, self.cache, self.step, self.weights, self.triton = net, cache, step, weights, triton
        self.B, self.T, self.end, self.pos = B, T, step.end, pos
        self.lane = torch.arange(B, device=dev).unsqueeze(1)
        self.cos, self.sin = rope_factors(step.cos, step.sin)  # [B, T, 1, hd]: broadcast over heads
        # the cells each lane writes, on the host once, so blocks are taken before the layers write
        W, tree = cache.window, step.cells is not None
        self.cells: torch.Tensor = pos % cache.ring if W else step.cells if step.cells is not None else pos
        span = pos if W else self.cells
        self.lanes = list(range(B))
        self.lo, self.hi = span.min(1).values.tolist(), span.max(1).values.tolist()
        self.keep = slice(max(0, T - cache.ring), T) if W else slice(None)  # a ring keeps the chunk's newest cells
        self.blk, self.row = self.cells // cache.bt, self.cells % cache.bt
        self.one = int(self.cells) if B == 1 and T == 1 else None  # batch-1 decode: plain integer indexing
        self.buf_row: dict[int, int] | None = None  # read_ahead
        self.mask: torch.Tensor | None = None
        self.c_attention = False
        self.native: cpu_block.Rows | cpu_block.Chunk | None = None
        native = not triton and T == 1 and not tree and step.mask is None and _native_blocks(net, cache, B, weights)
        if native:
            cache.changed()  # the C blocks write the cache themselves (a kept read-ahead buffer is stale)
            self.native = cpu_block.Rows(net.cfg, cache, self.cells, self.cos, self.sin, native)
            self.weights = dataclasses.replace(weights, norm=cpu_block.rms_norm)  # the norms outside the blocks too
            return
        if triton or W:  # Triton takes positions and block tables; a ring's cells carry their own positions
            return
        # a causal chunk over a plain fp32 store attends in C over the blocks (kernels/cpu_attention.c): no gathered
        # copy of the lanes' cells, no mask
        cfg = net.cfg
        self.c_attention = T > 1 and not tree and cache.mode == "fp16" and cache.dtype == torch.float32 \
            and dev.type == "cpu" and min(self.lo) >= 0 \
            and cpu.attention_available(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        # one token per lane, every lane at the same length: all keys up to end are visible, SDPA needs no
        # mask (same bits; a boolean mask costs SDPA a conversion per call, half its time at batch 16)
        lockstep = not tree and T == 1 and all(h == step.end - 1 for h in self.hi)
        if tree:
            assert step.mask is not None  # (a tree chunk brings its ancestor mask: Step)
            self.mask = step.mask.unsqueeze(1)
        else:
            self.mask = None if lockstep or self.c_attention else self.causal_mask()
        # a chunk of many rows over that store runs its blocks in C too, its products on the tiled GEMM
        shape = _native_blocks(net, cache, 1, weights) if self.c_attention and B * T > cpu_block.MAX_LANES else None
        if shape is not None and cpu_block.chunk_supported(cfg, cache, B * T, net.embed.weight.dtype, shape):
            cache.changed()
            self.native = cpu_block.Chunk(cfg, cache, pos, self.cos, self.sin, shape)
        if cache.mode == "int4":
            if tree:
                assert step.key_pos is not None  # (a tree chunk brings its key positions: Step)
                kp = step.key_pos
            else:
                kp = torch.arange(step.end, device=dev).expand(B, step.end)
            self.kcos, self.ksin = rope_factors(*step.rope_at(kp))

    def causal_mask(self) -> torch.Tensor:
        """[B, 1, T, end]: which cells each token sees (those up to its position)."""
        kpos = torch.arange(self.end, device=self.pos.device)
        return kpos.view(1, 1, 1, -1) <= self.pos.view(self.B, 1, self.T, 1)

    # --- what model.block asks ---------------------------------------------------------------------------
    def rope(self, qk: torch.Tensor) -> torch.Tensor:
        """qk [B, T, heads, hd] rotated at the chunk's positions."""
        if self.triton:
            from ..kernels.rope import rope
            return rope(qk, self.pos, self.step.table_cos, self.step.table_sin)
        return rotate(qk, self.cos, self.sin)

    def attend(self, w: BlockWeights, slot: int, q, h, k, v) -> torch.Tensor:
        """Store the chunk's entries in `slot` and attend over what the slot holds for each lane (q [B, T, H, hd],
        h [B, T, d], k and v [B, T, KV, hd]); the heads' outputs [B, H, T, hd]."""
        cache, B = self.cache, self.B
        if self.triton:
            from ..kernels.attention import decode_attend
            # blocks from the host-side span of the context: no device read, so a CUDA graph captures the step
            # (the step's blocks were taken before it, so a CUDA graph captures it)
            cache.require([(slot, self.lanes, self.lo, self.hi)])
            cache.changed()
            return decode_attend(cache, _KVProxy(w), slot, self.step, q, h, k, v, check=False)
        new = encode_entries(cache.mode, h, k, v)
        row = self.buf_row.get(slot) if self.buf_row is not None else None
        mask = self.mask
        if row is not None:  # read-ahead: the token goes into the step's buffer, attention reads a view of it
            if self.one is not None:
                for cell, t in zip(self.buf_cell, new.values()):
                    cell[row].copy_(t[0, 0])
            else:
                for buf, t in zip(self.buf.values(), new.values()):
                    buf[row][self.lane, self.cells] = t
            keys, values = self.decode(w, {name: t[row] for name, t in self.buf.items()}, None)
        elif cache.window:  # attend over the ring as it was plus the chunk, then store the chunk's newest cells
            data = {name: torch.cat((old, new[name]), dim=1) for name, old in cache.gather(slot, B, cache.ring).items()}
            assert cache.cell_pos is not None  # (a ring's cells carry their positions)
            kpos = torch.cat((cache.cell_pos[slot, :B], self.pos), dim=1)
            kp, qp = kpos.unsqueeze(1), self.pos.unsqueeze(-1)
            mask = ((kp >= 0) & (kp <= qp) & (kp > qp - cache.window)).unsqueeze(1)
            keys, values = self.decode(w, data, kpos)
            self.write(slot, new)
        else:
            self.write(slot, new)
            if self.c_attention:
                if q.dtype is torch.float32 and not q.requires_grad:
                    return cpu.prefill_attention(q, cache.store["k"], cache.store["v"], cache.table[slot], self.pos,
                                                 self.end).transpose(1, 2)
                mask = self.causal_mask()  # (autograd, or a model in another dtype than its cache)
            keys, values = self.decode(w, cache.gather(slot, B, self.end), None)
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                              attn_mask=mask, enable_gqa=True)

    def decode(self, w: BlockWeights, data: dict[str, torch.Tensor], kpos: torch.Tensor | None):
        """Full-precision keys and values [B, n, KV, hd] from stored entries (int4 store-h: recomputed from h)."""
        def project(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            B, n, KV, hd = self.B, h.shape[1], self.net.cfg.n_kv_heads, self.net.cfg.head_dim
            kv = linear(h, w.wkv, any_rows=True)
            if w.bqkv is not None:
                kv = kv + w.bqkv[self.net.cfg.d_model:]
            cos, sin = (self.kcos, self.ksin) if kpos is None else rope_factors(*self.step.rope_at(kpos.clamp_min(0)))
            return rotate(kv[..., :KV * hd].view(B, n, KV, hd), cos, sin), kv[..., KV * hd:].view(B, n, KV, hd)
        return decode_entries(self.cache.mode, data, self.cache.dtype, project)

    def write(self, slot: int, new: dict[str, torch.Tensor]) -> None:
        """Store the chunk's entries (each [B, T, ...]) in `slot`, in the blocks its step took."""
        cache, store = self.cache, self.cache.store
        cache.changed()
        if self.one is not None:  # one token of one lane: integer indexing, and the host check inline
            ids, i = cache.held[slot][0], self.one // cache.bt
            if i >= len(ids) or cache.pool.refs[ids[i]] > 1:
                cache.require([(slot, self.lanes, self.lo, self.hi)])  # (raises: the step took no block there)
            b, r = ids[i], self.one % cache.bt
            for name, t in new.items():
                store[name][b, r].copy_(t[0, 0])
        else:
            cache.require([(slot, self.lanes, self.lo, self.hi)])
            keep = self.keep
            blk = cache.table[slot, self.lane, self.blk[:, keep]]
            for name, t in new.items():
                store[name][blk, self.row[:, keep]] = t[:, keep]
        if cache.cell_pos is not None:
            cache.cell_pos[slot, self.lane, self.cells[:, self.keep]] = self.pos[:, self.keep]

    def commit(self) -> None:
        self.cache.commit()

    # --- read-ahead (decode rows) -----------------------------------------------------------------------
    def read_ahead(self, slots: list[int]) -> None:
        """Decode rows (one token per lane, no window, no tree): attend over one buffer holding every slot's cells of
        these lanes instead of gathering each layer's keys out of the blocks. Each layer writes its token into the
        buffer and attends over a view of it; `flush` stores the step's tokens in their blocks afterwards and keeps
        the buffer for the next step, which reuses it when it runs the same lanes one position further and nothing
        else changed the cache meanwhile (`KVCache.changed`); else it is gathered again (one index_select per stored
        tensor). The buffer is a copy of what the step reads (plus room to grow), so it is only used while that fits
        in READ_AHEAD_BYTES; beyond, each layer gathers its own slot."""
        cache, B = self.cache, self.B
        if self.native or self.triton or cache.window or self.T != 1 or self.step.cells is not None:
            return
        bt, nb = cache.bt, -(-self.end // cache.bt)
        room = min(nb + READ_AHEAD_GROWTH, -(-cache.cells // bt))  # blocks the buffer holds per lane and slot
        if len(slots) * B * room * cache.pool.block_bytes > READ_AHEAD_BYTES:
            return
        # blocks for this step's cells exist (and are the lane's own) before the layers write
        cache.require([(slot, self.lanes, self.lo, self.hi) for slot in slots])
        key = (tuple(slots), tuple(id(cache.held[slots[0]][b]) for b in range(B)))  # the lanes' own block lists
        kept = cache.shared["read_ahead"]
        if kept is not None and kept["key"] == key and kept["next"] == self.hi and self.end <= kept["cells"]:
            full = kept["buf"]
        else:
            index = torch.tensor(slots, device=self.pos.device)
            ids = cache.table.index_select(0, index)[:, :B, :nb].reshape(-1)
            full = {}
            for name, t in cache.store.items():
                # zeros beyond what is gathered, as in a fresh block: masked cells must not hold NaN bit patterns
                full[name] = t.new_zeros((len(slots), B, room * bt, *t.shape[2:]))
                full[name][:, :, :nb * bt] = t.index_select(0, ids).view(len(slots), B, nb * bt, *t.shape[2:])
        self.full, self.key, self.slots = full, key, slots
        self.buf = {name: t[:, :, :self.end] for name, t in full.items()}
        self.buf_row = {slot: i for i, slot in enumerate(slots)}
        if self.one is not None:
            self.buf_cell = [t[:, 0, self.one] for t in self.buf.values()]  # [S, ...]: the step's cell per slot

    def flush(self) -> None:
        """Store the step's tokens from the read-ahead buffer in their blocks (one index_put per stored tensor), and
        keep the buffer for the next step."""
        if self.buf_row is None:
            return
        cache = self.cache
        index = torch.tensor(self.slots, device=self.pos.device)
        blk = cache.table.index_select(0, index)[:, self.lane, self.blk]  # [S, B, 1]
        for name, t in self.buf.items():
            cache.store[name][blk, self.row] = t[:, self.lane, self.cells]
        cells = next(iter(self.full.values())).shape[2]
        cache.shared["read_ahead"] = {"key": self.key, "buf": self.full, "cells": cells, "next": [p + 1 for p in self.hi]}
        self.buf_row = None


class _KVProxy:
    """What the Triton attention needs of an Attention module: wk and wv (views of the fused weights). Only the int4
    store-h cache reads them (it recomputes K and V from h by fp32 wk and wv), and `context` keeps a model holding
    quantised matrices (formats.QMatrix, no tensor to slice) off that path: its wk and wv are None."""

    def __init__(self, w: BlockWeights):
        wkv = w.wkv
        if isinstance(wkv, QMatrix):
            self.wk = self.wv = _W(None)
            return
        kv = wkv.shape[0] // 2
        self.wk, self.wv = _W(wkv[:kv]), _W(wkv[kv:])


class _W:
    def __init__(self, weight: torch.Tensor | None):
        self.weight = weight


def context(net: LoopedLM, step: Step, cache: KVCache) -> Cached:
    """The context of a chunk at `step` over `cache`: the model's weights multiplied through kernels/linear.py;
    Triton runs decode rows on CUDA (or when forced)."""
    triton = use_triton(step.pos.device) and step.pos.shape[1] == 1 and step.cells is None and step.mask is None \
        and triton_supports(net.cfg) and not (cache.mode == "int4" and net.quantized is not None)
    weights = dataclasses.replace(fused_weights(net), linear=linear)
    if triton:  # (the int4 store-h kernel recomputes K and V from h by fp32 wk and wv)
        weights = dataclasses.replace(weights, norm=_triton_norm)
    return Cached(net, cache, step, weights, triton)


def _native_blocks(net: LoopedLM, cache: KVCache, B: int, weights: Weights):
    """When a decode step of B lanes runs its blocks as C calls (kernels/cpu_block.py): the first block's C
    description (every block has the same shapes); else None."""
    if not cpu_block.supported(net.cfg, cache, B, net.embed.weight.dtype):
        return None
    structs = [cpu_block.weights_struct(w) for part in (weights.prelude, weights.core, weights.coda) for w in part]
    return None if any(s is None for s in structs) else structs[0]


def triton_supports(cfg) -> bool:
    """The Triton kernels (fused norms, int4 store-h recompute) do not yet take the fields real checkpoints bring
    (q/k biases, norms on the residual sums or after each loop): such models run the torch path on CUDA too."""
    return not (cfg.qk_bias or cfg.sandwich_residual or cfg.loop_norm or cfg.coda_norm or not cfg.final_norm)


# --- the entry points -------------------------------------------------------------------------------------
def decode_threads(lanes: int, cfg, cache: KVCache | None = None, c_blocks: bool | None = None) -> int:
    """Intra-op threads for a CPU decode step (0: leave torch's setting).

    A step whose blocks run as C calls (kernels/cpu_block.py: decode rows over a cache they support) keeps torch's
    threads: each block is one OpenMP team, so threads cost one wake-up per block, and two threads won at every
    batch (docs/kernels.md). A step through torch's operations is hundreds
    of operations of a few microseconds each; splitting them over threads costs more in wake-ups than it saves,
    and on a busy machine spinning threads wait for cores (measured in docs/kernels.md). There, below ~262K
    multiply-adds per d x d projection (batch 1 of a model up to d_model 512) one thread runs the step.
    TINYLOOP_DECODE_THREADS=n forces n (0 = torch's setting).
    """
    value = os.environ.get("TINYLOOP_DECODE_THREADS", "").strip()
    if value:
        if not value.isdigit():
            raise ConfigError(f"environment TINYLOOP_DECODE_THREADS={value!r} is not an integer >= 0")
        return int(value)
    if c_blocks is None:  # (the caller may know already)
        c_blocks = cache is not None and cpu_block.supported(cfg, cache, lanes, cache.dtype)
    if c_blocks:
        return 0
    return 1 if lanes * cfg.d_model * cfg.d_model < 2 ** 18 else 0


class torch_threads:
    """torch's intra-op threads set to n for a block (0: unchanged)."""

    def __init__(self, n: int):
        self.n, self.before = n, torch.get_num_threads()

    def __enter__(self):
        if self.n and self.n != self.before:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        if self.n and self.n != self.before:
            torch.set_num_threads(self.before)


def forward(net: LoopedLM, ids: torch.Tensor, loops: int, step: Step, cache: KVCache,
            exit_threshold: "ExitRule | float" = 0.0, last_only: bool = False) -> torch.Tensor:
    """Logits [B, T, V] of a chunk ids [B, T] at step.pos, every lane at `loops` loops, through `cache`: the loop range
    0..loops from ids with the head (LoopForward; exit_threshold: the cdf rule's choice of each position's loop,
    LoopedLM.chunk_exits). A chunk of up to cpu_block.MAX_LANES tokens in all runs as the C step's rows where it can:
    each row then has the bits of its token decoded alone at its cell, whatever chunk it came in."""
    logits = LoopForward(net, cache)(step, 0, loops, None, ids, last_only=last_only,
                                     exits=ExitRule.of(exit_threshold, net.cfg.exit_rule))
    assert logits is not None  # (with the head)
    return logits


def c_chunk(net: LoopedLM, cache: KVCache, rows: int, exits: ExitRule | None = None) -> cpu_block.DecodeStep | None:
    """The C step that runs a chunk of `rows` tokens over `cache` at every loop, or None (the model's pieces through
    torch run it): on the CPU, up to cpu_block.MAX_LANES rows where cpu_block.supported says the blocks run in C,
    and not under the cdf rule with a threshold (LoopedLM.forward picks each position's exit loop). A prefill piece
    that fits runs here, alone or with other prompts' pieces (CBackend.prefill_rows): the row kernels stream each
    weight once for all its rows, where the torch path costs hundreds of operations per loop."""
    if cache.device.type != "cpu" or rows > cpu_block.MAX_LANES or \
            exits is not None and exits.rule == "cdf" and exits.threshold > 0:
        return None
    if not cpu_block.supported(net.cfg, cache, rows, net.embed.weight.dtype):
        return None
    return c_step(net, cache)


def c_step(net: LoopedLM, cache: KVCache) -> cpu_block.DecodeStep | None:
    """The DecodeStep running token rows on the CPU when their blocks run in C (the caller checked
    cpu_block.supported), or None (Triton forced on the CPU runs its kernels instead)."""
    return None if use_triton(cache.device) else cpu_block.decode_step(net, fused_weights(net))


def decode_rows(net: LoopedLM, tokens: list[int], positions: list[int], loops: int, cache: KVCache,
                lanes: list[int] | None = None) -> torch.Tensor:
    """Logits [B, V] of one token per lane (lanes 0..B-1 of `cache`), every lane at `loops` loops: `forward` of
    those rows, without building tensors the CPU's whole-step decode would only turn back into lists. `lanes`: the
    rows' lanes where some lane has several rows (a speculative chunk's, at consecutive positions; the C step only,
    forward.c_chunk says when)."""
    logits = LoopForward(net, cache).rows(positions, 0, loops, None, tokens, lanes=lanes)
    assert logits is not None  # (with the head)
    return logits.view(len(tokens), -1)


@dataclasses.dataclass
class Latent:
    """A chunk's latent rows between loops ([B, T, d] each): e, the prelude's output that every loop is injected
    with, and s, the state after the loops run so far. `LoopForward` reads and writes them in place. ids: the rows'
    tokens [B, T], for a model whose layers read them at every loop (value embeddings; the torch backend)."""
    e: torch.Tensor
    s: torch.Tensor
    ids: torch.Tensor | None = None

    @staticmethod
    def empty(B: int, T: int, net: LoopedLM) -> "Latent":
        w = net.embed.weight
        return Latent(w.new_empty(B, T, net.cfg.d_model), w.new_empty(B, T, net.cfg.d_model))

    def rows(self, index: torch.Tensor) -> "Latent":
        """The latent of some tokens of a one-lane chunk (index into T), as a new [1, len(index), d] latent."""
        return Latent(self.e[:, index], self.s[:, index])


@dataclasses.dataclass
class RowExits:
    """The early exit of a chunk's tokens over `LoopForward.until` calls (a speculative round's drafts, then their
    verification): the rule (adaptive: it may stop a token before `loops`, exits.ExitRule), the loops the deepest
    token runs (skipped loops are filled up to it), and per token the loops it ran (`used`) and whether it stopped
    (`done`)."""
    rule: ExitRule
    adaptive: bool
    loops: int
    used: list[int]
    done: list[bool]


class LoopForward:
    """The cached forward of a loop range, the one primitive every cached path runs: prefill chunks and decode rows
    (`forward`, `decode_rows`: the range 0..loops from ids with the head), speculative drafts (0..draft_loops) and
    their verification (on to verify_loops), a resume handle's build and deepening, the heads of early-exit tokens
    (the range 0..0 from their states). Its backend is chosen per call, the model's math written once
    (model.LoopedLM.run_loops and the pieces around it):
      CUDA graph  decode rows on CUDA with Triton, the whole range from ids with the head (CudaGraphStep)
      C           up to cpu_block.MAX_LANES token rows on the CPU where the cache and model allow (c_chunk): one call
      torch       the model's pieces over the chunk's `Cached` context (`loop_range`)
    Within a call the model is held (Model.busy), its weights and the call's cache stay what they were, so a caller
    running many chunks over one cache keeps one LoopForward."""

    def __init__(self, net: LoopedLM, cache: KVCache):
        self.net, self.cache = net, cache
        self.plan = c_chunk(net, cache, 1)  # (chunks of up to MAX_LANES rows: c_chunk's rule)
        self.cpu = cache.device.type == "cpu"
        self.graphs = cache.device.type == "cuda" and use_triton(cache.device) and graphs_enabled() \
            and triton_supports(net.cfg)

    def __call__(self, step: Step, first: int, last: int, latent: "Latent | None", ids: torch.Tensor | None = None,
                 head: bool = True, last_only: bool = False, exits: ExitRule | None = None) -> torch.Tensor | None:
        """Loops first..last-1 of the chunk at `step` (B lanes x T tokens): from ids [B, T] (first == 0: embedding,
        prelude and initial state, into `latent`), or continuing `latent` (the chunk's states after `first` loops);
        latent.s holds the states after `last` loops on return (latent None: a forward from ids whose states nobody
        keeps). With head, then the coda, final norm and head: logits [B, T, V] (else None; with last_only
        [B, 1, V]: every token's coda, the last one's head). exits: a chunk's exit choice per token (the cdf rule
        with a threshold; torch only), from ids over the whole range."""
        B, T = step.pos.shape
        rows = T == 1 and step.cells is None and step.mask is None
        chooses = exits is not None and exits.rule == "cdf" and exits.threshold > 0
        if self.graphs and rows and latent is None and not chooses and first == 0 and ids is not None and head:
            return cuda_graph(self.net, self.cache, B, last).run(ids, step.pos)
        if self.plan is not None and not chooses and B * T <= cpu_block.MAX_LANES and (step.cells is None or B == 1):
            cells, extra = _c_rows(step)
            logits = self._c(cells, extra, first, last, latent, None if ids is None else ids.reshape(-1).tolist(),
                             head, (B, T))
            return logits[:, -1:] if last_only and logits is not None else logits
        c_blocks = rows and self.cpu and cpu_block.supported(self.net.cfg, self.cache, B, self.net.embed.weight.dtype)
        with torch_threads(decode_threads(B * T, self.net.cfg, c_blocks=c_blocks) if self.cpu else 0):
            return loop_range(self.net, context(self.net, step, self.cache), first, last, latent, ids, head,
                              last_only, exits if chooses else None)

    def rows(self, positions: list[int], first: int, last: int, latent: "Latent | None",
             tokens: list[int] | None = None, head: bool = True, lanes: list[int] | None = None
             ) -> torch.Tensor | None:
        """The loop range of token rows given as lists, without the tensors the C step would only turn back into
        lists: one token per lane at `positions` (lanes None: row b is lane b), or one lane's chain (lanes all 0,
        cell = position; other mixes run in the C step only). Logits [1, T, V] of a chain, [B, 1, V] of lanes."""
        T = len(positions)
        chain = lanes is not None and T > 1
        if self.plan is not None and T <= cpu_block.MAX_LANES:
            return self._c(positions, {} if lanes is None else {"lanes": lanes}, first, last, latent, tokens, head,
                           (1, T) if chain else (T, 1))
        assert lanes is None or not any(lanes), "rows of several lanes at several positions run in the C step only"
        dev = self.cache.device
        pos = torch.tensor([positions] if chain else [[p] for p in positions], device=dev)
        ids = None if tokens is None else torch.tensor(tokens, device=dev).view(pos.shape)
        return self(self.net.make_step(pos, max(positions) + 1), first, last, latent, ids, head)

    def until(self, positions: list[int], first: int, last: int, latent: "Latent", exits: "RowExits",
              head: bool = True, tokens: list[int] | None = None, tree=None, cells: list[int] | None = None
              ) -> tuple[torch.Tensor | None, int]:
        """Loops first..last-1 of one lane's chunk (positions: its tokens' positions; from tokens: their prelude and
        initial state first, into `latent`), each token stopping where its exit rule fires: after every loop,
        exits.exit_stops decides for the tokens still running (the one exit decision, as for a decode row), and a
        token that stops copies its K/V into the slots of every loop it skips up to exits.loops
        (KVCache.fill_skipped) and leaves the chunk for the loops left, its state kept. With head, then every
        token's coda and head from its state: logits [1, T, V] (else None). tree (a speculative tree's TreeShape):
        the tokens' cells and ancestor mask, `tree.step(net, positions, cells)` of the tokens running; None: a chain,
        cell = position. Returns the logits and the loop-steps run (token x loop)."""
        T, net = len(positions), self.net
        cells = positions if cells is None else cells

        def run(idx: list[int], lat: "Latent", a: int, b: int, ids: list[int] | None, with_head: bool):
            pos = [positions[i] for i in idx]
            if tree is None:
                return self.rows(pos, a, b, lat, ids, with_head, lanes=[0] * len(idx))
            dev = self.cache.device
            return self(tree.step(net, pos, [cells[i] for i in idx]), a, b, lat,
                        None if ids is None else torch.tensor([ids], device=dev), with_head)

        every = list(range(T))
        if not exits.adaptive:  # one call: the prelude, the loops and the head
            exits.used[:] = [last] * T
            return run(every, latent, first, last, tokens, head), T * (last - first)
        if tokens is not None:
            run(every, latent, 0, 0, tokens, False)  # prelude and initial state
        steps = 0
        for k in range(first, last):
            act = [i for i in range(T) if not exits.done[i]]
            if not act:
                break
            idx = torch.tensor(act, device=latent.s.device)
            sub = latent if len(act) == T else latent.rows(idx)
            s_old = sub.s.clone()
            run(act, sub, k, k + 1, None, False)
            at_last = torch.full((len(act), 1), k + 1 == exits.loops, device=latent.s.device)
            stop = exit_stops(net, [exits.rule] * len(act), [k + 1] * len(act), at_last, s_old.transpose(0, 1),
                              sub.s.transpose(0, 1), None)[:, 0].tolist()
            if sub is not latent:
                latent.s[:, idx] = sub.s
            steps += len(act)
            for i, stops in zip(act, stop):
                exits.used[i] = k + 1
                if stops:
                    exits.done[i] = True
                    self.cache.fill_skipped(0, cells[i], k + 1, exits.loops)
        return (run(every, latent, last, last, None, True) if head else None), steps

    def _c(self, cells: list[int], rows: dict, first: int, last: int, latent: "Latent | None",
           tokens: list[int] | None, head: bool, shape: tuple[int, int]) -> torch.Tensor | None:
        assert self.plan is not None  # (the caller checked)
        with torch_threads(decode_threads(len(cells), self.net.cfg, c_blocks=True)):
            logits = self.plan.run(self.cache, cells, first, last, **rows, tokens=tokens,
                                   e=None if latent is None else latent.e, s=None if latent is None else latent.s,
                                   head=head)
        return None if logits is None else logits.view(*shape, -1)


def loop_range(net: LoopedLM, ctx, first: int, last: int, latent: "Latent | None", ids: torch.Tensor | None = None,
               head: bool = True, last_only: bool = False, exits: ExitRule | None = None) -> torch.Tensor | None:
    """LoopForward's torch backend over a chunk's context: from ids (prelude, initial state) or `latent`, the loops
    first..last-1 (LoopedLM.run_loops), into `latent`, then with head the coda and head. Decode rows from ids read
    every slot they touch through one buffer (Cached.read_ahead)."""
    cfg = net.cfg
    if ids is not None and head and ctx.T == 1:
        ctx.read_ahead([*range(cfg.n_prelude), *range(cfg.core_slot(first, 0), cfg.core_slot(last, 0)),
                        *range(cfg.coda_slot(0), cfg.n_slots())])
    if ids is not None:
        e = net.encode(ids, ctx)
        s = net.init_state(e, ctx.step)
    else:
        assert latent is not None  # (the range continues the chunk's states)
        e, s = latent.e, latent.s
        ctx.ids = None if latent.ids is None else latent.ids.reshape(-1)
    choice = net.chunk_exits(s, last, exits) if exits is not None else None
    s = net.run_loops(s, e, ctx, first, last, choice)
    if latent is not None:
        if ids is not None:
            latent.e.copy_(e)
        latent.s.copy_(s)
    logits = net.decode_head(s if choice is None else choice.out, ctx, last_only) if head else None
    ctx.flush()
    return logits


def chunk_loops(net: LoopedLM, step: Step, cache: KVCache, first: int, last: int, latent: "Latent",
                ids: torch.Tensor | None = None, head: bool = True, last_only: bool = False) -> torch.Tensor | None:
    """The loop range through the model's pieces (torch) whatever backend LoopForward would choose: a test's
    reference for the C step."""
    return loop_range(net, context(net, step, cache), first, last, latent, ids, head, last_only)


def forward_loops(net: LoopedLM, step: Step, cache: KVCache, first: int, last: int, latent: "Latent | None",
                  ids: torch.Tensor | None = None, head: bool = True, last_only: bool = False) -> torch.Tensor | None:
    """The loop range first..last-1 of a chunk (LoopForward, built for this one call)."""
    return LoopForward(net, cache)(step, first, last, latent, ids, head, last_only)


def _c_rows(step: Step) -> tuple[list[int], dict]:
    """A chunk as the C step's rows: the cells they write, and the lanes, positions and tree mask when not the
    plain ones (row b of B lanes x T tokens is lane b // T)."""
    B, T = step.pos.shape
    pos = step.pos.reshape(-1).tolist()
    rows: dict = {} if T == 1 else {"lanes": [b for b in range(B) for _ in range(T)]}
    if step.cells is None:
        return pos, rows
    # the mask from the first cell some row does not see (every row sees the committed cells before the tree); a
    # row sees no cell past its own (a token's ancestors come before it), which is all C reads
    assert step.mask is not None  # (a tree chunk brings its ancestor mask: Step)
    mask = step.mask[0]
    blind = (~mask.all(0)).nonzero()
    lo = int(blind[0]) if len(blind) else step.end
    tree = {"mask": mask[:, lo:].to(torch.uint8).contiguous(), "mask_from": lo} if lo < step.end else {}
    return step.cells.reshape(-1).tolist(), {**rows, "pos": pos, **tree}


# --- CUDA graphs ------------------------------------------------------------------------------------------
def graphs_enabled() -> bool:
    return os.environ.get("TINYLOOP_CUDA_GRAPHS", "1").strip() != "0"


class CudaGraphStep:
    """The decode step captured once as a CUDA graph and replayed per token (one launch instead of hundreds).

    Shapes must not change between replays, so the graph reads the cache at its full length (Step.end =
    max_len, or the ring's cells): the Triton attention skips cells past each lane's own length, which it
    reads from the positions on the device, so the work still follows the real lengths. Tokens and positions
    are copied into static buffers before each replay; the logits buffer is overwritten by the next replay.
    Blocks are taken and copied on the host, which a graph cannot do: the scheduler takes them before the step
    (every slot it writes, the lanes' positions), the replay checks them (cache.require), and the graph reads the
    block table, which the takes update in place.
    """

    def __init__(self, net: LoopedLM, cache: KVCache, lanes: int, loops: int):
        self.net, self.cache, self.loops = net, cache, loops
        dev = net.embed.weight.device
        self.ids = torch.zeros(lanes, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(lanes, 1, dtype=torch.long, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        cfg = net.cfg
        self.slots = [*range(cfg.n_prelude), *(cfg.core_slot(k, j) for k in range(loops) for j in range(cfg.n_core)),
                      *(cfg.coda_slot(i) for i in range(cfg.n_coda))]

    def require(self) -> None:
        """Check that this step's cells have their blocks in every slot it writes (host work, outside the graph):
        the graph reads the block table, which the scheduler's takes update in place."""
        at = self.pos[:, 0].tolist()
        lanes = list(range(len(at)))
        self.cache.require([(slot, lanes, at, at) for slot in self.slots])

    def _context(self) -> Cached:
        """The step's shared part, built outside a capture: it reads positions on the host. Its device tensors
        are views of (or computed from) the static buffers, and the Triton path uses only those."""
        n = self.cache.ring if self.cache.window else self.cache.max_len
        return context(self.net, Step(self.pos, n, self.net.rope_cos, self.net.rope_sin), self.cache)

    def run(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.pos.copy_(pos)
        self.require()
        if self.graph is None:
            # Warm-up (compiles the Triton kernels) runs the real token: its cache writes are the ones the
            # replay below makes again, so running it twice is harmless.
            ctx = self._context()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loop_range(self.net, ctx, 0, self.loops, None, self.ids)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = loop_range(self.net, ctx, 0, self.loops, None, self.ids)
        self.graph.replay()
        assert self.logits is not None  # (captured with the graph)
        return self.logits.clone()  # the next replay overwrites the graph's buffer


_graphs: "weakref.WeakKeyDictionary[KVCache, dict]" = weakref.WeakKeyDictionary()


def cuda_graph(net: LoopedLM, cache: KVCache, lanes: int, loops: int) -> CudaGraphStep:
    """One captured step per (cache, model, lanes, loops): the graph holds the cache's addresses."""
    per_cache = _graphs.setdefault(cache, {})
    key = (id(net), lanes, loops)
    if key not in per_cache:
        per_cache[key] = CudaGraphStep(net, cache, lanes, loops)
    return per_cache[key]


class TreeShape:
    """Cells and ancestor mask of one round's tree: token i (0 = root) sits in cell p + i.

    Token i >= 1 is at depth d = (i-1)//w + 1 (position p + d) on branch b = (i-1) % w; it sees the committed
    cells (<= p) and the earlier tokens of its own branch.
    """

    def __init__(self, p: int, w: int, n: int, device):
        self.p, self.w = p, w
        c = torch.arange(p + 1 + n * w, device=device)
        t = (c - p - 1).clamp_min(0)
        tree = c > p
        self.key_pos = torch.where(tree, p + 1 + t // w, c).unsqueeze(0)
        self.branch = torch.where(tree, t % w, -1)
        self.depth = torch.where(tree, t // w + 1, 0)
        self.cells = c

    def step(self, net, pos: list[int], cells: list[int]) -> Step:
        end = max(cells) + 1
        qc, kc = torch.tensor(cells, device=self.cells.device), self.cells[:end]
        same_branch = (self.branch[kc].unsqueeze(0) == self.branch[qc].unsqueeze(1)) & \
                      (self.depth[kc].unsqueeze(0) <= self.depth[qc].unsqueeze(1))
        mask = (kc <= self.p).unsqueeze(0) | ((qc > self.p).unsqueeze(1) & (kc > self.p).unsqueeze(0) & same_branch)
        return Step(torch.tensor([pos], device=qc.device), end, net.rope_cos, net.rope_sin,
                    cells=qc.unsqueeze(0), key_pos=self.key_pos[:, :end], mask=mask.unsqueeze(0))
