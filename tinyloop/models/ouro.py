"""Ouro (ByteDance/Ouro-1.4B, -2.6B and their -Thinking variants; `model_type` "ouro").

Reference: the checkpoints' remote code, `modeling_ouro.py`. How it maps onto the looped core:
- blocks: the whole stack is the looped core (no prelude or coda); sandwich norms on each branch's output before
  it is added; SwiGLU; half-split RoPE, as TinyLoop's.
- loop: the state starts as the embedding and feeds the next loop unchanged (injection "none"); every loop ends with
  the final norm and the normalised state loops on (loop_norm), so there is no norm before the head.
- exit rule "cdf": after loop k the gate gives lambda_k = sigmoid(gate(s_k)); p_k = lambda_k prod_{j<k} (1 - lambda_j),
  the last loop taking the rest; a token exits at the first loop whose cumulative probability reaches the threshold.
- KV across loops "compute": the reference computes every loop for every token, so TinyLoop does too and takes the
  exit loop's state for the logits (`convert --exit-kv copy` skips the loops after the exit instead).
"""
from __future__ import annotations

from ..config import ModelConfig
from .family import MAX_LOOPS_FACTOR, Raw, Targets, stacked

NAME = "ouro"
KIND = "ouro"
ABOUT = {"checkpoints": "ByteDance/Ouro-1.4B, Ouro-2.6B (+ -Thinking)", "licence": "Apache-2.0",
         "reference": "`modeling_ouro.py` (the checkpoints' remote code)", "loops": "`total_ut_steps` (4)",
         "exit": "exit gate, cumulative distribution (cdf)", "kv": "one slot per (loop, layer); every loop computed"}

FIXED = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
         "model.early_exit_gate.weight": "exit_gate.weight", "model.early_exit_gate.bias": "exit_gate.bias",
         "lm_head.weight": "lm_head.weight"}
NORMS = {"input_layernorm": "attn_norm", "input_layernorm_2": "attn_out_norm",
         "post_attention_layernorm": "mlp_norm", "post_attention_layernorm_2": "mlp_out_norm"}


def claims(raw: dict) -> bool:
    return raw.get("model_type") == KIND


def config(c: Raw) -> dict:
    """ModelConfig fields of an Ouro config.json."""
    d, heads = c.get("hidden_size"), c.get("num_attention_heads")
    c.need(c.get("hidden_act", "silu") == "silu", f"hidden_act {c.data.get('hidden_act')!r}")
    c.need(not c.data.get("rope_scaling"), f"rope_scaling {c.data.get('rope_scaling')!r}")
    c.need(not c.data.get("use_sliding_window"), "use_sliding_window")
    c.need(c.get("head_dim", d // heads) == d // heads, f"head_dim {c.data.get('head_dim')} != hidden_size / heads")
    steps = c.get("total_ut_steps", 4)
    return dict(vocab_size=int(c.get("vocab_size")), d_model=d, n_heads=heads,
                n_kv_heads=c.get("num_key_value_heads", heads), ffn_hidden=c.get("intermediate_size"), n_prelude=0,
                n_core=c.get("num_hidden_layers"), n_coda=0, default_loops=steps, max_loops=MAX_LOOPS_FACTOR * steps,
                injection="none", state_init="embed", sandwich_norm=True, loop_norm=True, final_norm=False,
                exit_gate=True, exit_rule="cdf", exit_kv="compute",
                tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                rope_theta=float(c.get("rope_theta", 10000.0)), norm_eps=float(c.get("rms_norm_eps", 1e-6)))


def tensors(name: str, cfg: ModelConfig) -> Targets | None:
    """An Ouro tensor -> [(TinyLoop name, transform)]; None for a name Ouro does not have. One to one."""
    return stacked(name, FIXED, NORMS, cfg.tie_embeddings)
