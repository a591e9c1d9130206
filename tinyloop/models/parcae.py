"""Parcae (SandyResearch/parcae-140m .. -1.3b; a directory saved by parcae_lm / receval: config.json, the ParcaeConfig
fields with `model_class_name` "Parcae", and a torch pickle pytorch_model.bin or model.pt, or model.safetensors).

Reference: the `parcae_lm` package of github.com/sandyresearch/parcae (MIT), with receval's ModelingParcae for
loading and cached generation. How it maps onto the looped core:
- blocks: plain pre-norm blocks (TransformerPreNormBlock: RMSNorm, attention, RMSNorm, MLP); the MLP is BaseMLP
  with ReLU^2 (w_down(relu(w_up h)^2 / 2), mlp "relu2") or GatedMLP with SiLU (SwiGLU); q and k RMS-normalised per
  head after RoPE (qk_norm); interleaved RoPE pairs, converted to TinyLoop's half-split layout by permuting the q
  and k rows (family.interleaved_to_halves); value embeddings (value_embeds): on alternating layers, the last one
  included, V gains a per-token table row gated per KV head by 2 sigmoid(W h[:32]). A layer has one only where
  the reference builds both its table (alternating over prelude + core + coda layers) and its gate (alternating
  over the attention's own layer ids, which count the core once per mean recurrence), as its forward requires.
- loop: the prelude's output is normalised (prelude_norm); the state starts random, "like-init" (a truncated normal
  at the init table's embedding std times the embedding scale, cut at 3 std: state_init "normal", init_trunc 3;
  `init_scale` scales it), and each loop reads x = s * exp(-dt A) + dt * B e per channel with dt = softplus(dt_bias)
  and A = exp(A_log) (injection "diagonal"; "linear" is the adapter W [s ; e], "add" s + e); after the last loop a
  d x d map C (readout) before the coda; logits times the init table's logit scale, soft-capped when configured.
- exit rule: the reference has none (it runs mean_recurrence loops); TinyLoop's latent-change rule is available.
- KV across loops: one slot per (loop, layer), the reference's "full" cache lookup; a token that exits early copies
  its last loop's K/V into the loops it skipped ("copy").
"""
from __future__ import annotations

import math

from ..config import ModelConfig
from .family import MAX_LOOPS_FACTOR, Raw, Targets, interleaved_to_halves, renamed, same

NAME = "parcae"
KIND = "parcae"
ABOUT = {"checkpoints": "SandyResearch/parcae-140m, -370m, -770m, -1.3b", "licence": "MIT",
         "reference": "`parcae_lm` + `receval` (sandyresearch/parcae)", "loops": "`mean_recurrence` (8)",
         "exit": "none in the reference (TinyLoop's latent change)",
         "kv": "one slot per (loop, layer); skipped loops copy the last"}
# Its tokenizer (scripts/tok_train.py) names these specials; a directory without tokenizer_config.json means them.
SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
# It trains on <|bos|> text <|eos|> and evaluates prompts with <|bos|> in front; its tokenizer.json adds nothing.
PREPEND_BOS = True

PREFIXES = ("module.", "_orig_mod.", "model.")  # what receval's loader strips from saved names
FIXED = {"transformer.wte.weight": "embed.weight", "transformer.ln_f.weight": "norm.weight",
         "transformer.ln_prelude.weight": "prelude_norm.weight", "transformer.C.weight": "readout.weight",
         "transformer.adapter.A_log": "decay.a_log", "transformer.adapter.dt_bias": "decay.dt_bias",
         "transformer.adapter.B": "adapter.weight", "transformer.adapter.adapter.weight": "adapter.weight",
         "lm_head.weight": "lm_head.weight"}
GROUPS = {"prelude": "prelude", "core_block": "core", "coda": "coda"}
INJECTIONS = {"diagonal": "diagonal", "linear": "adapter", "add": "add"}
MLPS = {("BaseMLP", "ReLU2"): "relu2", ("GatedMLP", "SiLU"): "swiglu"}
HEADS = ("pytorch", "cce", "full-triton")  # the lm_head layouts whose weight is one [vocab, d] matrix


def claims(raw: dict) -> bool:
    return raw.get("model_class_name") == "Parcae" or raw.get("_class_name") == "ParcaeConfig"


def init_scales(strategy: str, d: int) -> tuple[float, float, float] | None:
    """(embedding std, embedding scale, logit scale) of an init strategy of parcae_lm/utils/init.py: what inference
    reads of it (the like-init state's std; the scales on the embedding and the logits). None: not one of these."""
    small = math.sqrt(2 / (5 * d))
    return {"scaled": (small, 1.0, 1.0), "scaled-zero": (small, 1.0, 1.0), "scaled-geiping": (small, 1.0, 1.0),
            "scaled-stuck": (small, 1.0, 1.0), "small": (small, 1.0, 1.0), "takase": (small, math.sqrt(d), 1.0),
            "takase-scaled": (small, math.sqrt(d), math.sqrt(2 / 5) / math.sqrt(d)),
            "mitchell": (1 / math.sqrt(d), 1.0, 1.0), "normal": (1 / math.sqrt(d), 1.0, 1.0),
            "llama-by-dim-ls": (1.0, 1.0, 1 / math.sqrt(d)),
            "scaled-and-logit-scale": (1.0, 1.0, 1 / math.sqrt(d))}.get(strategy)


def value_embed_layers(P: int, R: int, C: int, mean_recurrence: int, backprop_depth: int) -> tuple[int, ...]:
    """The layers (prelude, core, coda numbered in order) whose V gains a value embedding: where the reference has
    both a table (alternating over the P + R + C layers, the last included) and a gate (alternating over the
    attention layer ids: prelude i, core P + j, coda P + R * mean_recurrence + i, against R * backprop_depth)."""
    def alternate(i: int, n: int) -> bool:
        return i % 2 == (n - 1) % 2
    ids = [*range(P + R), *(P + R * mean_recurrence + i for i in range(C))]
    return tuple(i for i, lid in enumerate(ids) if alternate(i, P + R + C) and alternate(lid, R * backprop_depth))


def config(c: Raw) -> dict:
    """ModelConfig fields of a Parcae config.json (ParcaeConfig's fields; missing ones take its defaults)."""
    d, H = c.get("n_embd", 4096), c.get("num_attention_heads", 32)
    ffn = c.get("intermediate_size", 4 * d)
    P, R, C = c.get("n_layers_in_prelude", 1), c.get("n_layers_in_recurrent_block", 4), c.get("n_layers_in_coda", 1)
    steps = c.get("mean_recurrence", 32)
    c.need(c.get("num_key_value_heads", H) == H, "grouped-query heads (its recurrent block always has full heads)")
    c.need(c.get("recurrent_embedding_dimension", 1024) == d and c.get("recurrent_num_attention_heads", H) == H
           and c.get("recurrent_intermediation_embedding_dimension", 3520) == ffn,
           "a recurrent block of another width, head count or MLP size than the prelude and coda")
    c.need(c.get("mup_model_scaling_factor", 1) == 1, "mup_model_scaling_factor != 1")
    c.need(c.get("block_class_name", "TransformerPreNormBlock") == "TransformerPreNormBlock",
           f"block {c.data.get('block_class_name')!r}")
    c.need(c.get("norm_class_name", "LayerNorm") == "RMSNorm", f"norm {c.data.get('norm_class_name')!r}")
    mlp = MLPS.get((c.get("mlp_class_name", "BaseMLP"), c.get("nonlin_name", "GELU")))
    c.need(mlp is not None, f"mlp {c.data.get('mlp_class_name')!r} with {c.data.get('nonlin_name')!r}")
    c.need(not c.get("bias", False), "bias=true (biased linear layers)")
    c.need(c.data.get("clip_qkv") is None, "clip_qkv")
    c.need(not c.get("use_abacus", False), "use_abacus")
    c.need(c.get("use_fused_head", "pytorch") in HEADS, f"use_fused_head {c.data.get('use_fused_head')!r}")
    injection = INJECTIONS.get(c.get("injection_type", "diagonal"))
    c.need(injection is not None, f"injection_type {c.data.get('injection_type')!r}")
    rope = c.get("rope_settings", {})
    c.need(rope.get("use_rope", True) and rope.get("rope_condense_ratio", 1) == 1, f"rope_settings {rope}")
    scales = init_scales(c.get("init_strategy", "scaled"), d)
    c.need(scales is not None, f"init_strategy {c.data.get('init_strategy')!r}")
    assert scales is not None  # (need raised otherwise)
    std, embed_scale, logit_scale = scales
    return dict(vocab_size=int(c.get("padded_vocab_size", None) or _padded(c)), d_model=d, n_heads=H, n_kv_heads=H,
                ffn_hidden=ffn, n_prelude=P, n_core=R, n_coda=C, default_loops=steps,
                max_loops=MAX_LOOPS_FACTOR * steps, injection=injection, **_state(c, std * embed_scale, d),
                embed_scale=embed_scale, qk_bias=bool(c.get("qk_bias", False)), qk_norm=bool(c.get("qk_norm", False)),
                mlp=mlp, prelude_norm=bool(c.get("prelude_norm", False)), readout=True,
                value_embeds=value_embed_layers(P, R, C, steps, c.get("mean_backprop_depth", 8)),
                logit_scale=logit_scale, logit_softcap=float(c.data.get("logit_softcap") or 0.0),
                tie_embeddings=bool(c.get("tie_embeddings", False)),
                rope_theta=float(rope.get("rope_base", 50_000)), norm_eps=float(c.get("norm_eps", 1e-5)))


def _padded(c: Raw) -> int:
    """The embedding's rows when config.json does not say: vocab_size rounded up to padding_multiple."""
    vocab, multiple = c.get("vocab_size", 50254), c.get("padding_multiple", 512)
    return -(-vocab // multiple) * multiple


def _state(c: Raw, like_init_sigma: float, d: int) -> dict:
    """The initial state's fields. like-init: truncated normal at 3 std; embed: normal / sqrt(d); zero."""
    kind = c.get("state_init", "like-init")
    states: dict[str, dict] = {"like-init": dict(state_init="normal", init_sigma=like_init_sigma, init_trunc=3.0),
              "normal": dict(state_init="normal", init_sigma=1.0),
              "embed": dict(state_init="normal", init_sigma=1 / math.sqrt(d)),
              "zero": dict(state_init="zeros")}
    c.need(kind in states, f"state_init {kind!r}")
    return states[kind]


def tensors(name: str, cfg: ModelConfig) -> Targets | None:
    """A Parcae tensor -> [(TinyLoop name, transform)]; [] for one its forward never reads (a value-embedding table
    or gate without its other half); None for a name Parcae does not have."""
    for prefix in PREFIXES:
        name = name.removeprefix(prefix)
    fixed = renamed(name, FIXED, cfg.tie_embeddings)
    if fixed is not None:
        return fixed
    parts = name.split(".")
    if parts[0] == "value_embeds" and len(parts) == 3:
        layer = int(parts[1])
        return [(f"{_block(cfg, layer)}.value_embed.weight", same)] if layer in cfg.value_embeds else []
    group = GROUPS.get(parts[1]) if parts[0] == "transformer" and len(parts) > 3 else None
    if group is None:
        return None
    base, rest, H, hd = f"{group}.{parts[2]}", ".".join(parts[3:]), cfg.n_heads, cfg.head_dim
    layer = int(parts[2]) + {"prelude": 0, "core": cfg.n_prelude, "coda": cfg.n_prelude + cfg.n_core}[group]
    simple = {"norm_1.weight": "attn_norm.weight", "norm_2.weight": "mlp_norm.weight", "attn.c_v.weight": "attn.wv.weight",
              "attn.c_proj.weight": "attn.wo.weight", "mlp.proj.weight": "mlp.w_down.weight"}
    if rest in simple:
        return [(f"{base}.{simple[rest]}", same)]
    if rest in ("attn.c_q.weight", "attn.c_k.weight"):  # permuted for the half-split RoPE
        return [(f"{base}.attn.w{rest[7]}.weight", lambda t: interleaved_to_halves(t, H))]
    if rest == "attn.qk_bias":  # [2, 1, H, hd]: added to q and k before RoPE, i.e. the projections' biases
        return [(f"{base}.attn.wq.bias", lambda t: interleaved_to_halves(t[0].reshape(H * hd), H)),
                (f"{base}.attn.wk.bias", lambda t: interleaved_to_halves(t[1].reshape(H * hd), H))]
    if rest == "attn.ve_gate.weight":
        return [(f"{base}.ve_gate.weight", same)] if layer in cfg.value_embeds else []
    if rest == "mlp.fc.weight":  # BaseMLP: the up projection; GatedMLP: gate rows, then up rows
        if cfg.mlp == "relu2":
            return [(f"{base}.mlp.w_up.weight", same)]
        return [(f"{base}.mlp.w_gate.weight", lambda t: t[:cfg.ffn_hidden]),
                (f"{base}.mlp.w_up.weight", lambda t: t[cfg.ffn_hidden:])]
    return None


def _block(cfg: ModelConfig, layer: int) -> str:
    """TinyLoop's name of a block by its layer number (prelude, core, coda in order)."""
    P, R = cfg.n_prelude, cfg.n_core
    return f"prelude.{layer}" if layer < P else f"core.{layer - P}" if layer < P + R else f"coda.{layer - P - R}"
