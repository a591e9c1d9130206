"""plan_memory: what serving a model costs, item by item, before anything is allocated."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import bytes_per_token_slot
from .config import ModelConfig
from .errors import BudgetError


@dataclass
class MemoryPlan:
    items: list[tuple[str, int]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b in self.items)

    def bytes_of(self, name: str) -> int:
        return sum(b for n, b in self.items if n.startswith(name))

    def table(self) -> str:
        rows = [f"  {name:<58} {b / 2**20:>10.2f} MiB" for name, b in self.items]
        rows.append(f"  {'total':<58} {self.total_bytes / 2**20:>10.2f} MiB")
        return "\n".join(rows)

    def check(self, budget_bytes: int, what: str = "budget") -> None:
        if self.total_bytes > budget_bytes:
            raise BudgetError(f"memory plan {self.total_bytes / 2**20:.1f} MiB exceeds the {what} of "
                              f"{budget_bytes / 2**20:.1f} MiB:\n{self.table()}")


def plan_memory(model, max_seq_len: int | None = None, cache_mode: str | None = None, lanes: int = 1,
                max_handles: int = 0, handle_tokens: int | None = None, dtype: torch.dtype | None = None) -> MemoryPlan:
    """Itemise weights, decode cache and live handles for a Model (or a ModelConfig with explicit values).

    decode cache = lanes x max_seq_len x slots(max_loops) x bytes per token-slot of the cache mode.
    handle       = handle_tokens x (slots x bytes per token-slot + the latent state s and input e per token)
                   + one row of logits, the most a PrefixCache (slots + its last logits), a ResumeHandle
                   (slots but the coda's + e + s) or a pool entry of that many tokens holds.
    """
    if isinstance(model, ModelConfig):
        cfg, weights = model, None
        max_seq_len, cache_mode = max_seq_len or 2048, cache_mode or "fp16"
        dtype = dtype or torch.float32
    else:
        cfg, weights = model.cfg, model.weight_bytes()
        max_seq_len, cache_mode, dtype = max_seq_len or model.max_seq_len, cache_mode or model.cache_mode, dtype or model.dtype
    dbytes = torch.tensor([], dtype=dtype).element_size()
    if weights is None:
        from .model import LoopedLM
        with torch.device("meta"):
            weights = LoopedLM(cfg, max_seq_len=1).num_params() * dbytes
    per_slot = bytes_per_token_slot(cfg, cache_mode, dbytes)
    slots = cfg.n_slots()
    plan = MemoryPlan([(f"weights ({dtype})".replace("torch.", ""), weights),
                       (f"decode cache ({lanes} lane x {max_seq_len} tok x {slots} slots x {per_slot} B, {cache_mode})",
                        lanes * max_seq_len * slots * per_slot)])
    if max_handles:
        tokens = handle_tokens or max_seq_len
        per_handle = tokens * (slots * per_slot + 2 * cfg.d_model * dbytes) + cfg.vocab_size * dbytes
        plan.items.append((f"handles ({max_handles} x {tokens} tok, {cache_mode})", max_handles * per_handle))
    return plan
