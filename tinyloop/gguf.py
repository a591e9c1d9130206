"""GGUF files (llama.cpp's format: what llama.cpp, ollama and LM Studio users hold) as TinyLoop models.

Read with the `gguf` package, memory-mapped:
- the architecture's metadata (`llama.block_count`, ...) is put in config.json's words (`hf_config`) and mapped to a
  ModelConfig by the same family module that reads that architecture's Hugging Face directories (tinyloop/models/);
- tensors by GGUF name (`blk.<i>.attn_q.weight`, ...) are renamed to Hugging Face names (`GGUF_NAMES`) and then
  to TinyLoop's by the family; llama.cpp's converter stores a Llama's q and k rows in interleaved-RoPE order, which is
  undone here per head (the rows of a quantised matrix move with their blocks, which lie along the rows);
- the tokenizer is built from `tokenizer.ggml.*`: a `tokenizers` byte-level BPE with the file's tokens and merges,
  the pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`, its control tokens as special tokens, BOS added when
  `add_bos_token` says so (as llama.cpp does), and the chat template.

Weight formats (docs/gguf.md):
- F32, F16, BF16: as stored (load_model's dtype rule then applies: F16 runs in fp32 on the CPU, bf16 stays bf16).
- Q4_0 -> int4 (group 32) without a detour through fp32: a Q4_0 block is a fp16 scale and 32 4-bit values packed
  exactly as TinyLoop's int4 packs a block (low nibbles values 0..15, high nibbles 16..31, w = (q - 8) * scale),
  so the bytes are copied and the scale widened to fp32. This is the default for a file whose layer matrices are
  all Q4_0.
- Q8_0 and Q4_1 have no TinyLoop layout that holds them exactly: TinyLoop's int8 has one scale per row, Q8_0 one per
  32 values; TinyLoop's int4 is symmetric, Q4_1 adds a minimum per 32 values (w = q * d + m). They are dequantized
  to fp32, which holds every one of their values exactly (the default: the file's own weights, 4 bytes each instead
  of 1.06 / 0.75), or, asked for `weights="int8"` / `"int4"`, quantized again from those values (a second rounding).
- Other quantised types (the K-quants, Q5_0, ...) are dequantized by the `gguf` package to fp32; a type it cannot
  dequantize is an ArtifactError naming it.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch

from . import formats
from .artifact import ArtifactInfo, _expected_shapes
from .config import ModelConfig
from .errors import ArtifactError, ConfigError
from .models import family_of
from .models.family import Raw, interleaved_to_halves
from .tokenizer import TextCodec

# general.architecture -> the config.json model_type whose family reads it
ARCHITECTURES = {"llama": "llama"}
# architectures whose q / k rows llama.cpp's converter permuted to interleaved RoPE pairs (LlamaModel.permute)
INTERLEAVED_QK = {"llama"}
# <arch>.<key> -> config.json's key
ARCH_KEYS = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
             "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
             "attention.head_count_kv": "num_key_value_heads", "rope.freq_base": "rope_theta",
             "attention.layer_norm_rms_epsilon": "rms_norm_eps", "attention.key_length": "head_dim",
             "context_length": "max_position_embeddings", "vocab_size": "vocab_size"}
# GGUF tensor names -> Hugging Face's (a layer's: blk.<i>.<key> -> model.layers.<i>.<value>)
GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
GGUF_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
              "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
Q4_BLOCK = 32  # values per Q4_0 / Q4_1 / Q8_0 block

# tokenizer.ggml.pre -> how llama.cpp splits text before BPE (llama-vocab.cpp): GPT-2's regex, and for the
# StarCoder-style vocabularies (SmolLM's) every digit on its own first.
PRE_TOKENIZERS = {"default": "gpt2", "gpt2": "gpt2", "smollm": "digits", "starcoder": "digits", "refact": "digits",
                  "codeshell": "digits"}
# end-of-turn tokens llama.cpp stops generation at (llama-vocab.cpp's EOT detection by text), for a file whose
# tokenizer.ggml.eos_token_id is another token (SmolLM2's file says <|im_start|>)
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def is_gguf(path) -> bool:
    """A file that starts with GGUF's magic."""
    if path is None or not Path(path).is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # noqa: BLE001 (the gguf package raises ValueError / struct / numpy errors on a bad file)
        raise ArtifactError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def open_gguf(path):
    """The file's GGUFReader (one parse per file: its token lists take seconds to read)."""
    path = str(Path(path).resolve())
    return _reader(path, os.stat(path).st_mtime_ns)


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config(reader, path) -> dict:
    """The file's architecture metadata in config.json's words; ArtifactError for an architecture no family reads."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ArtifactError(f"{path}: GGUF architecture {arch!r} is not one TinyLoop loads (it loads: "
                            f"{', '.join(ARCHITECTURES)})")
    raw = {"model_type": ARCHITECTURES[arch], "architecture": arch}
    for key, name in ARCH_KEYS.items():
        value = field(reader, f"{arch}.{key}")
        if value is not None:
            raw[name] = value
    if isinstance(raw.get("num_key_value_heads"), list):
        raise ArtifactError(f"{path}: {arch}.attention.head_count_kv differs per layer, which TinyLoop does not run")
    raw.setdefault("vocab_size", len(field(reader, "tokenizer.ggml.tokens", [])))
    scaling = field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raw["rope_scaling"] = {"type": scaling}
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raw["rope_scaling"] = {"rope_freqs": "per-dimension RoPE frequency factors (rope_freqs.weight)"}
    raw["tie_word_embeddings"] = "output.weight" not in names
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rotary = field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ArtifactError(f"{path}: {arch}.rope.dimension_count {rotary} rotates part of each head of width "
                            f"{head_dim} (partial rotary), which TinyLoop does not run")
    return raw


def read_gguf_config(path) -> ModelConfig:
    """The ModelConfig of a GGUF file, from its metadata alone (no tensor read)."""
    reader = open_gguf(path)
    raw = hf_config(reader, path)
    family = family_of(raw)
    assert family is not None  # (hf_config took only the architectures a family reads)
    fields = family.config(Raw(path, raw, f"{raw['architecture']} (GGUF)"))
    bos, eos = special_ids(reader, fields["vocab_size"])
    try:
        return ModelConfig(bos_id=bos, eos_id=eos, **fields).validate()
    except (ConfigError, TypeError) as e:
        raise ArtifactError(f"{path}: the GGUF metadata does not make a valid model: {e}") from None


def special_ids(reader, vocab: int) -> tuple[int, int]:
    """BOS, and the token generation stops at: the file's end-of-turn token when it has one (llama.cpp stops at
    every end-of-generation token; TinyLoop has one EOS), else its EOS."""
    tokens = field(reader, "tokenizer.ggml.tokens", [])
    bos = field(reader, "tokenizer.ggml.bos_token_id", 0)
    eos = field(reader, "tokenizer.ggml.eot_token_id")
    if eos is None:
        eot = [i for i, t in enumerate(tokens[:vocab]) if t in END_OF_TURN]
        eos = min(eot, key=lambda i: END_OF_TURN.index(tokens[i])) if eot else field(
            reader, "tokenizer.ggml.eos_token_id", 0)
    return (bos if 0 <= bos < vocab else 0), (eos if 0 <= eos < vocab else 0)


def read_gguf_tokenizer(reader, cfg: ModelConfig, path) -> TextCodec:
    """tokenizer.ggml.* as a `tokenizers` byte-level BPE with the file's special tokens and chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ArtifactError(f"{path}: tokenizer.ggml.model {kind!r} is not supported (TinyLoop reads byte-level BPE "
                            f"vocabularies, 'gpt2'; SentencePiece 'llama' ones are not yet)")
    pre = field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ArtifactError(f"{path}: tokenizer.ggml.pre {pre!r} is not one TinyLoop knows "
                            f"({', '.join(sorted(PRE_TOKENIZERS))})")
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges", [])]
    if not tokens:
        raise ArtifactError(f"{path}: no tokenizer.ggml.tokens")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = byte_level if PRE_TOKENIZERS[pre] == "gpt2" else pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
    tok.decoder = decoders.ByteLevel()
    types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    # control tokens (type 3) are whole, special tokens; user-defined ones (4) whole, ordinary ones
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4])
    bos_text = tokens[cfg.bos_id]
    if field(reader, "tokenizer.ggml.add_bos_token", False):  # llama.cpp puts BOS in front of a text it tokenizes
        tok.post_processor = processors.TemplateProcessing(single=f"{bos_text} $A", special_tokens=[(bos_text, cfg.bos_id)])
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ArtifactError(f"{path}: the tokenizer has {tok.get_vocab_size()} tokens, the model's vocabulary "
                            f"{cfg.vocab_size}")
    return TextCodec(tok, eos_id=cfg.eos_id, chat_template=field(reader, "tokenizer.chat_template"),
                     bos_token=bos_text, eos_token=tokens[cfg.eos_id])


# --- tensors ---------------------------------------------------------------------------------------------------

def hf_name(name: str) -> str | None:
    """A GGUF tensor name in Hugging Face's words; None for one this reader does not know."""
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in GGUF_LAYER:
        return f"model.layers.{parts[1]}.{GGUF_LAYER[parts[2]]}.weight"
    return None


def _bytes(t) -> torch.Tensor:
    """A GGUF tensor's bytes (memory-mapped), copied into a torch uint8 tensor."""
    return torch.from_numpy(np.array(t.data, copy=True).reshape(-1).view(np.uint8))


def _shape(t) -> tuple[int, ...]:
    """[rows, width] of a GGUF tensor (GGUF lists dimensions innermost first)."""
    ne = [int(n) for n in t.shape]
    return tuple(reversed(ne))


def _blocks(t, size: int) -> torch.Tensor:
    """The tensor's blocks, one per row of [rows * blocks per row, size bytes]."""
    return _bytes(t).view(-1, size)


def _half(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row as a fp16 number, widened to fp32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes per block -> its 32 4-bit values: low nibbles are values 0..15, high nibbles 16..31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1).float()


def dequantize(t) -> torch.Tensor:
    """A GGUF tensor as a torch tensor of its values: float types as stored, quantised ones in fp32."""
    kind, shape = t.tensor_type.name, _shape(t)
    if kind in FLOAT_TYPES:
        return _bytes(t).view(FLOAT_TYPES[kind]).view(shape)
    if kind == "Q8_0":  # fp16 d, 32 int8 q: w = q * d
        b = _blocks(t, 34)
        return (b[:, 2:].contiguous().view(torch.int8).float() * _half(b[:, :2])).view(shape)
    if kind == "Q4_0":  # fp16 d, 16 bytes of 4-bit q: w = (q - 8) * d
        b = _blocks(t, 18)
        return ((_nibbles(b[:, 2:]) - 8) * _half(b[:, :2])).view(shape)
    if kind == "Q4_1":  # fp16 d, fp16 m, 16 bytes of 4-bit q: w = q * d + m
        b = _blocks(t, 20)
        return (_nibbles(b[:, 4:]) * _half(b[:, :2]) + _half(b[:, 2:4])).view(shape)
    from gguf.quants import dequantize as gguf_dequantize

    try:
        values = gguf_dequantize(np.asarray(t.data), t.tensor_type)
    except NotImplementedError:
        raise ArtifactError(f"tensor {t.name} has GGUF type {kind}, which TinyLoop cannot read (it reads F32, F16, "
                            f"BF16, Q8_0, Q4_0, Q4_1 and what the gguf package dequantizes)") from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(shape)


def q4_0_matrix(t) -> formats.QMatrix:
    """A Q4_0 matrix as TinyLoop int4 (group 32), its bytes as they are: the two layouts pack a block alike."""
    n, k = _shape(t)
    b = _blocks(t, 18)
    return formats.QMatrix("int4", b[:, 2:].reshape(n, k // 2).contiguous(),
                           _half(b[:, :2]).view(n, k // Q4_BLOCK).contiguous(), Q4_BLOCK, k)


def _interleaved_heads(name: str, cfg: ModelConfig, arch: str) -> int | None:
    """The heads of a q or k matrix whose rows llama.cpp's converter put in interleaved-RoPE order; else None."""
    role = name.split(".")[2] if name.startswith("blk.") else ""
    heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}.get(role)
    return heads if arch in INTERLEAVED_QK else None


def natural_format(path) -> tuple[str, int]:
    """The format a GGUF file loads in by default: int4 (group 32) when every layer matrix is Q4_0 (read as it is),
    else fp32 (its values exactly)."""
    mats = [t for t in open_gguf(path).tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    return ("int4", Q4_BLOCK) if mats and all(t.tensor_type.name == "Q4_0" for t in mats) else ("fp32", 0)


def stored_dtype(path) -> torch.dtype:
    """The dtype load_model runs a GGUF file in on the CPU by default: bf16 for a BF16 embedding, else fp32."""
    embed = next((t for t in open_gguf(path).tensors if t.name == "token_embd.weight"), None)
    return torch.bfloat16 if embed is not None and embed.tensor_type.name == "BF16" else torch.float32


def _fused(mats: dict[str, formats.QMatrix], cfg: ModelConfig) -> dict[str, formats.QMatrix]:
    """The layer matrices by model.matrices' names (core.<i>.wqkv = rows of q, k, v; wgu = gate, up), as
    quantize_weights takes stored matrices."""
    def rows(*names: str) -> formats.QMatrix:
        parts = [mats[n] for n in names]
        scales = []
        for p in parts:
            assert p.scale is not None  # (every int4 matrix has one)
            scales.append(p.scale)
        return formats.QMatrix("int4", torch.cat([p.data for p in parts]), torch.cat(scales),
                               Q4_BLOCK, parts[0].width)

    out = {}
    for part, n in (("prelude", cfg.n_prelude), ("core", cfg.n_core), ("coda", cfg.n_coda)):
        for i in range(n):
            p = f"{part}.{i}."
            out[p + "wqkv"] = rows(p + "attn.wq.weight", p + "attn.wk.weight", p + "attn.wv.weight")
            out[p + "wo"] = mats[p + "attn.wo.weight"]
            out[p + "wgu"] = rows(p + "mlp.w_gate.weight", p + "mlp.w_up.weight")
            out[p + "w_down"] = mats[p + "mlp.w_down.weight"]
    out["head"] = mats["lm_head.weight"]
    return out


def load_gguf(path, fmt: str = "fp32", group: int = 0) -> tuple[ArtifactInfo, dict[str, torch.Tensor]]:
    """(ArtifactInfo, tensors) of a GGUF file, as read_artifact gives for a .tinyloop file. fmt "int4" at group 32:
    Q4_0 matrices are kept as they are (info.matrices; others quantised from their values); any other format: every
    tensor's values (load_model quantises them to fmt)."""
    reader = open_gguf(path)
    cfg = read_gguf_config(path)
    codec = read_gguf_tokenizer(reader, cfg, path)
    raw = hf_config(reader, path)
    family = family_of(raw)
    assert family is not None  # (read_gguf_config found it)
    expected = _expected_shapes(cfg)
    direct = fmt == "int4" and group == Q4_BLOCK
    tensors: dict[str, torch.Tensor] = {}
    mats: dict[str, formats.QMatrix] = {}
    for t in sorted(reader.tensors, key=lambda t: t.name != "token_embd.weight"):  # the embedding first (its dtype)
        name = hf_name(t.name)
        targets = None if name is None else family.tensors(name, cfg)
        if targets is None:
            raise ArtifactError(f"{path}: unexpected tensor {t.name!r} for a {raw['architecture']} model")
        if t.name == "token_embd.weight" and cfg.tie_embeddings and direct:  # the tied head: an int4 matrix too
            targets = targets + [("lm_head.weight", None)]
        heads = _interleaved_heads(t.name, cfg, raw["architecture"])
        for ours, fn in targets:
            want = expected.get(ours, expected["embed.weight"] if ours == "lm_head.weight" else None)
            if tuple(_shape(t)) != want:
                raise ArtifactError(f"{path}: tensor {t.name} has shape {_shape(t)}, the metadata implies {want}")
            if direct and ours != "embed.weight" and len(want) == 2:  # a matrix, held as int4
                m = q4_0_matrix(t) if t.tensor_type.name == "Q4_0" else formats.quantize(dequantize(t), "int4", group)
                assert isinstance(m, formats.QMatrix) and m.scale is not None  # (int4)
                if heads:
                    m = formats.QMatrix("int4", interleaved_to_halves(m.data, heads),
                                        interleaved_to_halves(m.scale, heads), m.group, m.width)
                mats[ours] = m
            else:
                w = fn(dequantize(t))
                tensors[ours] = interleaved_to_halves(w, heads) if heads else w
    held = set(tensors) | set(mats)
    missing = sorted((set(expected) | ({"lm_head.weight"} if direct else set())) - held)
    if missing:
        raise ArtifactError(f"{path}: tensors missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    prov = {"source": "gguf", "architecture": raw["architecture"], "family": family.NAME,
            "path": str(Path(path).resolve()), "name": field(reader, "general.name") or Path(path).stem,
            "file_type": field(reader, "general.file_type")}
    info = ArtifactInfo(str(path), cfg, codec, None, {}, prov, fmt if direct else "fp32", group if direct else 0)
    if direct:
        info.matrices = _fused(mats, cfg)
    return info, tensors
