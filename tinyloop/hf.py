"""Hugging Face model directories of looped models (Ouro, Huginn-0125) as configurations of the TinyLoop family.

A directory holds config.json, safetensors weights (one file, or shards listed by model.safetensors.index.json),
tokenizer.json and tokenizer_config.json (special tokens, chat template). `read_hf_config` maps config.json to a
ModelConfig: every architectural difference is a field (docs/hf.md lists them). `iter_weights` streams the tensors
shard by shard, renamed and reshaped to TinyLoop's layout, checking names, shapes and dtypes on the way;
`load_hf` gathers them for load_model and `convert` writes a .tinyloop artifact without ever holding more than
one shard beside what it has written.

How the architectures map (the reference code is the Hugging Face remote code of each; tests/data/hf holds tiny
checkpoints made with it and its recorded outputs):
- Ouro (`model_type` "ouro"): the whole stack is the looped core (no prelude or coda), the state starts as the
  embedding and feeds the next loop unchanged (injection "none"), every loop ends with the final norm (loop_norm),
  sandwich norms on each branch output, an exit gate read by the cumulative exit distribution (exit_rule "cdf").
- Huginn (`model_type` "huginn_raven"): prelude / recurrent block / coda, embeddings scaled by sqrt(d), adapter
  injection W [s ; e], a random state (truncated normal, scale settable), sandwich norms on the residual sum, q/k
  biases, the final norm used before the coda too, and its interleaved ("complex-like") RoPE. The RoPE layout is
  converted, not branched on: query and key rows are permuted within each head so that TinyLoop's half-split
  rotation computes the same rotation (attention scores are invariant under one permutation of q and k).
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from .artifact import FORMAT, FORMAT_VERSION, ArtifactInfo, _expected_shapes, read_config
from .config import ModelConfig
from .errors import ArtifactError, ConfigError
from .tokenizer import TextCodec

SUPPORTED = ("ouro", "huginn_raven")
# Extra loop counts a converted model accepts beyond the checkpoint's default (both references run any count).
MAX_LOOPS_FACTOR = 2
# Huginn's initial state: std sqrt(2 / (5 d)) times the embedding scale sqrt(d), truncated at 3 std, times init_scale.
HUGINN_INIT_STD = math.sqrt(2 / 5)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
IGNORED = ("freqs_cis", "rotary_emb.inv_freq")  # position tables some checkpoints save; TinyLoop builds its own


def is_hf_dir(path) -> bool:
    return path is not None and Path(path).is_dir() and (Path(path) / "config.json").is_file()


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read {what} ({e.strerror})") from None
    except ValueError as e:
        raise ArtifactError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: {what} must be a JSON object")
    return data


def read_raw(path) -> dict:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ArtifactError(f"{path}: no config.json; expected a Hugging Face model directory")
    return _read_json(path / "config.json", "config.json")


def checkpoint_dtype(raw: dict) -> torch.dtype | None:
    """The dtype config.json declares for the weights (transformers writes `torch_dtype`, newer ones `dtype`)."""
    name = raw.get("dtype") or raw.get("torch_dtype")
    return DTYPES.get(name) if isinstance(name, str) else None


def read_hf_config(path) -> ModelConfig:
    """config.json -> ModelConfig. ArtifactError names an unsupported model_type or an option TinyLoop lacks.
    Huginn's random initial state gets the reference's default scale (init_scale 1.0; load_model changes it)."""
    raw = read_raw(path)
    kind = raw.get("model_type")
    if kind not in SUPPORTED:
        raise ArtifactError(f"{path}: config.json has model_type {kind!r}; TinyLoop loads {', '.join(SUPPORTED)}")

    def get(key, default=None, *alts):
        for k in (key, *alts):
            if k in raw and raw[k] is not None:
                return raw[k]
        if default is None:
            raise ArtifactError(f"{path}: config.json lacks {key!r}, which a {kind} model needs")
        return default

    def unsupported(ok: bool, what: str) -> None:
        if not ok:
            raise ArtifactError(f"{path}: {what} is not supported by TinyLoop (model_type {kind})")

    if kind == "ouro":
        d, heads = get("hidden_size"), get("num_attention_heads")
        unsupported(get("hidden_act", "silu") == "silu", f"hidden_act {raw.get('hidden_act')!r}")
        unsupported(not raw.get("rope_scaling"), f"rope_scaling {raw.get('rope_scaling')!r}")
        unsupported(not raw.get("use_sliding_window"), "use_sliding_window")
        unsupported(get("head_dim", d // heads) == d // heads, f"head_dim {raw.get('head_dim')} != hidden_size / heads")
        steps = get("total_ut_steps", 4)
        fields = dict(d_model=d, n_heads=heads, n_kv_heads=get("num_key_value_heads", heads),
                      ffn_hidden=get("intermediate_size"), n_prelude=0, n_core=get("num_hidden_layers"), n_coda=0,
                      default_loops=steps, max_loops=MAX_LOOPS_FACTOR * steps, injection="none", state_init="embed",
                      sandwich_norm=True, loop_norm=True, final_norm=False, exit_gate=True, exit_rule="cdf",
                      exit_kv="compute", tie_embeddings=bool(get("tie_word_embeddings", False)),
                      rope_theta=float(get("rope_theta", 10000.0)), norm_eps=float(get("rms_norm_eps", 1e-6)))
    else:
        d = get("n_embd")
        heads = get("n_heads", None, "num_attention_heads")
        unsupported(get("injection_type", "linear") == "linear", f"injection_type {raw.get('injection_type')!r}")
        unsupported(get("state_init", "like-init") == "like-init", f"state_init {raw.get('state_init')!r}")
        unsupported(not get("bias", False), "bias=true (biased linear layers)")
        unsupported(get("block_class_name", "SandwichBlock") == "SandwichBlock", f"block {raw.get('block_class_name')!r}")
        unsupported(get("mlp_class_name", "GatedMLP") == "GatedMLP", f"mlp {raw.get('mlp_class_name')!r}")
        unsupported(not raw.get("test_time_noise"), "test_time_noise")
        steps = get("mean_recurrence", 32)
        fields = dict(d_model=d, n_heads=heads, n_kv_heads=heads, ffn_hidden=get("intermediate_size"),
                      n_prelude=get("n_layers_in_prelude", 2), n_core=get("n_layers_in_recurrent_block", 4),
                      n_coda=get("n_layers_in_coda", 2), default_loops=steps, max_loops=MAX_LOOPS_FACTOR * steps,
                      injection="adapter", state_init="normal", init_sigma=HUGINN_INIT_STD,
                      init_trunc=3.0, embed_scale=math.sqrt(d), qk_bias=bool(get("qk_bias", False)),
                      sandwich_norm=True, sandwich_residual=True, coda_norm=True,
                      tie_embeddings=bool(get("tie_embeddings", True, "tie_word_embeddings")),
                      rope_theta=float(get("rope_base", 50000.0)), norm_eps=float(get("norm_eps", 1e-6)))
    vocab = int(get("vocab_size") if kind == "ouro" else get("padded_vocab_size", None, "vocab_size"))
    bos, eos = _special_ids(Path(path), raw, vocab)
    try:
        return ModelConfig(vocab_size=vocab, bos_id=bos, eos_id=eos, **fields).validate()
    except (ConfigError, TypeError) as e:
        raise ArtifactError(f"{path}: config.json does not make a valid model: {e}") from None


def _special_ids(path: Path, raw: dict, vocab: int) -> tuple[int, int]:
    """BOS and EOS: the tokenizer's declared tokens (tokenizer_config.json) when it has them — for a chat model that
    is the end-of-turn token generation must stop at —, else generation_config.json, else config.json."""
    gen = _read_json(path / "generation_config.json", "generation_config.json") \
        if (path / "generation_config.json").is_file() else {}
    tok_cfg = _read_json(path / "tokenizer_config.json", "tokenizer_config.json") \
        if (path / "tokenizer_config.json").is_file() else {}
    vocab_ids = {}
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        try:
            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
            vocab_ids = {name: tok.token_to_id(_token_text(tok_cfg.get(name))) for name in ("bos_token", "eos_token")}
        except Exception:  # a broken tokenizer is reported by read_hf_tokenizer with its own message
            pass

    def pick(name: str, key: str) -> int:
        for v in (vocab_ids.get(name), gen.get(key), raw.get(key)):
            if isinstance(v, list):
                v = v[0] if v else None
            if isinstance(v, int) and 0 <= v < vocab:
                return v
        return 0

    return pick("bos_token", "bos_token_id"), pick("eos_token", "eos_token_id")


def _token_text(value) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken dict {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def read_hf_tokenizer(path, cfg: ModelConfig) -> TextCodec:
    """tokenizer.json through the `tokenizers` library, with the checkpoint's chat template and special tokens."""
    path = Path(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        raise ArtifactError(f"{path}: no tokenizer.json (TinyLoop reads the fast-tokenizer file that "
                            f"`transformers` saves; tokenizer.model / vocab files alone are not supported)")
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ArtifactError(f"{file}: not a readable tokenizers file ({e})") from None
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ArtifactError(f"{file}: tokenizer has {tok.get_vocab_size()} tokens but config.json's vocabulary is "
                            f"{cfg.vocab_size}")
    tok_cfg = _read_json(path / "tokenizer_config.json", "tokenizer_config.json") \
        if (path / "tokenizer_config.json").is_file() else {}
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if (path / "chat_template.jinja").is_file():  # newer transformers save the template beside the config
        template = (path / "chat_template.jinja").read_text()
    return TextCodec(tok, eos_id=cfg.eos_id, chat_template=template if isinstance(template, str) else None,
                     bos_token=_token_text(tok_cfg.get("bos_token")) or "",
                     eos_token=_token_text(tok_cfg.get("eos_token")) or "")


# --- weights --------------------------------------------------------------------------------------------------

def _shards(path: Path) -> dict[str, list[str] | None]:
    """Shard file -> the tensor names the index assigns to it (None: whatever the file holds)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, "model.safetensors.index.json").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ArtifactError(f"{index}: no weight_map")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        missing = sorted(f for f in files if not (path / f).is_file())
        if missing:
            raise ArtifactError(f"{path}: missing shard(s) {missing} listed in model.safetensors.index.json")
        return dict(sorted(files.items()))
    files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {bins}: PyTorch pickles are not loaded; re-save with safe_serialization=True)" if bins else ""
        raise ArtifactError(f"{path}: no *.safetensors weights{hint}")
    return {f: None for f in files}


def _permute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection (or its bias), per head, from interleaved pairs (0,1),(2,3).. to halves."""
    hd = w.shape[0] // heads
    perm = torch.cat((torch.arange(0, hd, 2), torch.arange(1, hd, 2)))
    return w.reshape(heads, hd, *w.shape[1:])[:, perm].reshape(w.shape)


def _ouro_names(name: str, cfg: ModelConfig) -> list[tuple[str, Callable]] | None:
    """Ouro tensor -> [(TinyLoop name, transform)]; None for a name Ouro does not have."""
    same = lambda t: t  # noqa: E731
    fixed = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
             "model.early_exit_gate.weight": "exit_gate.weight", "model.early_exit_gate.bias": "exit_gate.bias",
             "lm_head.weight": "lm_head.weight"}
    if name in fixed:
        return [] if name == "lm_head.weight" and cfg.tie_embeddings else [(fixed[name], same)]
    parts = name.split(".")
    if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[-1] == "weight":
        sub = {"self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv",
               "self_attn.o_proj": "attn.wo", "mlp.gate_proj": "mlp.w_gate", "mlp.up_proj": "mlp.w_up",
               "mlp.down_proj": "mlp.w_down"}.get(".".join(parts[3:5]))
        if sub:
            return [(f"core.{parts[2]}.{sub}.weight", same)]
    if len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[-1] == "weight":
        sub = {"input_layernorm": "attn_norm", "input_layernorm_2": "attn_out_norm",
               "post_attention_layernorm": "mlp_norm", "post_attention_layernorm_2": "mlp_out_norm"}.get(parts[3])
        if sub:
            return [(f"core.{parts[2]}.{sub}.weight", same)]
    return None


def _huginn_names(name: str, cfg: ModelConfig) -> list[tuple[str, Callable]] | None:
    same = lambda t: t  # noqa: E731
    fixed = {"transformer.wte.weight": "embed.weight", "transformer.adapter.weight": "adapter.weight",
             "transformer.ln_f.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
    if name in fixed:
        return [] if name == "lm_head.weight" and cfg.tie_embeddings else [(fixed[name], same)]
    parts = name.split(".")
    group = {"prelude": "prelude", "core_block": "core", "coda": "coda"}.get(parts[1]) if len(parts) > 3 else None
    if parts[0] != "transformer" or group is None:
        return None
    base, rest = f"{group}.{parts[2]}", ".".join(parts[3:])
    H, hd, I = cfg.n_heads, cfg.head_dim, cfg.ffn_hidden
    norms = {"norm_1.weight": "attn_norm", "norm_2.weight": "attn_out_norm", "norm_3.weight": "mlp_norm",
             "norm_4.weight": "mlp_out_norm"}
    if rest in norms:
        return [(f"{base}.{norms[rest]}.weight", same)]
    if rest == "attn.Wqkv.weight":  # rows: q (H*hd), k, v; q and k permuted for the half-split RoPE
        d, kv = cfg.d_model, cfg.kv_dim
        return [(f"{base}.attn.wq.weight", lambda t: _permute_rope(t[:d], H)),
                (f"{base}.attn.wk.weight", lambda t: _permute_rope(t[d:d + kv], cfg.n_kv_heads)),
                (f"{base}.attn.wv.weight", lambda t: t[d + kv:])]
    if rest == "attn.qk_bias":  # [2, 1, H, hd]: added to q and k before RoPE, i.e. the projections' biases
        return [(f"{base}.attn.wq.bias", lambda t: _permute_rope(t[0].reshape(H * hd), H)),
                (f"{base}.attn.wk.bias", lambda t: _permute_rope(t[1].reshape(H * hd), H))]
    if rest == "attn.proj.weight":
        return [(f"{base}.attn.wo.weight", same)]
    if rest == "mlp.fc.weight":  # one fused matrix: the first half gates (SiLU), the second is the up projection
        return [(f"{base}.mlp.w_gate.weight", lambda t: t[:I]), (f"{base}.mlp.w_up.weight", lambda t: t[I:])]
    if rest == "mlp.proj.weight":
        return [(f"{base}.mlp.w_down.weight", same)]
    return None


def iter_weights(path, cfg: ModelConfig, dtype: torch.dtype | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(TinyLoop name, tensor) for every weight, shard by shard, in `dtype` (None: as stored). Checks that every
    tensor is known, has the shape config.json implies and the dtype it declares, and that none is missing."""
    path = Path(path)
    raw = read_raw(path)
    names = _ouro_names if raw.get("model_type") == "ouro" else _huginn_names
    declared = checkpoint_dtype(raw)
    expected = _expected_shapes(cfg)
    seen: set[str] = set()
    for file, listed in _shards(path).items():
        try:
            handle = safe_open(str(path / file), framework="pt")
        except Exception as e:  # safetensors raises its own error types for malformed files
            raise ArtifactError(f"{path / file}: not a readable safetensors file ({e})") from None
        with handle as f:
            keys = set(f.keys())
            absent = sorted(set(listed or ()) - keys)
            if absent:
                raise ArtifactError(f"{path / file}: tensor(s) {absent[:5]} listed in the index are not in this shard")
            for key in sorted(keys):
                if key.endswith(IGNORED):
                    continue
                targets = names(key, cfg)
                if targets is None:
                    raise ArtifactError(f"{path / file}: unexpected tensor {key!r} for a {raw['model_type']} model")
                if not targets:  # a tied head saved beside the embedding: not read
                    continue
                t = f.get_tensor(key)
                if not t.is_floating_point() or (declared is not None and t.dtype != declared):
                    want = declared if t.is_floating_point() else "a float type"
                    raise ArtifactError(f"{path / file}: tensor {key} has dtype {t.dtype}, config.json declares {want}")
                for ours, fn in targets:
                    out = fn(t)
                    if ours not in expected or tuple(out.shape) != expected[ours]:
                        raise ArtifactError(f"{path / file}: tensor {key} gives {ours} of shape {tuple(out.shape)}, "
                                            f"config.json implies {expected.get(ours)}")
                    seen.add(ours)
                    yield ours, out.to(dtype or t.dtype).contiguous()
    missing = sorted(set(expected) - seen)
    if missing:
        raise ArtifactError(f"{path}: weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                            f"(a shard or tensor of the checkpoint is absent)")


def load_hf(path, dtype: torch.dtype | None = None):
    """(ArtifactInfo, tensors) of a Hugging Face directory, as read_artifact gives for a .tinyloop file."""
    cfg = read_hf_config(path)
    codec = read_hf_tokenizer(path, cfg)
    tensors = dict(iter_weights(path, cfg, dtype))
    return ArtifactInfo(str(path), cfg, codec, None, {}, provenance(path)), tensors


def config_and_dtype(path) -> tuple[ModelConfig, torch.dtype, tuple[str, int]]:
    """A model's config, the dtype load_model gives its weights on CPU (bf16 stays bf16, others fp32) and the
    format and group its matrices are stored in, from config.json or the artifact's header: what a memory plan
    needs before anything large is read."""
    if is_hf_dir(path):
        return read_hf_config(path), checkpoint_dtype(read_raw(path)) or torch.float32, ("fp32", 0)
    cfg = read_config(path)
    with safe_open(str(path), framework="pt") as f:
        first = next(iter(f.keys()), None)
        stored = f.get_slice(first).get_dtype() if first else ""
        weights = json.loads((f.metadata() or {}).get("weights") or '{"format": "fp32", "group": 0}')
    return cfg, torch.bfloat16 if stored == "BF16" else torch.float32, (weights["format"], int(weights["group"]))


def provenance(path) -> dict:
    raw = read_raw(path)
    return {"source": "huggingface", "model_type": raw.get("model_type"), "path": str(Path(path).resolve()),
            "name": raw.get("_name_or_path") or Path(path).name}


def with_init_scale(cfg: ModelConfig, init_scale: float) -> ModelConfig:
    """The config with its random initial state's sigma multiplied by init_scale (Huginn's knob; 0: zero state)."""
    if not isinstance(init_scale, (int, float)) or isinstance(init_scale, bool) or init_scale < 0:
        raise ConfigError(f"init_scale must be a number >= 0, got {init_scale!r}")
    return replace(cfg, init_sigma=cfg.init_sigma * float(init_scale)).validate()


# --- convert --------------------------------------------------------------------------------------------------

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def convert(path, out, dtype: torch.dtype | None = None, progress: bool = True, **overrides) -> Path:
    """Write a .tinyloop artifact from a Hugging Face directory, streamed: the safetensors header is computed from
    the config first, then each shard's tensors are converted and written at their offsets, so memory holds one
    shard at a time, not the model. dtype None keeps the checkpoint's (bf16 for the real ones). overrides: ModelConfig
    fields that do not change the weights (exit_kv "copy": Ouro's early exit skips the loops after the exit)."""
    path, out = Path(path), Path(out)
    cfg = read_hf_config(path)
    bad = sorted(set(overrides) - {"exit_kv", "default_loops", "max_loops", "init_sigma"})
    if bad:
        raise ConfigError(f"convert: cannot override {bad} (only fields that leave the weights as they are)")
    cfg = replace(cfg, **overrides).validate()
    codec = read_hf_tokenizer(path, cfg)
    dtype = dtype or checkpoint_dtype(read_raw(path)) or torch.float32
    if dtype not in _ST_DTYPES:
        raise ConfigError(f"convert: dtype must be one of {list(_ST_DTYPES)}, got {dtype}")
    shapes = _expected_shapes(cfg)
    size = torch.tensor([], dtype=dtype).element_size()
    header, offsets, pos = {}, {}, 0
    for name, shape in sorted(shapes.items()):
        n = math.prod(shape) * size
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
        offsets[name], pos = pos, pos + n
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": json.dumps(cfg.to_dict()),
            "tokenizer": codec.to_json(), "chat": json.dumps(codec.chat_dict()), "beta": "", "loss_vs_loops": "{}",
            "provenance": json.dumps(provenance(path)), "data_sha256": "0" * 64}
    blob = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    start = 8 + len(blob)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=pos, unit="B", unit_scale=True, desc=f"convert {path.name}")
    tmp = out.with_name(out.name + ".part")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(start + pos)
        for name, t in iter_weights(path, cfg, dtype):
            f.seek(start + offsets[name])
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())  # bytes as stored (numpy has no bf16)
            if bar:
                bar.update(t.numel() * size)
    if bar:
        bar.close()
    digest = hashlib.sha256()  # second pass over the data, in 1 MiB reads (memory stays flat)
    with open(tmp, "rb") as f:
        f.seek(start)
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    patched = blob.replace(b'"data_sha256":"' + b"0" * 64 + b'"', b'"data_sha256":"' + digest.hexdigest().encode() + b'"')
    with open(tmp, "r+b") as f:
        f.seek(8)
        f.write(patched)
    tmp.replace(out)
    return out
