"""A decode step's blocks as C calls (cpu_block.c): tinyloop/model.py's `block` for rows of one token each,
over the paged KV cache, on the CPU.

The cached step (engine/forward.py) takes this path for token rows when `supported` says the call can run them:
CPU, the CPU kernels built, fp32 activations, cache mode "fp16" holding fp32, no sliding window, at most 32 rows,
and head sizes the kernel takes. A row writes one cell of its lane and attends over that lane's cells up to its
own: decode rows are one row per lane; a speculative chunk is rows of one lane at consecutive cells (causal
within the chunk), a speculative tree the same with an ancestor mask. A prefill chunk of more than 32 rows runs as
`Chunk`: the same row steps in C, its products on the tiled GEMM (`chunk_supported`). Everything else (int8 / int4
caches, bf16 models, CUDA) runs model.block through torch. TINYLOOP_CPU_KERNELS=0 switches this off with the
products.

`weights_struct` describes a block's weights to C once (kept on the BlockWeights); `Rows` describes a step's
lanes (cells, RoPE factors, the cache) once per step; `Rows.blocks` then runs consecutive blocks (the prelude, a
loop pass, the coda) in one call. `DecodeStep` goes further: the model's forward over rows for any range of loops
(engine/forward.py's `forward`, `decode_rows` and `LoopForward`), from the embedding or from latent states to the
states or the logits, as one C call; `DecodeStep.iterate` runs one iteration-level step (engine/iteration.py): each
row one core pass at its own loop index, with the prelude of the rows that start a token and the head of the rows
that finish one, as one C call.
"""
from __future__ import annotations

import ctypes
import weakref
from typing import NamedTuple

import torch

from ..formats import QMatrix
from . import cpu

_FMT = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3}
MAX_LANES = 32
RUN_AHEAD = 15  # the most tokens a row draws in one iterate_until call (one block of cells: cache.BLOCK_TOKENS - 1)
# and for how long (seconds): a streaming client gets its tokens this often (the call ends at the first head after
# it, up to COALESCE[1] passes later)
RUN_AHEAD_S = 0.02
# the most passes a greedy row whose token ended waits for its batch-mates' to end too, to share their head and
# prelude products (cpu_block.c's keep_waiting); TINYLOOP_COALESCE=0 (EngineOptions.coalesce): 0, none. Rows of a
# known depth (none, or forced: elastic lanes, whose latency it adds to) wait up to 2: 4 cost the elastic service
# its TPOT tail; rows exiting by a rule up to 4, which their scattered, token-by-token depths need to end together
# (docs/engine.md)
COALESCE = (2, 4)
# and only in calls of this many rows or more: with few rows a head is shared by few, while the wait costs the row
# up to 2 passes of a token that may be 2 passes long (measured slower for a 2-loop request beside deeper ones,
# docs/engine.md); the wide batches where lanes end tokens at scattered passes keep it
COALESCE_FROM_ROWS = 8
_p, _L = ctypes.c_void_p, ctypes.c_long


class _Mat(ctypes.Structure):
    _fields_ = [("fmt", _L), ("group", _L), ("rows", _L), ("cols", _L), ("act_quant", _L), ("data", _p), ("scale", _p)]


class _Weights(ctypes.Structure):
    _fields_ = [("attn_norm", _p), ("mlp_norm", _p), ("attn_out_norm", _p), ("mlp_out_norm", _p), ("bqkv", _p),
                ("on_sum", _L), ("qkv", _Mat), ("wo", _Mat), ("gu", _Mat), ("down", _Mat)]


class _Rows(ctypes.Structure):
    _fields_ = [("B", _L), ("d", _L), ("H", _L), ("KV", _L), ("hd", _L), ("ffn", _L), ("bt", _L), ("threads", _L),
                ("eps", ctypes.c_double), ("cos2", _p), ("sin2", _p), ("cells", _p), ("lanes", _p), ("k_store", _p),
                ("v_store", _p), ("table_stride", _L), ("scratch", _p), ("mask", _p), ("mask_from", _L),
                ("mask_width", _L), ("shift", _p), ("row_mask", _p), ("row_mask_from", _p)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _mat(m) -> _Mat | None:
    """A matrix as C reads it (int4: at its stored, padded width), or None when the kernel cannot (a strided view)."""
    if isinstance(m, QMatrix):
        if not m.data.is_contiguous() or m.scale is not None and not m.scale.is_contiguous():
            return None
        return _Mat(_FMT[m.fmt], m.group, m.shape[0], m.padded_width, m.act_quant, m.data.data_ptr(), _ptr(m.scale))
    if m.dtype != torch.float32 or not m.is_contiguous():
        return None
    return _Mat(0, 0, m.shape[0], m.shape[1], 0, m.data_ptr(), None)


def weights_struct(w) -> _Weights | None:
    """The C description of a BlockWeights (built once and kept on it), or None when the kernel cannot use it."""
    if w.native is None:
        mats = [_mat(m) for m in (w.wqkv, w.wo, w.wgu, w.w_down)]
        vectors = [w.attn_norm, w.mlp_norm, w.attn_out_norm, w.mlp_out_norm, w.bqkv]
        if any(m is None for m in mats) or any(v is not None and (v.dtype != torch.float32 or not v.is_contiguous())
                                                for v in vectors):
            w.native = False
        else:
            w.native = _Weights(*map(_ptr, vectors), int(w.on_sum), *mats)
            for m in (w.wqkv, w.wo, w.wgu, w.w_down):  # read every step: from huge pages where the OS allows
                cpu.huge_pages(m.data if isinstance(m, QMatrix) else m)
    return w.native or None


def supported(cfg, cache, B: int, dtype: torch.dtype) -> bool:
    """Whether decode rows of B lanes over `cache` can run as C blocks."""
    return (B <= MAX_LANES and dtype == torch.float32 and cache.mode == "fp16" and cache.dtype == torch.float32
            and not cache.window and cache.device.type == "cpu" and cpu.available()
            and bool(cpu.loaded().tl_block_ok(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """model.rms_norm of fp32 rows x [..., d] in C (Weights.norm of a step whose blocks run here: the final norm)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    d = x.shape[-1]
    cpu.loaded().tl_rms_norm_rows(x.data_ptr(), w.contiguous().data_ptr(), eps, x.numel() // d, d, y.data_ptr())
    return y


class Rows:
    """A decode step's lanes as the C blocks see them: one token per lane at cells `cells` [B], RoPE factors
    cos2 / sin2 [B, hd] (model.rope_factors at the lanes' positions), the cache's store and block tables, the
    step's threads (torch's setting); `shape` is any block's C description (they all have the same shapes)."""

    def __init__(self, cfg, cache, cells: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, shape: _Weights):
        B = cells.shape[0]
        self.cache = cache
        self.cells = cells.reshape(B).contiguous()
        self.lanes = list(range(B))
        self.lo = self.hi = self.cells.tolist()  # the cells each lane writes (cache.require's spans)
        self.cos2, self.sin2 = cos2.reshape(B, -1).contiguous(), sin2.reshape(B, -1).contiguous()
        lib = cpu.loaded()
        self.scratch = torch.empty(lib.tl_block_scratch(ctypes.byref(shape), B))
        store, table = cache.store, cache.table
        self.table, self.slot_bytes = table, table.stride(0) * table.element_size()
        self.struct = _Rows(B, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden, cache.bt,
                            torch.get_num_threads(), cfg.norm_eps, self.cos2.data_ptr(), self.sin2.data_ptr(),
                            self.cells.data_ptr(), None, store["k"].data_ptr(), store["v"].data_ptr(), table.stride(1),
                            self.scratch.data_ptr())
        self.ref = ctypes.byref(self.struct)

    def blocks(self, ws: list, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """model.block of BlockWeights ws (weights_struct built for each) in turn over token rows x [B, d], block i
        writing layer slot slots[i]: one C call (a Python call per block costs a visible part of a token)."""
        cache, n = self.cache, len(ws)
        if n == 0:
            return x
        cache.require([(slot, self.lanes, self.lo, self.hi) for slot in slots])
        x = x.contiguous()
        out, tmp = torch.empty_like(x), torch.empty_like(x) if n > 1 else x
        base = self.table.data_ptr()
        self._call(n, (_p * n)(*[ctypes.addressof(w.native) for w in ws]),
                   (_p * n)(*[base + slot * self.slot_bytes for slot in slots]), x, out, tmp)
        return out

    def _call(self, n: int, ws, tables, x: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor) -> None:
        cpu.loaded().tl_blocks_rows(n, ws, self.ref, tables, x.data_ptr(), out.data_ptr(), tmp.data_ptr())


def chunk_supported(cfg, cache, rows: int, dtype: torch.dtype, shape: _Weights) -> bool:
    """Whether a prefill chunk of `rows` token rows over `cache` runs as C blocks (Chunk): where decode rows would
    but past MAX_LANES rows, where its products take the tiled GEMM anyway, and with no padded attention width."""
    return rows > MAX_LANES and cpu.gemm_available() and supported(cfg, cache, 1, dtype) \
        and shape.wo.cols == cfg.n_heads * cfg.head_dim


class Chunk(Rows):
    """A prefill chunk as the C blocks see it (cpu_block.c: tl_block_chunk): B lanes of T tokens at positions pos
    [B, T], rows lane-major, each row attending over its lane's cells up to its own; the products of its many rows
    take the tiled GEMM, the steps between them run in C instead of ~25 torch operations per block (faster
    prefill, measured in docs/kernels.md)."""

    def __init__(self, cfg, cache, pos: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, shape: _Weights):
        B, T = pos.shape
        super().__init__(cfg, cache, pos.reshape(B * T), cos2, sin2, shape)
        self.T, self.end = T, int(pos.max()) + 1
        self.lanes = list(range(B))
        self.row_lanes = torch.arange(B).repeat_interleave(T)  # held: the struct points at it
        self.struct.lanes = self.row_lanes.data_ptr()
        self.lo, self.hi = pos.min(1).values.tolist(), pos.max(1).values.tolist()

    def _call(self, n: int, ws, tables, x: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor) -> None:
        cpu.loaded().tl_blocks_chunk(n, ws, self.ref, tables, self.T, self.end, x.data_ptr(), out.data_ptr(),
                                 tmp.data_ptr())


class _Step(ctypes.Structure):
    _fields_ = [("n_prelude", _L), ("n_core", _L), ("n_coda", _L), ("loops", _L), ("injection", _L),
                ("state_init", _L), ("loop_norm", _L), ("coda_norm", _L), ("final_norm", _L),
                ("embed_scale", ctypes.c_double), ("embed", _p), ("norm_w", _p), ("noise", _p), ("cos2", _p),
                ("sin2", _p), ("adapter", _Mat), ("head", _Mat), ("blocks", _p), ("slots", _p)]


_INJECTION = {"none": 0, "add": 1, "adapter": 2}
_STATE_INIT = {"zeros": 0, "embed": 1, "normal": 2}


class DecodeStep:
    """The model's forward over token rows, for any range of loops, as one C call (tl_forward_rows): the embedding,
    the prelude and the initial state (when given tokens), each loop's injection, core and loop norm, and the coda,
    final norm and head (when asked). A decode step is rows 0..B-1 (one per lane) from loop 0 to `loops`; speculative
    decoding drafts a row from 0 to draft_loops and continues a chunk (rows of one lane at consecutive cells) from
    there to verify_loops. It calls the same C pieces as the step through Python (the torch loop range over a Cached
    context whose blocks run here), in the same order and at the same thread count, so the logits have the same
    bits; what goes is the Python around them (Cached, Step, the model's pieces, a call per pass: docs/kernels.md
    has the cost). Built once per model and weights (`decode_step`), for every loop count up
    to max_loops."""

    def __init__(self, net, weights):
        cfg = self.cfg = net.cfg
        loops = cfg.max_loops
        self.weights = weights  # not net: the kept steps are weakly keyed by it
        blocks = [*weights.prelude, *weights.core * loops, *weights.coda]
        self.prelude_slots = list(range(cfg.n_prelude))
        self.coda_slots = [cfg.coda_slot(i) for i in range(cfg.n_coda)]
        from ..rotary import rope_factors
        cos2, sin2 = rope_factors(net.rope_cos, net.rope_sin)
        self.tables = net.rope_cos  # the model's position tables when built (longer ones make a new DecodeStep)
        noise = net.init_noise if cfg.state_init == "normal" else None
        self.positions = net.rope_cos.shape[0] if noise is None else min(net.rope_cos.shape[0], noise.shape[0])
        # every tensor C reads, kept alive here
        self.keep = [cos2.contiguous(), sin2.contiguous(), net.embed.weight.detach(), weights.final_norm.contiguous(),
                     noise]
        self._blocks = (_p * len(blocks))(*[ctypes.addressof(w.native) for w in blocks])
        slots = [*self.prelude_slots, *(cfg.core_slot(k, j) for k in range(loops) for j in range(cfg.n_core)),
                 *self.coda_slots]
        self._slots = (_L * len(blocks))(*slots)
        adapter = _mat(weights.adapter) if weights.adapter is not None else _Mat()
        self.struct = _Step(cfg.n_prelude, cfg.n_core, cfg.n_coda, loops, _INJECTION[cfg.injection],
                            _STATE_INIT[cfg.state_init], int(cfg.loop_norm), int(cfg.coda_norm), int(cfg.final_norm),
                            cfg.embed_scale, self.keep[2].data_ptr(), self.keep[3].data_ptr(), _ptr(noise),
                            self.keep[0].data_ptr(), self.keep[1].data_ptr(), adapter, _mat(weights.head),
                            ctypes.addressof(self._blocks), ctypes.addressof(self._slots))
        self.ref = ctypes.byref(self.struct)
        self._kept: dict[tuple, _Lanes] = {}
        self._prepared: dict[tuple, tuple] = {}  # per range: (cache.held, pool epoch, rows' blocks) of the last check

    @staticmethod
    def fits(net, weights) -> bool:
        """Whether this step can run the model: every block in C (weights_struct), an fp32 embedding, a head and
        adapter C can multiply at their stored width (no int4 padding), at most 64 blocks per pass (prelude, one
        loop's core, coda)."""
        cfg, d = net.cfg, net.cfg.d_model
        if any(weights_struct(w) is None for part in (weights.prelude, weights.core, weights.coda) for w in part):
            return False
        head = _mat(weights.head)
        adapter = _mat(weights.adapter) if cfg.injection == "adapter" else _Mat(cols=2 * d)
        emb = net.embed.weight
        return (head is not None and head.cols == d and adapter is not None and adapter.cols == 2 * d
                and emb.dtype == torch.float32 and emb.is_contiguous() and weights.final_norm.dtype == torch.float32
                and max(cfg.n_prelude, cfg.n_core, cfg.n_coda) <= 64)

    def run(self, cache, cells: list[int], first: int, last: int, *, lanes: list[int] | None = None,
            pos: list[int] | None = None, mask: torch.Tensor | None = None, mask_from: int = 0,
            tokens: list[int] | None = None, e: torch.Tensor | None = None, s: torch.Tensor | None = None,
            head: bool = True) -> torch.Tensor | None:
        """Loops first..last-1 of rows writing `cells` of `lanes` (default row b = lane b) over `cache`, at positions
        `pos` (default: the cells; no ring), from `tokens` (first == 0: embedding, prelude, initial state) or from
        the rows' states s and prelude outputs e [rows, d] (read, and written: s holds the states after `last`
        loops); then, with head, the coda, final norm and head: logits [rows, V] (else None). A row attends over its
        lane's cells up to its own; mask (uint8 [rows, width], a tree's ancestors) says which of cells mask_from..
        it sees."""
        B, cfg = len(cells), self.cfg
        pos = cells if pos is None else pos
        # C indexes the embedding and the position tables by them: checked here, as torch would
        if tokens is not None and (min(tokens) < 0 or max(tokens) >= cfg.vocab_size):
            raise IndexError(f"token id {max(tokens) if max(tokens) >= 0 else min(tokens)} is outside the "
                             f"vocabulary (0..{cfg.vocab_size - 1})")
        if min(pos) < 0 or max(pos) >= self.positions:
            raise IndexError(f"position {max(pos) if min(pos) >= 0 else min(pos)} is outside the model's "
                             f"position tables (0..{self.positions - 1})")
        if not 0 <= first <= last <= cfg.max_loops or first and tokens is not None:
            raise ValueError(f"loops {first}..{last} (from tokens: {tokens is not None}) outside 0..{cfg.max_loops}")
        lanes = list(range(B)) if lanes is None else lanes
        cache.changed()  # C writes the cells itself (a kept read-ahead copy is stale)
        self._require(cache, lanes, cells, first, last, tokens is not None, head)
        lane = self._lanes(B, cache)
        if (e is None) != (s is None):
            raise ValueError("latent rows e and s come together, or neither")
        e, s = (lane.e, lane.s) if e is None or s is None else (_rows(e, B, cfg.d_model), _rows(s, B, cfg.d_model))
        lane.ids[:B], lane.cells[:B], lane.lanes[:B], lane.pos[:B] = tokens or [0] * B, cells, lanes, pos
        if mask is not None and (mask.dtype != torch.uint8 or not mask.is_contiguous() or mask.shape[0] != B
                                 or mask_from + mask.shape[1] <= max(cells)):
            raise ValueError(f"mask must be a contiguous uint8 tensor [{B}, width] covering the rows' cells")
        lane.struct.mask, lane.struct.mask_from = _ptr(mask), mask_from
        lane.struct.mask_width, lane.struct.row_mask = 0 if mask is None else mask.shape[1], None
        logits = torch.empty(B, self.struct.head.rows) if head else None
        table = cache.table
        cpu.loaded().tl_forward_rows(self.ref, lane.ref, table.data_ptr(), table.stride(0),
                                 None if tokens is None else ctypes.addressof(lane.ids), ctypes.addressof(lane.pos),
                                 first, last, e.data_ptr(), s.data_ptr(), _ptr(logits), lane.work.data_ptr())
        return logits

    def iterate(self, cache, cells: list[int], loop: list[int], tokens: list[int | None], finish: list[bool],
                e: torch.Tensor, s: torch.Tensor, *, lanes: list[int] | None = None,
                pos: list[int] | None = None) -> torch.Tensor:
        """One iteration-level step, one C call (tl_iterate_rows): row b (writing cell cells[b] of lane lanes[b],
        default lane b, at position pos[b], default the cell) runs one core pass at its own loop index loop[b]: it
        writes and attends slots core_slot(loop[b], j) of its lane, and its state s[b] goes from loop[b] to loop[b] + 1
        loops. All rows share each product: the weights stream once, whatever the rows' depths. A row with a token
        (tokens[b] not None; loop[b] must be 0) first runs its embedding, the prelude (into e[b]) and the initial
        state; a row with finish[b] then runs the coda, final norm and head. e, s: the rows' latent [rows, d] (fp32,
        contiguous, read and written in place). Returns the logits of the finishing rows [n finishing, V], in row
        order. Each row has the bits of its token decoded alone (`run` from 0 to its loop count)."""
        B, cfg = len(cells), self.cfg
        pos = cells if pos is None else pos
        lanes = list(range(B)) if lanes is None else lanes
        if not 0 < B <= MAX_LANES or not len(loop) == len(tokens) == len(finish) == len(lanes) == len(pos) == B:
            raise ValueError(f"iterate takes 1..{MAX_LANES} rows with one loop index, token (or None), finish flag, "
                             f"lane and position each; got {B} cells, {len(loop)} loops, {len(tokens)} tokens, "
                             f"{len(finish)} finish flags, {len(lanes)} lanes, {len(pos)} positions")
        for b, (k, token) in enumerate(zip(loop, tokens)):
            if not 0 <= k < cfg.max_loops:
                raise ValueError(f"row {b}: loop index {k} is outside 0..{cfg.max_loops - 1}")
            if token is not None and k:
                raise ValueError(f"row {b} starts a token at loop index {k}: a token starts at loop 0")
        ids = [0 if t is None else t for t in tokens]
        if min(ids) < 0 or max(ids) >= cfg.vocab_size:  # C indexes the tables by them: checked here, as in run
            raise IndexError(f"token id {max(ids) if max(ids) >= 0 else min(ids)} is outside the vocabulary "
                             f"(0..{cfg.vocab_size - 1})")
        if min(pos) < 0 or max(pos) >= self.positions:
            raise IndexError(f"position {max(pos) if min(pos) >= 0 else min(pos)} is outside the model's position "
                             f"tables (0..{self.positions - 1})")
        if min(lanes) < 0 or max(lanes) >= cache.lanes:
            raise IndexError(f"lane {max(lanes) if min(lanes) >= 0 else min(lanes)} is outside the cache's lanes "
                             f"(0..{cache.lanes - 1})")
        e, s = _rows(e, B, cfg.d_model), _rows(s, B, cfg.d_model)
        cache.changed()  # C writes the cells itself (a kept read-ahead copy is stale)
        self._require_rows(cache, lanes, cells, loop, tokens, finish)
        lane = self._lanes(B, cache)
        lane.ids[:B], lane.cells[:B], lane.lanes[:B], lane.pos[:B], lane.loop[:B] = ids, cells, lanes, pos, loop
        lane.start[:B] = [t is not None for t in tokens]
        lane.finish[:B] = [bool(f) for f in finish]
        lane.struct.mask, lane.struct.mask_width, lane.struct.row_mask = None, 0, None
        logits = torch.empty(sum(lane.finish[:B]), self.struct.head.rows)
        table = cache.table
        _lib().tl_iterate_rows(self.ref, lane.ref, table.data_ptr(), table.stride(0), ctypes.addressof(lane.ids),
                               ctypes.addressof(lane.pos), ctypes.addressof(lane.loop), ctypes.addressof(lane.start),
                               ctypes.addressof(lane.finish), e.data_ptr(), s.data_ptr(), logits.data_ptr(),
                               lane.work.data_ptr())
        return logits

    def iterate_until(self, cache, cells: list[int], done: list[int], tokens: list[int | None], exits: list,
                      lanes: list[int], latent: torch.Tensor, gate: tuple[torch.Tensor, float] | None = None,
                      compute: bool = False, ahead: list[list[float]] | None = None, eos: int = -1,
                      wait: tuple[int, int] = COALESCE, keep: list[bool] | None = None,
                      verify: list[bool] | None = None, positions: list[int] | None = None,
                      masks: list[tuple[int, torch.Tensor] | None] | None = None) -> Until:
        """Iteration-level steps in one C call (tl_iterate_until) until some row's token is done: row b (writing
        cell cells[b] of lane lanes[b], at that position) has run done[b] loops of its token, or starts tokens[b]
        (not None; done[b] = 0); every pass runs each row's next loop, and its exit rule decides whether the token
        stops. exits[b] = [rule, loops, min_loops, threshold, chosen, used, cdf, rest] (cpu_block.c's tl_exit_t:
        rule 0 none, 1 latent, 2 a forced depth, 3 cdf; the last four carried from call to call) is updated in
        place. gate: the exit gate's (weight [d], bias) for rules 1 and 3; compute: exit_kv "compute" (a token
        whose exit is chosen loops on to its `loops`). A row's e, s and exit state are rows lanes[b] of latent
        [3, lanes, d], read and written in place. The caller took the blocks of every slot the rows' tokens write
        at their loop counts (the scheduler, Scheduler.reserve), for the cells the greedy draws move on to too.
        ahead[b]: row b draws up to len(ahead[b]) tokens greedily here (the argmax of its logits) and goes on with
        them at the next cells, the i-th's forced depth ahead[b][i] (rule 2); a draw of `eos` ends the call, as
        does the first head after RUN_AHEAD_S (at most `wait` passes later). A greedy row whose token ended may sit
        out up to wait[0] passes, wait[1] if it exits by an adaptive rule (no K/V written or read, its state kept),
        so that its head, and its next token's prelude, run in one product with its batch-mates' (cpu_block.c's
        keep_waiting; (0, 0): never): the same bits, fewer weight streams. A
        finished token's skipped loops hold copies of its last loop's K/V (copy). keep[b]: row b also brings back
        the logits [V] each of its draws was chosen from (Until.kept), for its log-probabilities. verify[b]: row b
        is a row of a drafted chunk (rows of one lane at consecutive cells, each starting its token): its token ends
        within this call, which ends only once every such row's has (the other rows sit out the passes till then),
        and it is among the finished rows. positions: the rows' positions (default: their cells; a tree's branches
        share positions); masks[b]: (first, seen), row b sees cell first + i of its lane only where seen[i] (uint8,
        covering the cells up to its own; a tree's ancestors), every cell before `first`; None: every cell."""
        B, cfg, cap = len(cells), self.cfg, RUN_AHEAD
        ids = [0 if t is None else t for t in tokens]
        ahead = ahead or [[]] * B
        if not 0 < B <= MAX_LANES or min(ids) < 0 or max(ids) >= cfg.vocab_size or min(cells) < 0 \
                or max(c + len(a) for c, a in zip(cells, ahead)) >= self.positions or max(map(len, ahead)) > cap:
            raise ValueError(f"iterate_until takes 1..{MAX_LANES} rows with token ids in the vocabulary, cells "
                             f"within the position tables and up to {cap} draws each; got {B} rows, tokens {ids}, "
                             f"cells {cells}, draws {[len(a) for a in ahead]}")
        if latent.dtype != torch.float32 or not latent.is_contiguous() or latent.shape != (3, cache.lanes, cfg.d_model):
            raise ValueError(f"latent must be contiguous float32 [3, {cache.lanes}, {cfg.d_model}]")
        if gate is None and any(x[0] == 3 for x in exits):
            raise ValueError("the cdf rule needs the exit gate")
        cache.changed()  # C writes the cells itself (a kept read-ahead copy is stale)
        lane = self._lanes(B, cache)
        lane.ids[:B], lane.cells[:B], lane.lanes[:B], lane.loop[:B] = ids, cells, lanes, done
        lane.pos[:B] = cells if positions is None else positions
        lane.start[:B] = [t is not None for t in tokens]
        for b, (x, depths) in enumerate(zip(exits, ahead)):
            lane.exits[b] = _Exit(*x)
            lane.budget[b] = len(depths)
            lane.depth[b * cap:b * cap + len(depths)] = depths
        lane.struct.mask, lane.struct.mask_width, lane.struct.row_mask = None, 0, None
        if masks is not None and any(m is not None for m in masks):
            for b, (cell, m) in enumerate(zip(cells, masks)):
                if m is not None and (m[1].dtype != torch.uint8 or not m[1].is_contiguous()
                                      or not m[0] <= cell < m[0] + m[1].numel()):
                    raise ValueError(f"row {b}'s mask must be a contiguous uint8 tensor covering cells {m[0]}..{cell}")
            lane.row_mask[:B] = [None if m is None else m[1].data_ptr() for m in masks]
            lane.row_mask_from[:B] = [0 if m is None else m[0] for m in masks]
            lane.struct.row_mask = ctypes.addressof(lane.row_mask)
            lane.struct.row_mask_from = ctypes.addressof(lane.row_mask_from)
        V = self.struct.head.rows
        logits = torch.empty(B, V)  # (room for every row; the finished rows' come first)
        # (a fresh buffer each call, room for the draws of the rows that keep theirs: what it hands back are views)
        keep_at, n = [-1] * B, 0
        for b in range(B):
            if keep is not None and keep[b] and ahead[b]:
                keep_at[b], n = n, n + len(ahead[b])
        kept = torch.empty(n, V) if n else None
        lane.keep_at[:B] = keep_at
        if verify is not None:
            lane.verify[:B] = [bool(v) for v in verify]
        table, (e, s, out) = cache.table, latent
        gate_w, gate_b = (None, 0.0) if gate is None else (gate[0].data_ptr(), gate[1])
        ids_at, pos_at, loop_at, start_at, exits_at, finish_at, work_at, rows_at, *drawn_at = lane.until
        _lib().tl_iterate_until(self.ref, lane.ref, table.data_ptr(), table.stride(0), ids_at, pos_at, loop_at,
                                start_at, exits_at, gate_w, gate_b, int(compute), finish_at, e.data_ptr(),
                                s.data_ptr(), out.data_ptr(), logits.data_ptr(), work_at, rows_at, drawn_at[0], cap,
                                eos, *drawn_at[1:], logits.data_ptr(),  # (the greedy rows' logits go there first)
                                RUN_AHEAD_S, *wait, ctypes.addressof(lane.heads), _ptr(kept),
                                ctypes.addressof(lane.keep_at),
                                None if verify is None else ctypes.addressof(lane.verify))
        for b, x in enumerate(exits):
            got = lane.exits[b]
            x[3:] = got.threshold, got.chosen, got.used, got.cdf, got.rest
        finished = [b for b in range(B) if lane.finish[b]]
        drawn = [list(zip(lane.chosen[b * cap:b * cap + lane.n_chosen[b]], lane.used[b * cap:b * cap + lane.n_chosen[b]]))
                 for b in range(B)]
        rows = [None if k < 0 or kept is None else kept[k:k + len(drawn[b])] for b, k in enumerate(keep_at)]
        return Until(lane.loop[:B], finished, logits[:len(finished)], drawn, [bool(lane.start[b]) for b in range(B)],
                     lane.heads.value, rows)

    def _require_rows(self, cache, lanes: list[int], cells: list[int], loop: list[int], tokens: list[int | None],
                      finish: list[bool]) -> None:
        """Check the blocks of every cell an iteration step writes (taken by the scheduler): each row's core slots at
        its own loop, the prelude's slots for the rows that start, the coda's for the rows that finish. The common
        case is checked inline (cache.require raises on the rest): the rows' slots differ every step, so
        DecodeStep._require's skip does not apply."""
        cfg, held, refs, bt = self.cfg, cache.held, cache.pool.refs, cache.bt
        for lane, cell, k, token, done in zip(lanes, cells, loop, tokens, finish):
            i = cell // bt
            slots = [cfg.core_slot(k, j) for j in range(cfg.n_core)]
            slots += self.prelude_slots if token is not None else []
            slots += self.coda_slots if done else []
            for slot in slots:
                ids = held[slot][lane]
                if i >= len(ids) or refs[ids[i]] != 1:
                    cache.require([(slot, [lane], [cell], [cell])])

    def _require(self, cache, lanes: list[int], cells: list[int], first: int, last: int, prelude: bool,
                 coda: bool) -> None:
        """Check the blocks of the rows' cells in every slot the call writes (cache.require). Skipped while the rows
        stay in the blocks checked last time for this range and the pool took, shared or freed no block since (its
        epoch): then they are all there and the lanes' own. Python run right after a decode step's weights went through
        the caches is slow, so these checks are worth skipping (docs/kernels.md)."""
        key, blocks = (first, last, prelude, coda), (lanes, [c // cache.bt for c in cells])
        held, pool = cache.held, cache.pool
        done = self._prepared.get(key)
        if done is not None and done[0] is held and done[1:] == (pool.epoch, blocks):
            return
        cfg = self.cfg
        span: dict[int, tuple[int, int]] = {}
        for lane, cell in zip(lanes, cells):  # each lane's cells lo..hi
            a, b = span.get(lane, (cell, cell))
            span[lane] = (min(a, cell), max(b, cell))
        which, lo, hi = list(span), [a for a, _ in span.values()], [b for _, b in span.values()]
        slots = [*(self.prelude_slots if prelude else ()),
                 *(cfg.core_slot(k, j) for k in range(first, last) for j in range(cfg.n_core)),
                 *(self.coda_slots if coda else ())]
        cache.require([(slot, which, lo, hi) for slot in slots])
        self._prepared[key] = (held, pool.epoch, blocks)

    def _lanes(self, B: int, cache) -> "_Lanes":
        """The C description of B rows over `cache` and their work memory, kept from call to call while they stay
        the same (a model runs one call at a time: Model.busy)."""
        store, threads = cache.store, torch.get_num_threads()
        key = (B, threads, store["k"].data_ptr(), store["v"].data_ptr(), cache.bt, cache.table.stride(1))
        kept = self._kept.get(key)
        if kept is None:
            if len(self._kept) > 64:  # another cache every call (tests): do not keep them all
                self._kept.clear()
            kept = self._kept[key] = _Lanes(key, self.cfg, self._blocks[0])
        return kept


def _rows(t: torch.Tensor, B: int, d: int) -> torch.Tensor:
    """t as the [B, d] fp32 rows C reads and writes in place (a view of them: never a copy)."""
    if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != B * d or t.device.type != "cpu":
        raise ValueError(f"latent rows must be a contiguous CPU float32 tensor of {B} x {d} values, got "
                         f"{t.dtype} {list(t.shape)}{'' if t.is_contiguous() else ' (strided)'}")
    return t


class Until(NamedTuple):
    """What a DecodeStep.iterate_until call did: per row the loops its token in flight has run, the rows whose token
    ended (their logits [n, V], row order), per row its greedy draws [(token, loops it ran)], and per row whether its
    next token starts from its last draw (it has none in flight), the head products the call ran, and per row that
    keeps them the logits its draws were chosen from ([len(drawn[b]), V]; None for the others)."""
    done: list[int]
    finished: list[int]
    logits: torch.Tensor
    drawn: list[list[tuple[int, int]]]
    starts: list[bool]
    heads: int
    kept: list[torch.Tensor | None]


class _Lanes:
    """B rows of a DecodeStep: tokens, cells, lanes, positions, default latent rows, work memory and the
    tl_block_rows_t that points at them."""

    def __init__(self, key: tuple, cfg, shape):
        B, threads, k, v, bt, table_stride = key
        lib = cpu.loaded()
        step_work = lib.tl_step_work(B, cfg.d_model, cfg.head_dim)
        self.key, self.ids, self.cells, self.lanes, self.pos = key, (_L * B)(), (_L * B)(), (_L * B)(), (_L * B)()
        self.loop, self.start, self.finish = (_L * B)(), (ctypes.c_ubyte * B)(), (ctypes.c_ubyte * B)()  # iterate
        self.exits, self.rows = (_Exit * B)(), torch.empty(4, B, cfg.d_model)  # iterate_until
        self.e, self.s = torch.empty(B, cfg.d_model), torch.empty(B, cfg.d_model)
        self.work = torch.empty(step_work + lib.tl_block_scratch(shape, B))
        self.struct = _Rows(B, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden, bt, threads,
                            cfg.norm_eps, None, None, ctypes.addressof(self.cells), ctypes.addressof(self.lanes), k, v,
                            table_stride, self.work.data_ptr() + 4 * step_work)
        self.ref = ctypes.byref(self.struct)
        # iterate_until's greedy draws: per row its budget, the forced depths of its next tokens, what it drew
        self.budget, self.n_chosen, self.heads, self.keep_at = (_L * B)(), (_L * B)(), _L(), (_L * B)()
        self.verify = (ctypes.c_ubyte * B)()  # iterate_until's rows of drafted chunks, and their masks (a tree's)
        self.row_mask, self.row_mask_from = (_p * B)(), (_L * B)()
        self.depth, self.chosen, self.used = (ctypes.c_double * (B * RUN_AHEAD))(), (_L * (B * RUN_AHEAD))(), \
            (_L * (B * RUN_AHEAD))()
        self.until = (*map(ctypes.addressof, (self.ids, self.pos, self.loop, self.start, self.exits, self.finish)),
                      self.work.data_ptr(), self.rows.data_ptr(),
                      *map(ctypes.addressof, (self.budget, self.depth, self.chosen, self.used, self.n_chosen)))


class _Exit(ctypes.Structure):  # tl_exit_t: a row's exit rule in tl_iterate_until, and what it keeps between calls
    _fields_ = [("rule", _L), ("loops", _L), ("min_loops", _L), ("threshold", ctypes.c_double), ("chosen", _L),
                ("used", _L), ("cdf", ctypes.c_float), ("rest", ctypes.c_float)]


def _lib() -> ctypes.CDLL:
    """The library with the iteration steps' argument types declared (once: kernels/cpu.py declares the others)."""
    lib = cpu.loaded()
    if lib.tl_iterate_rows.argtypes is None:
        lib.tl_iterate_rows.argtypes = [_p, _p, _p, _L, *[_p] * 9]
        lib.tl_iterate_rows.restype = None
        lib.tl_iterate_until.argtypes = [_p, _p, _p, _L, _p, _p, _p, _p, _p, _p, ctypes.c_double, _L, *[_p] * 8,
                                         _L, _L, *[_p] * 5, ctypes.c_double, _L, _L, _p, _p, _p, _p]
        lib.tl_iterate_until.restype = _L
    return lib


_steps: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def decode_step(net, weights) -> DecodeStep | None:
    """The kept DecodeStep of (net, weights), or None when it cannot run them (DecodeStep.fits)."""
    kept = _steps.get(net)
    if kept is None or kept[0] is not weights or kept[1] is not None and kept[1].tables is not net.rope_cos:
        kept = _steps[net] = (weights, DecodeStep(net, weights) if DecodeStep.fits(net, weights) else None)
    return kept[1]
