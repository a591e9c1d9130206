"""The dense twin of a looped model: a plain Llama whose layers are prelude + core x loops + coda, carrying the
looped model's weights, for measuring TinyLoop against the runtimes a user would pick instead (docs/kernels.md,
"Peers").

A looped model has a dense twin only when one loop is exactly one more stack of layers: no injection (the core
reads the state alone), the state starting as the prelude's output (state_init "embed") and no sandwich norms.
Then at `loops` loops its logits equal those of the Llama with that layer list (same RoPE, RMSNorm, SwiGLU, tied
head or not), which `tinyloop bench --peers` checks by comparing greedy tokens.

Two targets: Hugging Face transformers' LlamaForCausalLM (`hf_twin`, sharing the looped model's tensors, so it
holds no copy) and a GGUF file for llama.cpp (`write_gguf`, F32 / F16 / Q8_0). Both libraries are optional and
imported only here, inside the functions that need them.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tinyloop.config import ModelConfig
from tinyloop.errors import ConfigError
from tinyloop.model import LoopedLM

# One twin layer's tensors, by role, in the looped model's own orientation ([out, in] for matrices).
ROLES = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def check_twin(cfg: ModelConfig) -> None:
    """ConfigError unless the looped model at any loop count is exactly a plain layer stack."""
    problems = []
    if cfg.injection != "none":
        problems.append(f"injection {cfg.injection!r} (a loop would not be a plain layer; need 'none')")
    if cfg.state_init != "embed":
        problems.append(f"state_init {cfg.state_init!r} (the first loop must read the prelude's output; need 'embed')")
    if cfg.sandwich_norm:
        problems.append("sandwich_norm (a Llama layer has no norms after its branches)")
    if problems:
        raise ConfigError("this looped model has no dense twin: " + "; ".join(problems))


def schedule(cfg: ModelConfig, loops: int) -> list[tuple[str, int]]:
    """The twin's layers in order, each as (part, index) of the looped model's blocks."""
    return ([("prelude", i) for i in range(cfg.n_prelude)]
            + [("core", j) for _ in range(loops) for j in range(cfg.n_core)]
            + [("coda", i) for i in range(cfg.n_coda)])


def twin_layers(net: LoopedLM, loops: int) -> list[dict[str, torch.Tensor]]:
    """The twin's layers as role -> tensor (the looped model's own tensors, not copies)."""
    check_twin(net.cfg)
    layers = []
    for part, i in schedule(net.cfg, loops):
        b = getattr(net, part)[i]
        a, m = b.attn, b.mlp
        layers.append({"attn_norm": b.attn_norm.weight, "wq": a.wq.weight, "wk": a.wk.weight, "wv": a.wv.weight,
                       "wo": a.wo.weight, "mlp_norm": b.mlp_norm.weight, "w_gate": m.w_gate.weight,
                       "w_up": m.w_up.weight, "w_down": m.w_down.weight})
    return layers


def head(net: LoopedLM) -> torch.Tensor:
    return net.embed.weight if net.lm_head is None else net.lm_head.weight


def matrix_numel(net: LoopedLM, loops: int) -> int:
    """Weights one decode step multiplies by: every twin layer's matrices and the head (what streams from
    memory per step; norms and the one embedding row read are negligible and left out)."""
    return sum(layer[r].numel() for layer in twin_layers(net, loops) for r in MATRICES) + head(net).numel()


# ---------------------------------------------------------------------------------------- transformers
_HF_NAMES = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
             "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def hf_state_dict(net: LoopedLM, loops: int) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's state dict for the twin (tensors shared with `net`)."""
    sd = {"model.embed_tokens.weight": net.embed.weight, "model.norm.weight": net.norm.weight,
          "lm_head.weight": head(net)}
    for i, layer in enumerate(twin_layers(net, loops)):
        for role, t in layer.items():
            sd[f"model.layers.{i}.{_HF_NAMES[role]}.weight"] = t
    return sd


def hf_twin(net: LoopedLM, loops: int, attn_implementation: str = "sdpa"):
    """transformers' LlamaForCausalLM for the twin, in fp32 on the model's device, no end-of-sequence token (so
    `generate` runs the tokens it is asked for, like the other runtimes in the bench)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = net.cfg
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
                         num_hidden_layers=len(schedule(cfg, loops)), num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
                         max_position_embeddings=net.max_seq_len, rms_norm_eps=cfg.norm_eps,
                         rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, attention_bias=False,
                         mlp_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=cfg.eos_id,
                         torch_dtype=torch.float32, attn_implementation=attn_implementation)
    with torch.device("meta"):  # no random init of weights that are replaced at once
        twin = LlamaForCausalLM(hf_cfg)
    twin.load_state_dict(hf_state_dict(net, loops), strict=True, assign=True)
    # the rotary table is a non-persistent buffer, still on the meta device: build it for real
    twin.model.rotary_emb = type(twin.model.rotary_emb)(hf_cfg).to(net.embed.weight.device)
    twin.generation_config.eos_token_id = None
    twin.generation_config.pad_token_id = cfg.eos_id
    return twin.eval()


# ---------------------------------------------------------------------------------------- GGUF
GGUF_TYPES = ("F32", "F16", "Q8_0")
_GGUF_NAMES = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
               "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
# bytes per weight as stored (Q8_0: blocks of 32 int8 values and one fp16 scale)
GGUF_BYTES = {"F32": 4.0, "F16": 2.0, "Q8_0": 34 / 32}


def rope_interleave(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection reordered from rotate-half RoPE (TinyLoop, transformers: row i of a head pairs
    with row i + hd/2) to llama.cpp's interleaved RoPE (row 2i pairs with row 2i + 1). Scores q.k are unchanged:
    both q and k get the same per-head permutation."""
    hd = w.shape[0] // heads
    return w.reshape(heads, 2, hd // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_vocab(vocab_size: int) -> tuple[list[str], list[int]]:
    """A SentencePiece-style vocabulary llama.cpp accepts for a model with random weights: unknown, BOS, EOS,
    the 256 byte tokens, then placeholders. Tokens and token types; the bench feeds token ids, never text."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256  # gguf TokenType: UNKNOWN, CONTROL, CONTROL, BYTE...
    if vocab_size < len(tokens):
        raise ConfigError(f"a GGUF twin needs vocab_size >= {len(tokens)}, got {vocab_size}")
    tokens += [f"\u2581t{i}" for i in range(len(tokens), vocab_size)]
    types += [1] * (vocab_size - len(types))  # NORMAL
    return tokens, types


def write_gguf(net: LoopedLM, loops: int, path: str | Path, qtype: str = "F32") -> Path:
    """Write the twin as a GGUF file of llama.cpp's "llama" architecture, matrices in `qtype` (F32, F16 or Q8_0;
    norms stay F32 as llama.cpp wants). BOS and EOS are the looped model's bos_id and eos_id."""
    import gguf
    import numpy as np

    if qtype not in GGUF_TYPES:
        raise ConfigError(f"GGUF type {qtype!r} not one of {GGUF_TYPES}")
    check_twin(net.cfg)
    cfg, path = net.cfg, Path(path)
    layers = twin_layers(net, loops)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(net.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(len(layers))
    w.add_feed_forward_length(cfg.ffn_hidden)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                     "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype])
    tokens, types = gguf_vocab(cfg.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(cfg.bos_id)
    w.add_eos_token_id(cfg.eos_id)
    w.add_add_bos_token(False)

    def matrix(name: str, t: torch.Tensor) -> None:
        a = t.detach().float().cpu().contiguous().numpy()
        if qtype == "F32":
            w.add_tensor(name, a)
        elif qtype == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # bytes; the writer derives the shape

    def norm(name: str, t: torch.Tensor) -> None:
        w.add_tensor(name, t.detach().float().cpu().contiguous().numpy())

    matrix("token_embd.weight", net.embed.weight)
    norm("output_norm.weight", net.norm.weight)
    if net.lm_head is not None:  # tied: llama.cpp multiplies by token_embd when output.weight is absent
        matrix("output.weight", net.lm_head.weight)
    for i, layer in enumerate(layers):
        for role, t in layer.items():
            if role == "wq":
                t = rope_interleave(t, cfg.n_heads)
            elif role == "wk":
                t = rope_interleave(t, cfg.n_kv_heads)
            (norm if role.endswith("norm") else matrix)(f"blk.{i}.{_GGUF_NAMES[role]}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
