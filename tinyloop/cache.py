"""The loop-aware KV cache in three storage modes.

Slots: prelude layer i owns slot i, core layer j at loop k owns slot P + k*R + j, coda layer i owns slot
P + max_loops*R + i (ModelConfig.core_slot / coda_slot). At loop k a token attends to the loop-k keys of
earlier tokens, which makes cached decode equal a full recompute.

Modes (bytes per token per slot, with kv_dim = n_kv_heads * head_dim, d = d_model, s = bytes of the model dtype):
  fp16  K and V in the model's dtype                        2 * kv_dim * s
  int8  K and V as int8, one fp16 scale per token and head   2 * (kv_dim + 2 * n_kv_heads)
  int4  store-h: the attention input h as int4 in groups of
        INT4_GROUP with one fp16 scale per group; K and V are
        recomputed from h when attended                        d / 2 + 2 * d / INT4_GROUP

With `window > 0` each slot is a ring buffer of `window` positions (sliding-window attention): position p
lives in cell p % ring (ring = window unless a caller asks for more), and the cell remembers which position it holds.
"""
from __future__ import annotations

import torch

from .config import ModelConfig
from .errors import ConfigError
from .kernels.dispatch import use_triton

CACHE_MODES = ("fp16", "int8", "int4")
INT4_GROUP = 32


def bytes_per_token_slot(cfg: ModelConfig, mode: str, dtype_bytes: int) -> int:
    if mode == "fp16":
        return 2 * cfg.kv_dim * dtype_bytes
    if mode == "int8":
        return 2 * (cfg.kv_dim + 2 * cfg.n_kv_heads)
    if mode == "int4":
        return cfg.d_model // 2 + 2 * (cfg.d_model // INT4_GROUP)
    raise ConfigError(f"cache_mode {mode!r} not one of {CACHE_MODES}")


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


class KVCache:
    """K/V storage for `lanes` sequences of up to `max_len` tokens, one slot per (layer, loop)."""

    def __init__(self, cfg: ModelConfig, lanes: int, max_len: int, mode: str = "fp16", *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, window: int = 0,
                 ring: int = 0):
        if mode not in CACHE_MODES:
            raise ConfigError(f"cache_mode {mode!r} not one of {CACHE_MODES}")
        if mode == "int4" and cfg.d_model % INT4_GROUP:
            raise ConfigError(f"cache_mode int4 needs d_model divisible by {INT4_GROUP}, got {cfg.d_model}")
        self.cfg, self.mode, self.lanes, self.max_len, self.window = cfg, mode, lanes, max_len, window
        self.dtype, self.device = dtype, torch.device(device)
        # A ring may hold more cells than the window (`ring`): speculative decode writes drafts it may roll back,
        # and the cells they overwrite must not be ones the window still needs.
        S, L = cfg.n_slots(), (max(window, ring) if window > 0 else max_len)
        self.ring = L if window > 0 else 0
        kv = (S, lanes, L, cfg.n_kv_heads, cfg.head_dim)
        z = lambda shape, dt: torch.zeros(shape, dtype=dt, device=device)
        if mode == "fp16":
            self.store = {"k": z(kv, dtype), "v": z(kv, dtype)}
        elif mode == "int8":
            sc = (S, lanes, L, cfg.n_kv_heads, 1)
            self.store = {"k": z(kv, torch.int8), "k_scale": z(sc, torch.float16),
                          "v": z(kv, torch.int8), "v_scale": z(sc, torch.float16)}
        else:
            self.store = {"h": z((S, lanes, L, cfg.d_model // 2), torch.uint8),
                          "h_scale": z((S, lanes, L, cfg.d_model // INT4_GROUP), torch.float16)}
        # Ring buffers remember the absolute position in each cell (-1: empty).
        self.cell_pos = torch.full((S, lanes, L), -1, dtype=torch.long, device=device) if window > 0 else None

    def nbytes(self) -> int:
        tensors = list(self.store.values()) + ([self.cell_pos] if self.cell_pos is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def reset(self) -> None:
        if self.cell_pos is not None:
            self.cell_pos.fill_(-1)

    # --- write / read ---------------------------------------------------------------------------------
    def _encode(self, h: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.mode == "fp16":
            return {"k": k, "v": v}
        if self.mode == "int8":
            kq, ks = quant_int8(k)
            vq, vs = quant_int8(v)
            return {"k": kq, "k_scale": ks, "v": vq, "v_scale": vs}
        hq, hs = quant_int4(h)
        return {"h": hq, "h_scale": hs}

    def _decode(self, attn, data: dict[str, torch.Tensor], pos: torch.Tensor, step) -> tuple[torch.Tensor, torch.Tensor]:
        """Full-precision K, V [B, N, n_kv, hd] from stored entries at positions pos [B, N]."""
        if self.mode == "fp16":
            return data["k"], data["v"]
        if self.mode == "int8":
            return dequant_int8(data["k"], data["k_scale"], self.dtype), dequant_int8(data["v"], data["v_scale"], self.dtype)
        h = dequant_int4(data["h"], data["h_scale"], self.dtype)
        return attn.project_kv(h, *step.rope_at(pos.clamp_min(0)))

    def update(self, attn, slot: int, step, h: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store the chunk's entries in `slot`; return keys, values [B, N, n_kv, hd] and the mask [B, 1, T, N]."""
        B, T = step.pos.shape
        lane = torch.arange(B, device=self.device).unsqueeze(1)
        new = self._encode(h, k, v)
        qpos = step.pos.unsqueeze(-1)  # [B, T, 1]
        if self.window == 0:
            cells = step.pos if step.cells is None else step.cells  # tree chunks bring their own cells and mask
            for name, t in new.items():
                self.store[name][slot, lane, cells] = t
            data = {name: t[slot, :B, :step.end] for name, t in self.store.items()}
            kpos = torch.arange(step.end, device=self.device).expand(B, step.end) if step.key_pos is None else step.key_pos
            keys, values = self._decode(attn, data, kpos, step)
            mask = kpos.unsqueeze(1) <= qpos if step.mask is None else step.mask
        else:
            # Attend over the ring as it was plus the new chunk, then keep the newest `ring` of the chunk.
            W = self.window
            old = {name: t[slot, :B] for name, t in self.store.items()}
            data = {name: torch.cat((old[name], new[name]), dim=1) for name in new}
            kpos = torch.cat((self.cell_pos[slot, :B], step.pos), dim=1)
            keys, values = self._decode(attn, data, kpos, step)
            kp = kpos.unsqueeze(1)
            mask = (kp >= 0) & (kp <= qpos) & (kp > qpos - W)
            keep = slice(max(0, T - self.ring), T)
            cells = step.pos[:, keep] % self.ring
            for name, t in new.items():
                self.store[name][slot, lane, cells] = t[:, keep]
            self.cell_pos[slot, lane, cells] = step.pos[:, keep]
        return keys, values, mask.unsqueeze(1)

    def attend(self, attn, slot: int, step, q: torch.Tensor, h: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Fused decode (one token per lane, plain positions): store it and attend over the stored layout with
        the Triton kernels of tinyloop/kernels. Returns [B, H, 1, hd], or None: use update + SDPA (the torch
        path, the default on CPU)."""
        if step.pos.shape[1] != 1 or getattr(step, "cells", None) is not None or getattr(step, "mask", None) is not None \
                or not use_triton(self.device):
            return None
        from .kernels.attention import decode_attend
        return decode_attend(self, attn, slot, step, q, h, k, v)

    def copy_slot(self, src: int, dst: int, pos: torch.Tensor, lanes: torch.Tensor | None = None) -> None:
        """Copy the entries at positions pos [B, T] from slot src to slot dst (early exit fills skipped loops)."""
        B = pos.shape[0]
        lane = (torch.arange(B, device=self.device) if lanes is None else lanes).unsqueeze(1)
        cells = pos % self.ring if self.window else pos
        for t in self.store.values():
            t[dst, lane, cells] = t[src, lane, cells]
        if self.cell_pos is not None:
            self.cell_pos[dst, lane, cells] = self.cell_pos[src, lane, cells]

    # --- speculative decode ---------------------------------------------------------------------------
    def rollback(self, length: int, slots: list[int] | None = None) -> None:
        """Forget positions >= length (rejected drafts). Without a window nothing to do: the mask is causal by
        position and the next chunk overwrites those cells before anything reads them. A ring is read as
        "old cells + new chunk", so stale cells there must be marked empty."""
        if self.cell_pos is not None and slots is None:
            self.cell_pos.masked_fill_(self.cell_pos >= length, -1)
        elif self.cell_pos is not None:
            sub = self.cell_pos[slots]
            self.cell_pos[slots] = sub.masked_fill(sub >= length, -1)

    def move_cells(self, src: torch.Tensor, dst: torch.Tensor, lane: int = 0) -> None:
        """Copy cells src -> dst [N] in every slot (tree speculation: the accepted branch moves to its positions)."""
        for t in self.store.values():
            t[:, lane, dst] = t[:, lane, src]

    # --- lanes (static batching, beam search) -----------------------------------------------------------
    def lane_view(self, lane: int) -> "KVCache":
        """A one-lane cache sharing this cache's storage for `lane`: prefilling it fills that lane in place."""
        view = object.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        view.lanes = 1
        view.store = {name: t[:, lane:lane + 1] for name, t in self.store.items()}
        view.cell_pos = None if self.cell_pos is None else self.cell_pos[:, lane:lane + 1]
        return view

    def reorder_lanes(self, index: torch.Tensor) -> None:
        """Lane i takes the contents of lane index[i], for i < len(index) (beam search: children inherit their
        parent's cache). The gather copies first, so a lane may be both a source and a destination."""
        index = index.to(self.device)
        n = index.shape[0]
        for t in self.store.values():
            t[:, :n] = t.index_select(1, index)
        if self.cell_pos is not None:
            self.cell_pos[:, :n] = self.cell_pos.index_select(1, index)

    # --- handles keep a range of positions of lane 0 and put it back later ---------------------------
    def _cells(self, start: int, end: int):
        if self.window == 0:
            return slice(start, end)
        return torch.arange(start, end, device=self.device) % self.window

    def read_range(self, slots: slice, start: int, end: int) -> dict[str, torch.Tensor]:
        """Copies of lane 0's entries for positions start..end-1 in `slots`: tensors [slots, end - start, ...].

        With a window only the newest `window` positions are held, so end - start must be <= window.
        """
        cells = self._cells(start, end)
        return {name: t[slots, 0, cells].clone() for name, t in self.store.items()}

    def write_range(self, slots: slice, start: int, data: dict[str, torch.Tensor]) -> None:
        """The inverse of read_range: put entries back into lane 0 at positions start.. of `slots`."""
        n = next(iter(data.values())).shape[1]
        cells = self._cells(start, start + n)
        for name, t in self.store.items():
            t[slots, 0, cells] = data[name]
        if self.cell_pos is not None:
            self.cell_pos[slots, 0, cells] = torch.arange(start, start + n, device=self.device)
