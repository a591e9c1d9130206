"""The looped transformer of DESIGN section 2, in plain torch.

ids -> embed -> prelude -> e;  s0 = init(e);  s_k = core(inject(s_{k-1}, e)) for k = 1..L;  coda(s_L) -> logits

One code path serves prefill, decode, speculative verification and training: a forward over a chunk of
T tokens per lane at given absolute positions. With a cache, each layer writes its K/V for the chunk into
its slot (core layers own one slot per loop) and attends over everything the slot holds for that lane.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, hd]; cos/sin: [B, T, 1, hd/2] already gathered at the tokens' positions."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@dataclass
class Step:
    """Where a chunk of tokens sits: absolute positions [B, T] and rotary factors for them.

    `end` is 1 + the largest position in the chunk, as a Python int so reading the cache needs no host sync.
    """
    pos: torch.Tensor
    end: int
    table_cos: torch.Tensor
    table_sin: torch.Tensor
    window: int = 0  # sliding-window width for the cache-free path (the cache applies its own window)
    # Tree chunks (speculative decoding): positions repeat across branches, so each token gets its own cache
    # cell, the cells read carry their positions, and attention follows an explicit ancestor mask [B, T, end].
    # `end` is then 1 + the largest cell read. All None on the plain paths: cell = position, causal mask.
    cells: torch.Tensor | None = None
    key_pos: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def __post_init__(self):
        self.cos, self.sin = self.rope_at(self.pos)

    def rope_at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary factors [B, N, 1, hd/2] at positions pos [B, N]."""
        return self.table_cos[pos].unsqueeze(2), self.table_sin[pos].unsqueeze(2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_dim, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def project_kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (rotated) and V of attention inputs h [B, T, d]; the int4 store-h cache calls this to recompute."""
        B, T, _ = h.shape
        k = self.wk(h).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(h).view(B, T, self.n_kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def forward(self, h: torch.Tensor, step: Step, cache=None, slot: int = 0) -> torch.Tensor:
        B, T, _ = h.shape
        q = apply_rope(self.wq(h).view(B, T, self.n_heads, self.head_dim), step.cos, step.sin)
        k, v = self.project_kv(h, step.cos, step.sin)
        if cache is None and not step.window:  # training / full recompute: causal attention over the chunk
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True)
        elif cache is None:  # full recompute with a sliding window: the reference for the ring buffer
            qp, kp = step.pos.unsqueeze(-1), step.pos.unsqueeze(1)
            mask = ((kp <= qp) & (kp > qp - step.window)).unsqueeze(1)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=mask, enable_gqa=True)
        else:  # through the paged cache (the lean step of tinyloop/kernels runs decode rows faster)
            keys, values, mask = cache.update(self, slot, step, h, k, v)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                                 attn_mask=mask, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """Pre-norm attention + SwiGLU, with optional sandwich norms on each branch's output."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:
            self.attn_out_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.mlp_out_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x: torch.Tensor, step: Step, cache=None, slot: int = 0) -> torch.Tensor:
        a = self.attn(self.attn_norm(x), step, cache, slot)
        x = x + (self.attn_out_norm(a) if self.sandwich else a)
        m = self.mlp(self.mlp_norm(x))
        return x + (self.mlp_out_norm(m) if self.sandwich else m)


class LoopedLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_seq_len: int = 2048):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.prelude = nn.ModuleList(Block(cfg) for _ in range(cfg.n_prelude))
        self.core = nn.ModuleList(Block(cfg) for _ in range(cfg.n_core))
        self.coda = nn.ModuleList(Block(cfg) for _ in range(cfg.n_coda))
        self.adapter = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False) if cfg.injection == "adapter" else None
        self.exit_gate = nn.Linear(cfg.d_model, 1) if cfg.exit_gate else None
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.set_max_seq_len(max_seq_len)
        self.apply(self._init_weights)

    def set_max_seq_len(self, max_seq_len: int) -> None:
        """Position tables (RoPE, the per-position initial noise) for positions 0..max_seq_len-1. Growing them keeps
        every existing entry's value (both are functions of the position alone), so a sliding-window sequence
        may run past the length the model was loaded with (ensure_positions)."""
        cos, sin = rope_tables(self.cfg.head_dim, max_seq_len, self.cfg.rope_theta)
        dtype, device = self.embed.weight.dtype, self.embed.weight.device
        self.register_buffer("rope_cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device=device, dtype=dtype), persistent=False)
        if self.cfg.state_init == "normal":  # one fixed noise vector per position: cached == recomputed
            g = torch.Generator().manual_seed(self.cfg.init_seed)
            noise = torch.randn(max_seq_len, self.cfg.d_model, generator=g) * self.cfg.init_sigma
            self.register_buffer("init_noise", noise.to(device), persistent=False)
        self.max_seq_len = max_seq_len

    def ensure_positions(self, n: int) -> None:
        """Position tables reach at least n positions (doubling, so a long windowed run grows them rarely)."""
        if n > self.max_seq_len:
            self.set_max_seq_len(max(n, 2 * self.max_seq_len))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    # --- pieces -------------------------------------------------------------------------------------
    def make_step(self, pos: torch.Tensor, end: int | None = None, window: int = 0) -> Step:
        if end is None:
            end = int(pos.max()) + 1
        return Step(pos, end, self.rope_cos, self.rope_sin, window)

    def encode(self, ids: torch.Tensor, step: Step, cache=None) -> torch.Tensor:
        """Embedding and prelude: e, the input every loop is injected with."""
        x = self.embed(ids)
        for i, block in enumerate(self.prelude):
            x = block(x, step, cache, i)
        return x

    def init_state(self, e: torch.Tensor, step: Step) -> torch.Tensor:
        if self.cfg.state_init == "zeros":
            return torch.zeros_like(e)
        if self.cfg.state_init == "embed":
            return e
        return self.init_noise[step.pos].to(e.dtype)

    def loop(self, s: torch.Tensor, e: torch.Tensor, k: int, step: Step, cache=None) -> torch.Tensor:
        """One pass of the shared core at loop k (0-based): s_{k+1} = core(inject(s_k, e))."""
        inj = self.cfg.injection
        x = s if inj == "none" else s + e if inj == "add" else self.adapter(torch.cat((s, e), dim=-1))
        for j, block in enumerate(self.core):
            x = block(x, step, cache, self.cfg.core_slot(k, j))
        return x

    def exit_prob(self, s: torch.Tensor) -> torch.Tensor | None:
        return None if self.exit_gate is None else torch.sigmoid(self.exit_gate(s)).squeeze(-1)

    def decode_head(self, s: torch.Tensor, step: Step, cache=None) -> torch.Tensor:
        """Coda, final norm and head: logits."""
        x = s
        for i, block in enumerate(self.coda):
            x = block(x, step, cache, self.cfg.coda_slot(i))
        x = self.norm(x)
        return x @ self.embed.weight.t() if self.lm_head is None else self.lm_head(x)

    # --- whole forward ------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, loops: int, step: Step | None = None, cache=None,
                grad_loops: int | None = None, return_states: bool = False):
        """Logits for a chunk. Without a cache this is a plain causal forward (training, full recompute).

        grad_loops: when training, backpropagate through only the last `grad_loops` loops (the earlier ones
        run without autograd), which bounds memory and compute like truncated backprop through time.
        """
        if step is None:
            T = ids.shape[1]
            step = self.make_step(torch.arange(T, device=ids.device).expand(ids.shape[0], T), T)
        e = self.encode(ids, step, cache)
        s = self.init_state(e, step)
        states = [s]
        no_grad_until = loops - grad_loops if grad_loops is not None else 0
        for k in range(loops):
            if k < no_grad_until:
                with torch.no_grad():
                    s = self.loop(s, e, k, step, cache)
            else:
                s = self.loop(s, e, k, step, cache)
            if return_states:
                states.append(s)
        logits = self.decode_head(s, step, cache)
        return (logits, states) if return_states else logits

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # --- adaptive depth (early exit) ------------------------------------------------------------------
    def exit_mask(self, s_prev: torch.Tensor, s_new: torch.Tensor, threshold: float) -> torch.Tensor:
        """[B] True where a lane's token may stop looping: small relative latent change, or the exit gate fires."""
        done = torch.zeros(s_new.shape[0], dtype=torch.bool, device=s_new.device)
        if threshold > 0:
            rel = (s_new - s_prev).float().norm(dim=-1) / s_new.float().norm(dim=-1).clamp_min(1e-12)
            done |= (rel < threshold).all(dim=-1)
        gate = self.exit_prob(s_new)
        if gate is not None:
            done |= (gate >= 0.5).all(dim=-1)
        return done

    def forward_adaptive(self, ids: torch.Tensor, loops: int, step: Step, cache, threshold: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached forward of one token per lane with early exit; returns logits and loops used per lane.

        A lane that exits keeps its state; its K/V for the loops it skipped are copies of its last loop's,
        so later tokens still find keys at every depth (DESIGN section 2).
        """
        e = self.encode(ids, step, cache)
        s = self.init_state(e, step)
        B = ids.shape[0]
        used = torch.full((B,), loops, dtype=torch.long)
        active = torch.ones(B, dtype=torch.bool, device=ids.device)
        for k in range(loops):
            s_new = self.loop(s, e, k, step, cache)
            done = self.exit_mask(s, s_new, threshold) & active
            s = torch.where(active.view(B, 1, 1), s_new, s)
            if done.any():
                used[done.cpu()] = k + 1
                active &= ~done
                if not active.any():
                    break
        for lane in range(B):
            last = int(used[lane]) - 1
            for k in range(last + 1, loops):
                for j in range(self.cfg.n_core):
                    cache.copy_slot(self.cfg.core_slot(last, j), self.cfg.core_slot(k, j),
                                    step.pos[lane:lane + 1], torch.tensor([lane], device=ids.device))
        return self.decode_head(s, step, cache), used
