"""The loop-aware KV cache in three storage modes, paged: every entry lives in a fixed-size block of one pool.

Slots: prelude layer i owns slot i, core layer j at loop k owns slot P + k*R + j, coda layer i owns slot
P + max_loops*R + i (ModelConfig.core_slot / coda_slot). At loop k a token attends to the loop-k keys of
earlier tokens, which makes cached decode equal a full recompute.

Modes (bytes per token per slot, with kv_dim = n_kv_heads * head_dim, d = d_model, s = bytes of the model dtype):
  fp16  K and V in the model's dtype                        2 * kv_dim * s
  int8  K and V as int8, one fp16 scale per token and head   2 * (kv_dim + 2 * n_kv_heads)
  int4  store-h: the attention input h as int4 in groups of
        INT4_GROUP with one fp16 scale per group; K and V are
        recomputed from h when attended                        d / 2 + 2 * d / INT4_GROUP

Paging (docs/engine.md): a BlockPool holds `num_blocks` blocks of BLOCK_TOKENS token entries each, one tensor
per stored name. A KVCache is a view of some lanes: per (slot, lane) a block table maps cell c to block
table[slot, lane, c // BLOCK_TOKENS], row c % BLOCK_TOKENS. A block is taken from the pool the first time a
lane writes a cell in it, for that slot only, so a sequence at 4 loops holds nothing for loops 5..16, and
a cache holds what its lanes have written, not `max_len`. Blocks are reference counted: beams, prefix caches and
resume handles share blocks, and the first write into a shared block copies it (copy-on-write).

With `window > 0` each slot is a ring of `ring` cells (ring = window unless a caller asks for more):
position p lives in cell p % ring and the cell remembers which position it holds, so a windowed sequence holds
ceil(ring / BLOCK_TOKENS) blocks per slot however long it runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .config import ModelConfig
from .errors import BudgetError, ConfigError



class Evictable(Protocol):
    """What the pool asks of the prefix cache that may hold its blocks (tinyloop/prefix_tree.py's PrefixTree, a layer
    above: the pool only sees this)."""
    def evictable(self) -> int: ...
    def evict(self, need: int) -> None: ...

CACHE_MODES = ("fp16", "int8", "int4")
INT4_GROUP = 32
BLOCK_TOKENS = 16


def bytes_per_token_slot(cfg: ModelConfig, mode: str, dtype_bytes: int) -> int:
    if mode == "fp16":
        return 2 * cfg.kv_dim * dtype_bytes
    if mode == "int8":
        return 2 * (cfg.kv_dim + 2 * cfg.n_kv_heads)
    if mode == "int4":
        return cfg.d_model // 2 + 2 * (cfg.d_model // INT4_GROUP)
    raise ConfigError(f"cache_mode {mode!r} not one of {CACHE_MODES}")


def check_mode(cfg: ModelConfig, mode: str) -> None:
    if mode not in CACHE_MODES:
        raise ConfigError(f"cache_mode {mode!r} not one of {CACHE_MODES}")
    if mode == "int4" and cfg.d_model % INT4_GROUP:
        raise ConfigError(f"cache_mode int4 needs d_model divisible by {INT4_GROUP}, got {cfg.d_model}")
    if mode == "int4" and (cfg.qk_norm or cfg.value_embeds):
        # store-h recomputes K and V from h through wk and wv alone (engine/forward.py: Cached.decode)
        raise ConfigError("cache_mode int4 (store-h) recomputes K and V from the attention input by the projections "
                          "alone, and this model's keys are normalised (qk_norm) or its values carry value "
                          "embeddings: use cache_mode fp16 or int8")


def entry_layout(cfg: ModelConfig, mode: str, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """What one token entry stores, by name: (shape, dtype)."""
    kv = (cfg.n_kv_heads, cfg.head_dim)
    if mode == "fp16":
        return {"k": (kv, dtype), "v": (kv, dtype)}
    if mode == "int8":
        return {"k": (kv, torch.int8), "k_scale": ((cfg.n_kv_heads, 1), torch.float16),
                "v": (kv, torch.int8), "v_scale": ((cfg.n_kv_heads, 1), torch.float16)}
    return {"h": ((cfg.d_model // 2,), torch.uint8), "h_scale": ((cfg.d_model // INT4_GROUP,), torch.float16)}


# --- quantisation (torch reference; tinyloop/kernels holds the fused versions) -------------------------
def quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per vector along the last dim: x ~= q * scale."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-8) / 127.0
    q = torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale.to(torch.float16)


def dequant_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float()).to(dtype)


def quant_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 in groups of INT4_GROUP along the last dim, two values packed per byte."""
    *lead, d = x.shape
    g = x.float().reshape(*lead, d // INT4_GROUP, INT4_GROUP)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 7.0
    q = (torch.round(g / scale).clamp_(-8, 7) + 8).to(torch.uint8).reshape(*lead, d)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed, scale.squeeze(-1).to(torch.float16)


def dequant_int4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    *lead, half = packed.shape
    q = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*lead, half * 2).float() - 8.0
    g = q.reshape(*lead, scale.shape[-1], INT4_GROUP) * scale.float().unsqueeze(-1)
    return g.reshape(*lead, half * 2).to(dtype)


def encode_entries(mode: str, h: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """The stored form of a chunk's entries in `mode`."""
    if mode == "fp16":
        return {"k": k, "v": v}
    if mode == "int8":
        (kq, ks), (vq, vs) = quant_int8(k), quant_int8(v)
        return {"k": kq, "k_scale": ks, "v": vq, "v_scale": vs}
    hq, hs = quant_int4(h)
    return {"h": hq, "h_scale": hs}


def decode_entries(mode: str, data: dict[str, torch.Tensor], dtype: torch.dtype, project_kv):
    """Full-precision K, V from stored entries; project_kv(h) recomputes them from h in the int4 mode."""
    if mode == "fp16":
        return data["k"], data["v"]
    if mode == "int8":
        return dequant_int8(data["k"], data["k_scale"], dtype), dequant_int8(data["v"], data["v_scale"], dtype)
    return project_kv(dequant_int4(data["h"], data["h_scale"], dtype))


class UnreservedBlock(RuntimeError):
    """A forward found a cell it writes without a block of its lane's own: the engine's bug (its scheduler did not
    take the block), never the request's."""


# --- the pool --------------------------------------------------------------------------------------------
class BlockPool:
    """`num_blocks` blocks of `block_tokens` entries, one tensor per stored name: [num_blocks + 1, block_tokens, ...].

    Block 0 is the null block: always zero, never handed out, what unwritten table entries point at (a read of
    cells no lane wrote stays finite). The tensors are allocated empty, so on CPU the pages of a block are only
    touched when the block is first taken (then zeroed); resident memory follows the blocks in use.
    """

    def __init__(self, cfg: ModelConfig, mode: str, num_blocks: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, block_tokens: int = BLOCK_TOKENS):
        check_mode(cfg, mode)
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"BlockPool needs at least one block, got {num_blocks!r}")
        self.cfg, self.mode, self.dtype, self.device = cfg, mode, dtype, torch.device(device)
        self.block_tokens, self.num_blocks = block_tokens, num_blocks
        layout = entry_layout(cfg, mode, dtype)
        self.store = {name: torch.empty((num_blocks + 1, block_tokens, *shape), dtype=dt, device=device)
                      for name, (shape, dt) in layout.items()}
        for t in self.store.values():
            t[0].zero_()
        self.block_bytes = sum(t[0].numel() * t.element_size() for t in self.store.values())
        self.refs = [0] * (num_blocks + 1)
        self.epoch = 0  # counts take / retain / drop: while it stands still, no lane's blocks or their sharing changed
        self.free = list(range(num_blocks, 0, -1))  # pop() hands out low ids first
        self.handed_out = 0  # the highest block id handed out so far (the ones above it are zeroed when first taken)
        self.peak_used = 0
        # The model's prefix cache (tinyloop/prefix_tree.py): blocks only it holds are free memory that remembers
        # something. `room` counts them; `take` evicts its least recently used entries when nothing else is free.
        self.prefixes: Evictable | None = None  # the prefix cache whose blocks it may evict

    @property
    def free_count(self) -> int:
        return len(self.free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def nbytes(self) -> int:
        return (self.num_blocks + 1) * self.block_bytes

    def room(self) -> int:
        """Blocks a call can count on (admission checks this): the free ones and those only the prefix cache holds.
        Counting rather than evicting here lets a call first find its own prefix in the cache."""
        return len(self.free) + (self.prefixes.evictable() if self.prefixes is not None else 0)

    def take(self) -> int:
        """A free block, zeroed."""
        return self.take_many(1)[0]

    def take_many(self, n: int) -> list[int]:
        """n free blocks; none when fewer than n can be had. Only blocks never handed out before are zeroed (one fill
        per stored tensor for all of them): attention masks the cells no token wrote, so a reused block's old finite
        entries never reach a result, where NaN bit patterns in never-used memory would (a masked weight of zero times
        NaN)."""
        if len(self.free) < n and self.prefixes is not None:
            self.prefixes.evict(n)
        if len(self.free) < n:
            raise BudgetError(f"KV block pool exhausted: all {self.num_blocks} blocks of {self.block_tokens} tokens "
                              f"({self.nbytes / 2**20:.1f} MiB) are held by running sequences and handles")
        got = [self.free.pop() for _ in range(n)]
        for b in got:
            self.refs[b] = 1
        self.epoch += 1
        fresh = [b for b in got if b > self.handed_out]
        if fresh:
            self.handed_out = max(fresh)
            at = torch.tensor(fresh, device=self.device)
            for t in self.store.values():
                t.index_fill_(0, at, 0)
        self.peak_used = max(self.peak_used, self.used)
        return got

    def retain(self, b: int) -> None:
        if b:
            self.refs[b] += 1
            self.epoch += 1

    def drop(self, b: int) -> None:
        if b:
            self.refs[b] -= 1
            self.epoch += 1
            if self.refs[b] == 0:
                self.free.append(b)

    def copy_block(self, src: int, dst: int) -> None:
        for t in self.store.values():
            t[dst].copy_(t[src])


def pool_for(cfg: ModelConfig, mode: str, lanes: int, cells: int, *, device, dtype) -> BlockPool:
    """A private pool big enough for `lanes` lanes of `cells` cells at every slot (a KVCache made on its own)."""
    blocks = cfg.n_slots() * lanes * -(-cells // BLOCK_TOKENS)
    return BlockPool(cfg, mode, blocks, device=device, dtype=dtype)


@dataclass
class Span:
    """Blocks of some slots of one lane, kept by a handle (prefix cache, resume handle): per slot its block ids
    covering cells 0..cells-1 (shared with the cache they came from: reference counted), and for a ring the
    positions its cells hold."""
    pool: BlockPool
    blocks: dict[int, list[int]]
    cells: int
    cell_pos: dict[int, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blocks.values()) * self.pool.block_bytes

    def release(self) -> None:
        for ids in self.blocks.values():
            for b in ids:
                self.pool.drop(b)
        self.blocks = {}

    def only(self, slots: range) -> "Span":
        """A new span over some of these slots (each block retained again)."""
        picked = {s: list(self.blocks[s]) for s in slots if s in self.blocks}
        for ids in picked.values():
            for b in ids:
                self.pool.retain(b)
        cp = None if self.cell_pos is None else {s: self.cell_pos[s] for s in picked}
        return Span(self.pool, picked, self.cells, cp)


# --- the cache -------------------------------------------------------------------------------------------
class KVCache:
    """K/V storage for `lanes` sequences of up to `max_len` tokens, one slot per (layer, loop), in blocks of `pool`
    (None: a private pool sized for every lane at full length, as a standalone cache in tests and benches)."""
    # a view (lane_view, select): the cache it views, and for a selection the lanes it took, in its order
    _view_of: KVCache | None = None
    _index: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, lanes: int, max_len: int, mode: str = "fp16", *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, window: int = 0,
                 ring: int = 0, pool: BlockPool | None = None):
        check_mode(cfg, mode)
        self.cfg, self.mode, self.lanes, self.max_len, self.window = cfg, mode, lanes, max_len, window
        self.dtype, self.device = dtype, torch.device(device)
        # A ring may hold more cells than the window (`ring`): speculative decode writes drafts it may roll back,
        # and the cells they overwrite must not be ones the window still needs.
        S, cells = cfg.n_slots(), (max(window, ring) if window > 0 else max_len)
        self.ring = cells if window > 0 else 0
        self.cells = cells
        self.pool = pool if pool is not None else pool_for(cfg, mode, lanes, cells, device=device, dtype=dtype)
        if (self.pool.mode, self.pool.dtype) != (mode, dtype):
            raise ConfigError(f"KVCache({mode}, {dtype}) cannot draw from a pool of {self.pool.mode}, {self.pool.dtype}")
        self.bt = self.pool.block_tokens
        self.table = torch.zeros((S, lanes, -(-cells // self.bt)), dtype=torch.long, device=device)
        self.held: list[list[list[int]]] = [[[] for _ in range(lanes)] for _ in range(S)]  # host mirror of table
        # Ring buffers remember the absolute position in each cell (-1: empty).
        self.cell_pos = torch.full((S, lanes, cells), -1, dtype=torch.long, device=device) if window > 0 else None
        # Shared with every view of this cache (lane_view and select copy the dict by reference): a copy of some
        # lanes' cells kept across decode steps (engine/forward.py: the read-ahead buffer), dropped by `changed`.
        self.shared: dict = {"read_ahead": None}

    def changed(self) -> None:
        """Cells changed other than by a decode step's read-ahead: copies of them kept elsewhere are stale."""
        self.shared["read_ahead"] = None

    @property
    def store(self) -> dict[str, torch.Tensor]:
        return self.pool.store

    def blocks_held(self) -> int:
        return sum(len(ids) for row in self.held for ids in row)

    def nbytes(self) -> int:
        return self.blocks_held() * self.pool.block_bytes

    def reset(self) -> None:
        """Give every block back to the pool (the cache is empty afterwards)."""
        self.changed()
        pool = self.pool
        for row in self.held:
            for ids in row:
                for b in ids:
                    pool.drop(b)
                ids.clear()
        self.table.zero_()
        if self.cell_pos is not None:
            self.cell_pos.fill_(-1)


    def __del__(self):
        try:
            if getattr(self, "_view_of", None) is None:
                self.reset()
        except Exception:  # noqa: BLE001 (interpreter shutdown: the pool may be gone already)
            pass

    # --- blocks ---------------------------------------------------------------------------------------
    def _unshare(self, slot: int, lane: int, first: int, last: int) -> None:
        """Blocks first..last (held) of (slot, lane) held by this lane alone: a shared one is copied (copy-on-write)."""
        ids, pool = self.held[slot][lane], self.pool
        for i in range(first, last + 1):
            b = ids[i]
            if pool.refs[b] > 1:
                fresh = pool.take()
                pool.copy_block(b, fresh)
                pool.drop(b)
                ids[i] = fresh
                self.table[slot, lane, i] = fresh

    def take_blocks(self, jobs: list[tuple[int, list[int], list[int], list[int]]]) -> None:
        """Make the cells of each job (slot, lanes, lo, hi: lane lanes[i] writes positions lo[i]..hi[i] of `slot`)
        writable: shared blocks are copied first (copy-on-write), then every block missing at a lane's end, in all the
        jobs' slots, is taken in one `take_many` and entered in one table write (a 16-loop lane crossing into a new
        block takes one in each of its ~34 slots at once). Only the scheduler calls this for an engine's cache
        (`Scheduler.reserve`); a forward finds its blocks there (`require`). BudgetError when the pool is out."""
        bt, refs, grow = self.bt, self.pool.refs, []
        for slot, lanes, lo, hi in jobs:
            row = self.held[slot]
            for lane, a, b in zip(lanes, lo, hi):
                if self.window:  # a ring takes all its blocks at once: it wraps, and holds only `ring` cells anyway
                    a, b = 0, self.ring - 1
                ids, first, last = row[lane], a // bt, b // bt
                held = len(ids)
                if last < held and refs[ids[last]] == 1 and (first == last or all(
                        refs[ids[i]] == 1 for i in range(first, last))):
                    continue  # the common case, checked inline: every block there and the lane's own
                if first < held and any(refs[ids[i]] > 1 for i in range(first, min(last, held - 1) + 1)):
                    self._unshare(slot, lane, first, min(last, held - 1))
                if last >= held:
                    grow.append((slot, lane, last + 1 - held))
        if not grow:
            return
        new = self.pool.take_many(sum(n for *_, n in grow))
        # where each new block goes in the table: new[i] at (at_slot[i], at_lane[i], at_index[i])
        at_slot: list[int] = []
        at_lane: list[int] = []
        at_index: list[int] = []
        for slot, lane, n in grow:
            ids = self.held[slot][lane]
            at_slot += [slot] * n
            at_lane += [lane] * n
            at_index += range(len(ids), len(ids) + n)
            ids += new[len(at_index) - n:len(at_index)]
        if len(new) == 1:
            self.table[at_slot[0], at_lane[0], at_index[0]] = new[0]
        else:
            dev = self.table.device
            self.table[torch.tensor(at_slot, device=dev), torch.tensor(at_lane, device=dev),
                       torch.tensor(at_index, device=dev)] = torch.tensor(new, device=dev)

    def reserve(self, lanes: list[int], lo: list[int], hi: list[int], loops: int) -> None:
        """Take the blocks lane lanes[i] needs for positions lo[i]..hi[i] in every slot a forward of `loops` loops
        writes (the prelude's, loops 0..loops-1 of the core's, the coda's): what a forward outside an engine step (a
        handle being built, a bench, a test) asks before it runs."""
        self.take_blocks([(slot, lanes, lo, hi) for slot in self.cfg.slots_written(loops)])

    def reserve_all(self) -> "KVCache":
        """Take every lane's blocks for every cell of every slot (a cache made on its own, as in tests and benches,
        before forwards outside an engine step); returns the cache."""
        every = list(range(self.lanes))
        self.take_blocks([(slot, every, [0] * self.lanes, [self.cells - 1] * self.lanes)
                          for slot in range(self.cfg.n_slots())])
        return self

    def require(self, jobs: list[tuple[int, list[int], list[int], list[int]]]) -> None:
        """Check that each job's cells (as in `take_blocks`) have their blocks, held by their lane alone: a forward
        writes only into blocks its step took (UnreservedBlock otherwise). The check runs on the host per step."""
        bt, refs = self.bt, self.pool.refs
        for slot, lanes, lo, hi in jobs:
            row = self.held[slot]
            for lane, a, b in zip(lanes, lo, hi):
                if self.window:
                    a, b = 0, self.ring - 1
                ids, first, last = row[lane], a // bt, b // bt
                if last < len(ids) and refs[ids[last]] == 1 and (first == last or all(
                        refs[ids[i]] == 1 for i in range(first, last))):
                    continue
                raise UnreservedBlock(
                        f"a forward writes cells {a}..{b} of lane {lane} in slot {slot}, whose blocks were not taken "
                        f"for it ({len(ids)} held{', shared' if last < len(ids) else ''}): blocks are taken before "
                        f"the forward (Scheduler.reserve in an engine step, KVCache.reserve outside one)")

    def locate(self, slot: int, lane: torch.Tensor, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, row) of cells [B, T] of lanes [B, 1] in `slot`."""
        return self.table[slot, lane, cells // self.bt], cells % self.bt

    def gather(self, slot: int, B: int, n: int) -> dict[str, torch.Tensor]:
        """Entries of cells 0..n-1 of lanes 0..B-1 in `slot`: tensors [B, n, ...]."""
        nb = -(-n // self.bt)
        if B == 1:  # one lane: a view when its blocks are consecutive (always when it holds one block per slot)
            held = self.held[slot][0][:nb]
            if len(held) == nb and held[-1] - held[0] == nb - 1 and held == list(range(held[0], held[0] + nb)):
                return {name: t[held[0]:held[0] + nb].view(1, nb * self.bt, *t.shape[2:])[:, :n]
                        for name, t in self.pool.store.items()}
        ids = self.table[slot, :B, :nb].reshape(-1)
        return {name: t.index_select(0, ids).view(B, nb * self.bt, *t.shape[2:])[:, :n]
                for name, t in self.pool.store.items()}

    def dense(self, name: str) -> torch.Tensor:
        """Every slot's and lane's cells of one stored tensor, [S, lanes, cells, ...] (tests and debugging)."""
        t = self.pool.store[name][self.table]
        return t.flatten(2, 3)[:, :, :self.cells]

    def write(self, slot: int, pos: torch.Tensor, cells: torch.Tensor, new: dict[str, torch.Tensor],
              lanes: torch.Tensor | None = None) -> None:
        """Store entries [B, T, ...] at cells [B, T] (positions pos [B, T]) of `slot`, lanes 0..B-1 or `lanes`."""
        self.changed()
        B = cells.shape[0]
        lane = torch.arange(B, device=self.device).unsqueeze(1) if lanes is None else lanes.view(B, 1)
        lane_list = list(range(B)) if lanes is None else lanes.view(-1).tolist()
        lo, hi = pos.min(1).values.tolist(), pos.max(1).values.tolist()
        if not self.window:
            lo, hi = cells.min(1).values.tolist(), cells.max(1).values.tolist()
        self.require([(slot, lane_list, lo, hi)])
        blk, row = self.locate(slot, lane, cells)
        for name, t in new.items():
            self.pool.store[name][blk, row] = t
        if self.cell_pos is not None:
            self.cell_pos[slot, lane, cells] = pos

    def copy_cell(self, src: list[int], dst: list[int], pos: int, lane: int, count: int = 1) -> None:
        """Copy the cells of positions pos..pos+count-1 of `lane` from slots src[i] to slots dst[i], in one indexed
        copy per stored tensor (an early-exited token's skipped loops get its last loop's entries; a prompt prefilled
        under a depth cap, every position's)."""
        positions = torch.arange(pos, pos + count, device=self.device)
        cells = positions % self.ring if self.window else positions
        lo, hi = (0, self.ring - 1) if self.window else (pos, pos + count - 1)
        self.require([(slot, [lane], [lo], [hi]) for slot in dst])
        self.changed()
        at, row = cells // self.bt, cells % self.bt
        src_blocks = self.table[torch.tensor(src, device=self.device)][:, lane, at]  # [len(src), count]
        dst_blocks = self.table[torch.tensor(dst, device=self.device)][:, lane, at]
        for t in self.pool.store.values():
            t[dst_blocks, row] = t[src_blocks, row]
        if self.cell_pos is not None:
            self.cell_pos[torch.tensor(dst, device=self.device).unsqueeze(1), lane, cells] = positions

    def fill_skipped(self, lane: int, pos: int, used: int, loops: int, count: int = 1) -> None:
        """Tokens at positions pos..pos+count-1 of `lane` that stopped after `used` of their `loops` loops (early exit,
        a depth cap): each core layer's entries of their last loop copied into the loops they skipped, so later tokens
        find keys at every depth. The one place the engine's torch paths fill skipped loops (the C step does it in
        kernels/cpu_block.c)."""
        cfg = self.cfg
        pairs = [(cfg.core_slot(used - 1, j), cfg.core_slot(k, j)) for k in range(used, loops) for j in range(cfg.n_core)]
        if pairs:
            self.copy_cell([a for a, _ in pairs], [b for _, b in pairs], pos, lane, count)

    # --- speculative decode ---------------------------------------------------------------------------
    def rollback(self, length: int, slots: list[int] | None = None) -> None:
        """Forget positions >= length (rejected drafts). Without a window nothing to do: the mask is causal by
        position and the next chunk overwrites those cells before anything reads them. A ring is read as
        "old cells + new chunk", so stale cells there must be marked empty."""
        self.changed()
        if self.cell_pos is not None and slots is None:
            self.cell_pos.masked_fill_(self.cell_pos >= length, -1)
        elif self.cell_pos is not None:
            sub = self.cell_pos[slots]
            self.cell_pos[slots] = sub.masked_fill(sub >= length, -1)

    def move_cells(self, src: torch.Tensor, dst: torch.Tensor, lane: int = 0) -> None:
        """Copy cells src -> dst [N] in every slot the lane holds (tree speculation: the accepted branch moves to its
        positions)."""
        lanes = torch.tensor([lane], device=self.device)
        for slot in range(len(self.held)):
            if self.held[slot][lane]:
                blk, row = self.locate(slot, lanes.view(1, 1), src.view(1, -1))
                data = {name: t[blk, row] for name, t in self.pool.store.items()}
                self.write(slot, dst.view(1, -1), dst.view(1, -1), data, lanes)

    # --- lanes (static batching, beam search) -----------------------------------------------------------
    def lane_view(self, lane: int) -> "KVCache":
        """A one-lane cache over this cache's lane `lane`: writing it fills that lane in place."""
        view = object.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        view._view_of, view._index = self, None
        view.lanes = 1
        view.table = self.table[:, lane:lane + 1]
        view.held = [[row[lane]] for row in self.held]  # the same lists: blocks taken by the view are the lane's
        view.cell_pos = None if self.cell_pos is None else self.cell_pos[:, lane:lane + 1]
        return view

    def select(self, lanes: list[int]) -> "KVCache":
        """A cache over some lanes, in that order (the runner steps only running sequences). Blocks it takes are the
        lanes' own; its block tables and ring positions are copies that `commit` writes back."""
        if lanes == list(range(len(lanes))):
            return self  # the first n lanes: every operation already reads lanes 0..B-1
        view = object.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        index = torch.tensor(lanes, device=self.device)
        view._view_of, view._index, view.lanes = self, index, len(lanes)
        view.table = self.table.index_select(1, index)
        view.held = [[row[i] for i in lanes] for row in self.held]
        view.cell_pos = None if self.cell_pos is None else self.cell_pos.index_select(1, index)
        return view

    def commit(self) -> None:
        """Write a selection's block tables and ring positions back to the cache it was selected from."""
        base, index = self._view_of, self._index
        if base is None or index is None:
            return
        base.table[:, index] = self.table
        if self.cell_pos is not None:
            assert base.cell_pos is not None  # (a view of a ring)
            base.cell_pos[:, index] = self.cell_pos

    def reorder_lanes(self, index: torch.Tensor) -> None:
        """Lane i takes the contents of lane index[i], for i < len(index)."""
        order = [int(i) for i in index]
        self.assign_lanes(list(range(len(order))), order)

    def assign_lanes(self, dst: list[int], src: list[int]) -> None:
        """Lane dst[i] takes the contents lane src[i] had, all at once (beam search: each child inherits its parent's
        cache). Lanes share the blocks (reference counted); a write into a shared block copies it."""
        pool = self.pool
        self.changed()
        for row in self.held:
            fresh = [list(row[i]) for i in src]
            for ids in fresh:
                for b in ids:
                    pool.retain(b)
            for lane, ids in zip(dst, fresh):
                for b in row[lane]:
                    pool.drop(b)
                row[lane][:] = ids
        to, frm = torch.tensor(dst, device=self.device), torch.tensor(src, device=self.device)
        self.table[:, to] = self.table.index_select(1, frm)
        if self.cell_pos is not None:
            self.cell_pos[:, to] = self.cell_pos.index_select(1, frm)

    # --- handles keep blocks of lane 0 and lend them back later ---------------------------------------
    def share(self, slots: range, cells: int) -> Span:
        """The blocks of lane 0 covering cells 0..cells-1 in `slots`, retained for a handle (no copy)."""
        n = -(-cells // self.bt)
        blocks = {}
        for s in slots:
            ids = self.held[s][0][:n]
            for b in ids:
                self.pool.retain(b)
            blocks[s] = list(ids)
        cp = None if self.cell_pos is None else {s: self.cell_pos[s, 0].clone() for s in slots}
        return Span(self.pool, blocks, cells, cp)

    def adopt(self, span: Span) -> None:
        """Lane 0 takes the span's blocks (shared: a later write into one copies it first)."""
        if span.pool is not self.pool:
            raise ConfigError("a handle's blocks belong to another pool")
        self.changed()
        for s, ids in span.blocks.items():
            held = self.held[s][0]
            for b in held:
                self.pool.drop(b)
            for b in ids:
                self.pool.retain(b)
            held[:] = ids
            self.table[s, 0].zero_()
            self.table[s, 0, :len(ids)] = torch.tensor(ids, dtype=torch.long, device=self.device)
            if self.cell_pos is not None and span.cell_pos is not None:
                self.cell_pos[s, 0] = span.cell_pos[s]
