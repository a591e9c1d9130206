"""Nanbeige4.2 (Nanbeige/Nanbeige4.2-3B; `model_type` "nanbeige").

Reference: `modeling_nanbeige.py`, the remote code published beside the checkpoint (Apache-2.0). How the published
3B config maps onto the looped core:
- blocks: Llama's pre-norm block (RMSNorm, attention, RMSNorm, SwiGLU), grouped-query heads whose width is its own
  (`head_dim` 128 beside hidden_size 3072 and 48 heads: head_size), half-split RoPE as TinyLoop's.
- loop: the whole stack of `num_hidden_layers` is the looped core (no prelude or coda), run `num_loops` times (or
  len(loop_loss_weights) + 1); the state starts as the embedding and feeds the next pass unchanged; the final norm
  closes every pass and the normalised state loops on (loop_norm), unless `skip_loop_final_norm`, when it closes the
  last only.
- exit rule: the reference has none (it runs every pass); TinyLoop's latent-change rule is available.
- KV across loops: one slot per (loop, layer), the reference's layer_idx + loop_idx * num_hidden_layers; a token
  that exits early copies its last loop's K/V into the loops it skipped ("copy").

What its modeling code can do beyond that (n-gram embeddings, hyper-connections with Sinkhorn iterations, the
"double loop split" layer order, loop-shared KV, depth attention, per-head q/k norms) the published config leaves
off; a config that turns one on is refused with its name (docs/hf.md).
"""
from __future__ import annotations

from ..config import ModelConfig
from .family import MAX_LOOPS_FACTOR, Raw, Targets, stacked

NAME = "nanbeige"
KIND = "nanbeige"
ABOUT = {"checkpoints": "Nanbeige/Nanbeige4.2-3B", "licence": "Apache-2.0",
         "reference": "`modeling_nanbeige.py` (the checkpoint's remote code)", "loops": "`num_loops` (2)",
         "exit": "none in the reference (TinyLoop's latent change)",
         "kv": "one slot per (loop, layer); skipped loops copy the last"}

FIXED = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
         "lm_head.weight": "lm_head.weight"}
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
# Its research options, each off in the published config; on, TinyLoop refuses the checkpoint by name.
OFF = ("enable_hyper_connection", "enable_mhc", "enable_double_loop_split", "loop_share_kv", "enable_depth_attention",
       "qk_layernorm", "attention_bias", "mlp_bias", "mhc_diff_for_loop")
UNSET = ("emb_neighbor_num", "ngram_vocab_size_ratio", "rope_scaling", "mhc_double_stream_position_for_loop")


def claims(raw: dict) -> bool:
    return raw.get("model_type") == KIND


def config(c: Raw) -> dict:
    """ModelConfig fields of a Nanbeige config.json."""
    for key in OFF:
        c.need(not c.data.get(key), f"{key}=true")
    for key in UNSET:
        c.need(c.data.get(key) is None, f"{key} {c.data.get(key)!r}")
    c.need(c.get("hidden_act", "silu") == "silu", f"hidden_act {c.data.get('hidden_act')!r}")
    c.need(c.get("pretraining_tp", 1) == 1, "pretraining_tp != 1")
    d, heads = c.get("hidden_size"), c.get("num_attention_heads")
    weights = c.data.get("loop_loss_weights") or []
    loops = len(weights) + 1 if weights else c.get("num_loops", 1)
    skip = bool(c.get("skip_loop_final_norm", False))
    return dict(vocab_size=int(c.get("vocab_size")), d_model=d, n_heads=heads,
                n_kv_heads=c.get("num_key_value_heads", heads), head_size=c.get("head_dim", d // heads),
                ffn_hidden=c.get("intermediate_size"), n_prelude=0, n_core=c.get("num_hidden_layers"), n_coda=0,
                default_loops=loops, max_loops=MAX_LOOPS_FACTOR * loops, injection="none", state_init="embed",
                loop_norm=not skip, final_norm=skip, tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                rope_theta=float(c.get("rope_theta", 10000.0)), norm_eps=float(c.get("rms_norm_eps", 1e-6)))


def tensors(name: str, cfg: ModelConfig) -> Targets | None:
    """A Nanbeige tensor -> [(TinyLoop name, transform)]; None for a name it does not have. One to one."""
    return stacked(name, FIXED, NORMS, cfg.tie_embeddings)
