"""What every family's mapping shares: reading its config.json, and the small tensor transforms.

A family module (tinyloop/models/<family>.py) turns a checkpoint's config.json into ModelConfig fields and each of
its tensors into the looped core's (tinyloop/model.py). The one forward then runs it; nothing in a decode path
asks which family it runs.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import ArtifactError

# Extra loop counts a converted model accepts beyond the checkpoint's default (the references run any count).
MAX_LOOPS_FACTOR = 2

Transform = Callable[[torch.Tensor], torch.Tensor]
Targets = list[tuple[str, Transform]]  # a checkpoint tensor -> the TinyLoop tensors made of it


def same(t: torch.Tensor) -> torch.Tensor:
    return t


class Raw:
    """A checkpoint's config.json (`data`) for the family `kind`, read with the family's words in every error."""

    def __init__(self, path: Path, data: dict, kind: str):
        self.path, self.data, self.kind = Path(path), data, kind

    def get(self, key: str, default=None, *alts: str):
        """The first of key, *alts that is set; else default; ArtifactError when there is no default."""
        for k in (key, *alts):
            if self.data.get(k) is not None:
                return self.data[k]
        if default is None:
            raise ArtifactError(f"{self.path}: config.json lacks {key!r}, which a {self.kind} model needs")
        return default

    def need(self, ok: bool, what: str) -> None:
        """ArtifactError naming an option of the checkpoint that TinyLoop does not implement."""
        if not ok:
            raise ArtifactError(f"{self.path}: {what} is not supported by TinyLoop (model_type {self.kind})")


def renamed(name: str, table: dict[str, str], tied: bool) -> Targets | None:
    """A tensor whose TinyLoop name is a fixed one (embedding, final norm, head): [] for a tied head saved beside
    the embedding (not read), None for a name the table lacks."""
    if name not in table:
        return None
    return [] if tied and table[name] == "lm_head.weight" else [(table[name], same)]


# The Llama naming of a decoder layer's matrices (model.layers.<i>.<module>.weight), which Ouro and Nanbeige keep.
LLAMA_LINEARS = {"self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv",
                 "self_attn.o_proj": "attn.wo", "mlp.gate_proj": "mlp.w_gate", "mlp.up_proj": "mlp.w_up",
                 "mlp.down_proj": "mlp.w_down"}


def stacked(name: str, fixed: dict[str, str], norms: dict[str, str], tied: bool) -> Targets | None:
    """A tensor of a whole-stack-looped model with Llama's names: a `fixed` one (embedding, final norm, head...), or
    `model.layers.<i>.<module>.weight` -> core layer i's (Llama's names for the matrices, `norms` for the norms);
    None for any other name."""
    named = renamed(name, fixed, tied)
    if named is not None:
        return named
    parts = name.split(".")
    if parts[:2] != ["model", "layers"] or parts[-1] != "weight":
        return None
    sub = LLAMA_LINEARS.get(".".join(parts[3:5])) if len(parts) == 6 else norms.get(parts[3]) if len(parts) == 5 \
        else None
    return [(f"core.{parts[2]}.{sub}.weight", same)] if sub else None


def interleaved_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection (or its bias), per head, from interleaved RoPE pairs (0,1),(2,3).. to halves.

    TinyLoop rotates half-split pairs (i, i + hd/2). Huginn and Parcae rotate interleaved pairs (2i, 2i+1). One
    permutation applied to the rows of both q and k leaves attention scores unchanged (and a per-head norm too),
    so the layout is converted once, in the weights, not branched on in the forward."""
    hd = w.shape[0] // heads
    perm = torch.cat((torch.arange(0, hd, 2), torch.arange(1, hd, 2)))
    return w.reshape(heads, hd, *w.shape[1:])[:, perm].reshape(w.shape)
