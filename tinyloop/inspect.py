"""`tinyloop inspect`: what an artifact is, what it costs, how it behaves with loops."""
from __future__ import annotations

import torch

from .artifact import DEFAULT_ARTIFACT, read_artifact
from .cache import CACHE_MODES, bytes_per_token_slot
from .memory import plan_memory


def parameter_counts(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    groups: dict[str, int] = {}
    for name, t in tensors.items():
        part = name.split(".")[0]
        groups[part] = groups.get(part, 0) + t.numel()
    return groups


def inspect_text(path: str | None = None) -> str:
    info, tensors = read_artifact(path or DEFAULT_ARTIFACT)
    cfg = info.config
    counts = parameter_counts(tensors)
    lines = [f"artifact: {info.path}", "config:"]
    lines += [f"  {k:<22} {v}" for k, v in cfg.to_dict().items()]
    lines.append(f"parameters: {sum(counts.values()):,} total")
    lines += [f"  {k:<22} {v:,}" for k, v in counts.items()]
    per_loop = counts.get("core", 0) + counts.get("adapter", 0)
    lines.append(f"  looped per token: {per_loop:,} x loops (shared weights; compute grows with loops, size does not)")
    beta = "not measured" if info.beta is None else f"{info.beta:.3f} ({'<= 1: later loops change the state less; self-speculative decode should pay' if info.beta <= 1 else '> 1: later loops still move the state; speculative decode may not pay'})"
    lines.append(f"beta: {beta}")
    if info.loss_vs_loops:
        lines.append("held-out loss by loops:")
        lines += [f"  loops {k:>2}: {v:.3f} nats/token" for k, v in sorted(info.loss_vs_loops.items())]
    lines.append(f"cache bytes per token per layer-slot (model dtype float32 on CPU; slots = {cfg.n_slots()} at max_loops {cfg.max_loops}):")
    for mode in CACHE_MODES:
        per = bytes_per_token_slot(cfg, mode, 4)
        lines.append(f"  {mode:<5} {per:>6} B per slot, {per * cfg.n_slots() / 1024:>8.1f} KiB per token")
    lines.append("memory plan at max_seq_len 2048, 1 lane, fp16 cache:")
    lines.append(plan_memory(cfg, 2048, "fp16").table())
    if info.provenance:
        lines.append("provenance: " + ", ".join(f"{k}={v}" for k, v in info.provenance.items()))
    return "\n".join(lines)
