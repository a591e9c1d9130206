"""Checkpoint directories of looped models (Ouro, Huginn-0125, ...) as configurations of the TinyLoop family.

A directory holds config.json, safetensors weights (one file, or shards listed by model.safetensors.index.json),
tokenizer.json and tokenizer_config.json (special tokens, chat template). What is the same for every family lives
here: `read_hf_config` asks the family registry (tinyloop/models/) which family a config.json is and maps it to a
ModelConfig through that family's module; `iter_weights` streams the tensors shard by shard, renamed and reshaped
by the family's `tensors`, checking names, shapes and dtypes on the way; `load_hf` gathers them for load_model and
`convert` writes a .tinyloop artifact without ever holding more than one shard beside what it has written. Each
family's own mapping (and its exit rule and KV policy across loops) is in its module, tinyloop/models/<family>.py.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from .artifact import FORMAT, FORMAT_VERSION, ArtifactInfo, _expected_shapes, read_config
from .config import ModelConfig
from .gguf import is_gguf, natural_format, read_gguf_config
from .gguf import stored_dtype as gguf_dtype
from .errors import ArtifactError, ConfigError
from .models import family_of, loadable
from .models.family import Raw
from .tokenizer import TextCodec

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
    """config.json -> ModelConfig, through its family's module. ArtifactError names an unsupported model_type or an
    option TinyLoop lacks. Huginn's random initial state gets the reference's default scale (init_scale 1.0;
    load_model changes it)."""
    raw = read_raw(path)
    family = family_of(raw)
    if family is None:
        raise ArtifactError(f"{path}: config.json has model_type {raw.get('model_type')!r}; TinyLoop loads "
                            f"{', '.join(loadable())}")
    fields = family.config(Raw(path, raw, family.KIND))
    bos, eos = _special_ids(Path(path), raw, fields["vocab_size"], family)
    try:
        return ModelConfig(bos_id=bos, eos_id=eos, **fields).validate()
    except (ConfigError, TypeError) as e:
        raise ArtifactError(f"{path}: config.json does not make a valid model: {e}") from None


def _optional_json(path: Path, name: str) -> dict:
    return _read_json(path / name, name) if (path / name).is_file() else {}


def _special_tokens(path: Path, family) -> dict[str, str | None]:
    """The BOS and EOS strings: tokenizer_config.json's, else the family's own (a tokenizer saved without one)."""
    tok_cfg = _optional_json(path, "tokenizer_config.json")
    default = getattr(family, "SPECIAL_TOKENS", {})
    return {name: _token_text(tok_cfg.get(name)) or default.get(name) for name in ("bos_token", "eos_token")}


def _special_ids(path: Path, raw: dict, vocab: int, family) -> tuple[int, int]:
    """BOS and EOS: the tokenizer's declared tokens (tokenizer_config.json, else the family's) when it has them — for
    a chat model that is the end-of-turn token generation must stop at —, else generation_config.json, else
    config.json."""
    gen = _optional_json(path, "generation_config.json")
    vocab_ids = {}
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        try:
            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
            vocab_ids = {name: tok.token_to_id(text) for name, text in _special_tokens(path, family).items() if text}
        except Exception:  # noqa: BLE001 (a broken tokenizer is reported by read_hf_tokenizer with its own message)
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
    from tokenizers import Tokenizer, processors
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception on malformed files)
        raise ArtifactError(f"{file}: not a readable tokenizers file ({e})") from None
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ArtifactError(f"{file}: tokenizer has {tok.get_vocab_size()} tokens but config.json's vocabulary is "
                            f"{cfg.vocab_size}")
    tok_cfg = _optional_json(path, "tokenizer_config.json")
    family = family_of(read_raw(path))
    special = _special_tokens(path, family)
    if getattr(family, "PREPEND_BOS", False) and tok.post_processor is None and special["bos_token"]:
        # the family puts BOS in front of every text it trains on and evaluates; its tokenizer.json does not
        bos = special["bos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, cfg.bos_id)])
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
    if (path / "chat_template.jinja").is_file():  # newer transformers save the template beside the config
        template = (path / "chat_template.jinja").read_text()
    return TextCodec(tok, eos_id=cfg.eos_id, chat_template=template if isinstance(template, str) else None,
                     bos_token=special["bos_token"] or "", eos_token=special["eos_token"] or "")


# --- weights --------------------------------------------------------------------------------------------------

# torch pickles a checkpoint may ship instead of safetensors (Parcae saves one of these), in the order looked for
PICKLES = ("pytorch_model.bin", "model.pt", "model.bin")


def _shards(path: Path) -> dict[str, list[str] | None]:
    """Shard file -> the tensor names the index assigns to it (None: whatever the file holds). Safetensors when the
    directory has them (an index's shards, or every *.safetensors), else torch pickles (pytorch_model.bin.index.json's
    shards, or the first of PICKLES)."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            weight_map = _read_json(index, index_name).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ArtifactError(f"{index}: no weight_map")
            files: dict[str, list[str]] = {}
            for name, file in weight_map.items():
                files.setdefault(file, []).append(name)
            missing = sorted(f for f in files if not (path / f).is_file())
            if missing:
                raise ArtifactError(f"{path}: missing shard(s) {missing} listed in {index_name}")
            return dict(sorted(files.items()))
    found = sorted(p.name for p in path.glob("*.safetensors")) or [n for n in PICKLES if (path / n).is_file()][:1]
    if not found:
        raise ArtifactError(f"{path}: no weights (*.safetensors, or a torch pickle {' / '.join(PICKLES)})")
    return {f: None for f in found}


class _Pickle:
    """A torch pickle of tensors opened like a safetensors file (keys, get_tensor). Loaded with weights_only=True,
    so a checkpoint never runs code, and memory-mapped where the file's format allows."""

    def __init__(self, file: Path):
        try:
            try:
                data = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
                data = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 (pickle's and torch's own errors for a malformed or unsafe file)
            raise ArtifactError(f"{file}: not a loadable torch pickle of tensors ({e})") from None
        if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
            raise ArtifactError(f"{file}: a torch pickle that is not a dict of tensors")
        self.data = data

    def __enter__(self) -> "_Pickle":
        return self

    def __exit__(self, *exc) -> None:
        self.data = {}

    def keys(self):
        return self.data.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.data[key]


def _open_weights(file: Path):
    """A weights file to read keys and tensors from: safetensors, or a torch pickle."""
    if file.suffix != ".safetensors":
        return _Pickle(file)
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error types for malformed files)
        raise ArtifactError(f"{file}: not a readable safetensors file ({e})") from None


def iter_weights(path, cfg: ModelConfig, dtype: torch.dtype | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(TinyLoop name, tensor) for every weight, shard by shard, in `dtype` (None: as stored). Checks that every
    tensor is known, has the shape config.json implies and the dtype it declares, and that none is missing."""
    path = Path(path)
    raw = read_raw(path)
    family = family_of(raw)
    assert family is not None  # (read_hf_config found it)
    declared = checkpoint_dtype(raw)
    expected = _expected_shapes(cfg)
    seen: set[str] = set()
    for file, listed in _shards(path).items():
        with _open_weights(path / file) as f:
            keys = set(f.keys())
            absent = sorted(set(listed or ()) - keys)
            if absent:
                raise ArtifactError(f"{path / file}: tensor(s) {absent[:5]} listed in the index are not in this shard")
            for key in sorted(keys):
                if key.endswith(IGNORED):
                    continue
                targets = family.tensors(key, cfg)
                if targets is None:
                    raise ArtifactError(f"{path / file}: unexpected tensor {key!r} for a {family.KIND} model")
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
    format and group its matrices are stored in, from config.json, a GGUF file's metadata or the artifact's header:
    what a memory plan needs before anything large is read."""
    if is_gguf(path):
        return read_gguf_config(path), gguf_dtype(path), natural_format(path)
    if is_hf_dir(path):
        stored = checkpoint_dtype(read_raw(path)) or _stored_dtype(Path(path)) or torch.float32
        return read_hf_config(path), stored, ("fp32", 0)
    cfg = read_config(path)
    with safe_open(str(path), framework="pt") as f:
        first = next(iter(f.keys()), None)
        kind = f.get_slice(first).get_dtype() if first else ""
        weights = json.loads((f.metadata() or {}).get("weights") or '{"format": "fp32", "group": 0}')
    return cfg, torch.bfloat16 if kind == "BF16" else torch.float32, (weights["format"], int(weights["group"]))


def _stored_dtype(path: Path) -> torch.dtype | None:
    """The dtype of a checkpoint's first tensor, for a config.json that declares none (Parcae's); None without weights
    (a config.json alone, as in tests/data/hf/configs)."""
    try:
        first = next(iter(_shards(path)))
    except ArtifactError:
        return None
    with _open_weights(path / first) as f:
        key = next(iter(f.keys()), None)
        return None if key is None else f.get_tensor(key).dtype


def provenance(path) -> dict:
    raw = read_raw(path)
    family = family_of(raw)
    return {"source": "huggingface", "model_type": family.KIND if family else raw.get("model_type"),
            "family": family.NAME if family else None, "path": str(Path(path).resolve()),
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
