"""`tinyloop inspect`: what an artifact (or a Hugging Face model directory) is, what it costs, how it behaves with
loops. `config_only` reads the config alone (an artifact's header, a directory's config.json) and prints the
memory plan without loading any weight, so a multi-GB checkpoint can be sized on any machine."""
from __future__ import annotations

import torch

from tinyloop.artifact import DEFAULT_ARTIFACT, read_artifact
from tinyloop.cache import CACHE_MODES, bytes_per_token_slot, check_mode
from tinyloop.config import ModelConfig
from tinyloop.errors import ConfigError
from tinyloop.gguf import is_gguf, load_gguf
from tinyloop.hf import config_and_dtype, is_hf_dir, load_hf
from tinyloop.formats import FORMATS
from tinyloop.memory import plan_memory, weight_bytes_of
from tinyloop.loader import load_model


def parameter_counts(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    groups: dict[str, int] = {}
    for name, t in tensors.items():
        part = name.split(".")[0]
        groups[part] = groups.get(part, 0) + t.numel()
    return groups


def plan_table(cfg: ModelConfig, dtype: torch.dtype, max_seq_len: int, loops: int | None = None) -> str:
    """One row per cache mode: KV bytes per token at `loops` (default: the model's default loop count), the pool
    for one sequence of max_seq_len tokens, and the total with weights and one step's workspace."""
    loops = loops or cfg.default_loops
    dbytes = torch.tensor([], dtype=dtype).element_size()
    weights = weight_bytes_of(cfg, dtype)
    rows = [f"memory plan: weights {str(dtype).replace('torch.', '')}, {max_seq_len} tokens, {loops} loops "
            f"({cfg.n_slots(loops)} KV slots per token)",
            f"  {'cache':<6} {'KV per token':>14} {'KV per sequence':>16} {'weights':>11} {'total, 1 seq':>13}"]
    for mode in CACHE_MODES:
        try:
            check_mode(cfg, mode)
        except ConfigError:  # (int4 store-h for normalised keys or value embeddings)
            rows.append(f"  {mode:<6} {'not for this model':>31}")
            continue
        per_token = bytes_per_token_slot(cfg, mode, dbytes) * cfg.n_slots(loops)
        plan = plan_memory(cfg, max_seq_len, mode, dtype=dtype, loops=loops)
        rows.append(f"  {mode:<6} {per_token / 2**10:>11.1f} KiB {plan.bytes_of('KV') / 2**20:>12,.0f} MiB "
                    f"{weights / 2**30:>7.2f} GiB {plan.total_bytes / 2**30:>9.2f} GiB")
    return "\n".join(rows)


def config_text(path: str, max_seq_len: int = 4096) -> str:
    """Config and memory plan from the config alone (no weights read)."""
    cfg, dtype, _ = config_and_dtype(path)
    n = weight_bytes_of(cfg, torch.float32) // 4
    lines = [f"model: {path}", "config:"] + [f"  {k:<22} {v}" for k, v in cfg.to_dict().items()]
    lines.append(f"parameters: {n:,}")
    lines.append(plan_table(cfg, dtype, max_seq_len))
    return "\n".join(lines)


def inspect_text(path: str | None = None) -> str:
    if is_gguf(path):  # its tensors' values (a quantised file's too), for the counts
        info, tensors = load_gguf(path)
    else:
        info, tensors = load_hf(path) if is_hf_dir(path) else read_artifact(path or DEFAULT_ARTIFACT)
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


def format_losses(path: str | None = None, loops: int | None = None, formats: tuple[str, ...] = FORMATS,
                  tokens: int = 16384, act_quant: bool | None = None) -> dict[str, float]:
    """Held-out loss (nats/token, at `loops`, default the model's) with the model's matrices in each weight format,
    on the same tokens: the bundled model's held-out split (every 50th file of the Python standard library, as
    train.py set it aside). Quantising from the artifact's own weights; a quantised artifact gives only its own.
    act_quant: load_model's (None: its default on the CPU, int8 activations for int8 / int4 weights)."""
    from scripts.train import EVAL_SEQ_LEN, held_out_ids, evaluate

    first = load_model(path, EVAL_SEQ_LEN, device="cpu", act_quant=act_quant)
    data = held_out_ids(first.info.codec)[:tokens + 1]
    loops = loops or first.net.cfg.default_loops
    out = {}
    for fmt in (formats if first.weights == "fp32" else (first.weights,)):
        model = first if fmt == first.weights else load_model(path, EVAL_SEQ_LEN, device="cpu", weights=fmt,
                                                              act_quant=act_quant)
        out[fmt] = evaluate(model.net, data, EVAL_SEQ_LEN, [loops], n_batches=len(data) // (EVAL_SEQ_LEN * 8) or 1)[loops]
    return out


def format_loss_text(path: str | None = None) -> str:
    losses = format_losses(path, act_quant=True)
    weight_only = format_losses(path, formats=("int8", "int4"), act_quant=False)
    losses.update({f"{fmt}, weight-only": loss for fmt, loss in weight_only.items() if fmt in ("int8", "int4")})
    base = losses.get("fp32")
    lines = ["held-out loss by weight format (nats/token at the default loops; difference to fp32; int8 / int4 with"
             " int8 activations, the CPU default, and weight-only):"]
    for fmt, loss in losses.items():
        lines.append(f"  {fmt:<17} {loss:.4f}" + ("" if base is None or fmt == "fp32" else f"  {loss - base:+.4f}"))
    return "\n".join(lines)
