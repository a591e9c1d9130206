"""Huginn-0125 (tomg-group-umd/huginn-0125; `model_type` "huginn_raven").

Reference: `raven_modeling_minimal.py` (seal-rg/recurrent-pretraining). How it maps onto the looped core:
- blocks: prelude / recurrent block / coda (2 / 4 / 2); sandwich norms on the residual sums (sandwich_residual);
  q/k biases added before RoPE; a fused Wqkv and a fused gate|up matrix, split here; interleaved RoPE pairs,
  converted to TinyLoop's half-split layout by permuting q and k rows (family.interleaved_to_halves).
- loop: embeddings scaled by sqrt(d); a random initial state (truncated normal, std sqrt(2/(5d)) x sqrt(d), cut at
  3 std; `init_scale` scales it); adapter injection W [s ; e]; the final norm before the coda and again before the head.
- exit rule "latent": the reference's latent-diff criterion |s_k - s_{k-1}| / |s_k| < threshold.
- KV across loops "copy": a token that exits skips its remaining loops, whose K/V are its last loop's (the
  reference's cache_lookup_strategy "latest-m4").
"""
from __future__ import annotations

import math

from ..config import ModelConfig
from .family import MAX_LOOPS_FACTOR, Raw, Targets, interleaved_to_halves, renamed, same

NAME = "huginn"
KIND = "huginn_raven"
ABOUT = {"checkpoints": "tomg-group-umd/huginn-0125", "licence": "Apache-2.0",
         "reference": "`raven_modeling_minimal.py` (seal-rg/recurrent-pretraining)", "loops": "`mean_recurrence` (32)",
         "exit": "latent change (latent-diff)", "kv": "one slot per (loop, layer); skipped loops copy the last"}

# The initial state: std sqrt(2 / (5 d)) times the embedding scale sqrt(d), truncated at 3 std, times init_scale.
INIT_STD = math.sqrt(2 / 5)
FIXED = {"transformer.wte.weight": "embed.weight", "transformer.adapter.weight": "adapter.weight",
         "transformer.ln_f.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
GROUPS = {"prelude": "prelude", "core_block": "core", "coda": "coda"}
NORMS = {"norm_1.weight": "attn_norm", "norm_2.weight": "attn_out_norm", "norm_3.weight": "mlp_norm",
         "norm_4.weight": "mlp_out_norm"}


def claims(raw: dict) -> bool:
    return raw.get("model_type") == KIND


def config(c: Raw) -> dict:
    """ModelConfig fields of a Huginn config.json."""
    d = c.get("n_embd")
    heads = c.get("n_heads", None, "num_attention_heads")
    c.need(c.get("injection_type", "linear") == "linear", f"injection_type {c.data.get('injection_type')!r}")
    c.need(c.get("state_init", "like-init") == "like-init", f"state_init {c.data.get('state_init')!r}")
    c.need(not c.get("bias", False), "bias=true (biased linear layers)")
    c.need(c.get("block_class_name", "SandwichBlock") == "SandwichBlock", f"block {c.data.get('block_class_name')!r}")
    c.need(c.get("mlp_class_name", "GatedMLP") == "GatedMLP", f"mlp {c.data.get('mlp_class_name')!r}")
    c.need(not c.data.get("test_time_noise"), "test_time_noise")
    steps = c.get("mean_recurrence", 32)
    return dict(vocab_size=int(c.get("padded_vocab_size", None, "vocab_size")), d_model=d, n_heads=heads,
                n_kv_heads=heads, ffn_hidden=c.get("intermediate_size"), n_prelude=c.get("n_layers_in_prelude", 2),
                n_core=c.get("n_layers_in_recurrent_block", 4), n_coda=c.get("n_layers_in_coda", 2),
                default_loops=steps, max_loops=MAX_LOOPS_FACTOR * steps, injection="adapter", state_init="normal",
                init_sigma=INIT_STD, init_trunc=3.0, embed_scale=math.sqrt(d), qk_bias=bool(c.get("qk_bias", False)),
                sandwich_norm=True, sandwich_residual=True, coda_norm=True,
                tie_embeddings=bool(c.get("tie_embeddings", True, "tie_word_embeddings")),
                rope_theta=float(c.get("rope_base", 50000.0)), norm_eps=float(c.get("norm_eps", 1e-6)))


def tensors(name: str, cfg: ModelConfig) -> Targets | None:
    """A Huginn tensor -> [(TinyLoop name, transform)]; None for a name Huginn does not have."""
    fixed = renamed(name, FIXED, cfg.tie_embeddings)
    if fixed is not None:
        return fixed
    parts = name.split(".")
    group = GROUPS.get(parts[1]) if len(parts) > 3 else None
    if parts[0] != "transformer" or group is None:
        return None
    base, rest = f"{group}.{parts[2]}", ".".join(parts[3:])
    H, hd, ffn, d, kv = cfg.n_heads, cfg.head_dim, cfg.ffn_hidden, cfg.d_model, cfg.kv_dim
    if rest in NORMS:
        return [(f"{base}.{NORMS[rest]}.weight", same)]
    if rest == "attn.Wqkv.weight":  # rows: q (H*hd), k, v; q and k permuted for the half-split RoPE
        return [(f"{base}.attn.wq.weight", lambda t: interleaved_to_halves(t[:d], H)),
                (f"{base}.attn.wk.weight", lambda t: interleaved_to_halves(t[d:d + kv], cfg.n_kv_heads)),
                (f"{base}.attn.wv.weight", lambda t: t[d + kv:])]
    if rest == "attn.qk_bias":  # [2, 1, H, hd]: added to q and k before RoPE, i.e. the projections' biases
        return [(f"{base}.attn.wq.bias", lambda t: interleaved_to_halves(t[0].reshape(H * hd), H)),
                (f"{base}.attn.wk.bias", lambda t: interleaved_to_halves(t[1].reshape(H * hd), H))]
    if rest == "attn.proj.weight":
        return [(f"{base}.attn.wo.weight", same)]
    if rest == "mlp.fc.weight":  # one fused matrix: the first half gates (SiLU), the second is the up projection
        return [(f"{base}.mlp.w_gate.weight", lambda t: t[:ffn]), (f"{base}.mlp.w_up.weight", lambda t: t[ffn:])]
    if rest == "mlp.proj.weight":
        return [(f"{base}.mlp.w_down.weight", same)]
    return None
