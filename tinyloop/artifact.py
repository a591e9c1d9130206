"""The .tinyloop artifact: one safetensors file whose metadata carries everything needed to run it.

Metadata keys: format ("tinyloop"), format_version, config (ModelConfig JSON), tokenizer (tokenizers JSON),
weights (JSON {format, group}: a quantised artifact, tinyloop/formats.py; optional, default fp32),
chat (JSON {template, bos_token, eos_token}: a chat model's template; optional), beta, loss_vs_loops (JSON {loops: held-out loss}), provenance (JSON), data_sha256 (of the tensor bytes,
so a flipped bit in the weights is caught at load, not as garbage output).
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from .errors import ArtifactError, ConfigError
from . import formats
from .model import LoopedLM, quantize_weights, quantized_matrices, shapes_only
from .tokenizer import TextCodec

FORMAT = "tinyloop"
FORMAT_VERSION = "1"
DEFAULT_ARTIFACT = Path(__file__).parent / "data" / "default.tinyloop"


@dataclass
class ArtifactInfo:
    path: str
    config: ModelConfig
    codec: TextCodec
    beta: float | None
    loss_vs_loops: dict[int, float]
    provenance: dict
    weights: str = "fp32"  # the matrices' format (tinyloop/formats.py)
    group: int = 0         # int4's group size
    matrices: dict[str, formats.QMatrix] | None = None  # a quantised artifact's matrices, by model.matrices' names

QUANTIZED = "quantized."  # tensor name prefix of a quantised artifact's matrices: quantized.<matrix>.data / .scale


def _data_digest(path: Path) -> str:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + header_len)
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_artifact(path: str | Path, model: LoopedLM, codec: TextCodec, *, beta: float | None = None,
                  loss_vs_loops: dict[int, float] | None = None, provenance: dict | None = None,
                  dtype: torch.dtype = torch.float16) -> None:
    """Write the model's weights (as `dtype`) and metadata. The digest is added in a second pass."""
    path = Path(path)
    # clone: parameters may be views of one fused matrix (model.fused_weights), safetensors wants separate storage
    tensors = {k: v.detach().to("cpu", dtype).clone() for k, v in model.state_dict().items() if v.numel()}
    fmt, group = "fp32", 0
    if model.quantized is not None:  # the matrices as they are held, not widened
        fmt = model.quantized.name
        for name, m in quantized_matrices(model.quantized).items():
            group = m.group
            tensors[f"{QUANTIZED}{name}.data"] = m.data.detach().cpu().contiguous().clone()
            if m.scale is not None:
                tensors[f"{QUANTIZED}{name}.scale"] = m.scale.detach().cpu().contiguous().clone()
    meta = {"weights": json.dumps({"format": fmt, "group": group}),"format": FORMAT, "format_version": FORMAT_VERSION, "config": json.dumps(model.cfg.to_dict()),
            "tokenizer": codec.to_json(), "chat": json.dumps(codec.chat_dict()), "beta": "" if beta is None else repr(float(beta)),
            "loss_vs_loops": json.dumps({str(k): v for k, v in (loss_vs_loops or {}).items()}),
            "provenance": json.dumps(provenance or {}), "data_sha256": ""}
    try:
        save_file(tensors, str(path), metadata=meta)
        meta["data_sha256"] = _data_digest(path)
        save_file(tensors, str(path), metadata=meta)  # same tensors, same data bytes; header now holds the digest
    except (OSError, SafetensorError) as exc:  # a missing directory, no permission, a full disk
        why = f"no such directory {path.parent}" if not path.parent.is_dir() else str(exc)
        raise ArtifactError(f"{path}: cannot write the artifact: {why}") from None


def read_artifact(path: str | Path) -> tuple[ArtifactInfo, dict[str, torch.Tensor]]:
    """Validate a .tinyloop file completely and return its metadata and tensors; ArtifactError on any fault."""
    path = Path(path)
    what = "expected a .tinyloop model file (a safetensors file with TinyLoop metadata)"
    if path.is_dir():
        raise ArtifactError(f"{path}: is a directory; {what}")
    if not path.is_file():
        raise ArtifactError(f"{path}: no such artifact file; {what}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(9)
    if size < 9:
        raise ArtifactError(f"{path}: truncated ({size} bytes; not even a safetensors header); {what}")
    if head[8:9] != b"{":  # a safetensors file is an 8-byte length, then a JSON header
        raise ArtifactError(f"{path}: not a readable safetensors file (no safetensors header at its start), "
                            f"so not a TinyLoop model; {what}")
    (header_len,) = struct.unpack("<Q", head[:8])
    if 8 + header_len > size:
        raise ArtifactError(f"{path}: truncated (header claims {header_len} bytes, file has {size})")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error types for every kind of malformed file)
        raise ArtifactError(f"{path}: not a readable safetensors file ({e})") from None

    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{path}: metadata 'format' is {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: unknown format_version {meta.get('format_version')!r} "
                            f"(this runtime reads version {FORMAT_VERSION})")
    for key in ("config", "tokenizer", "data_sha256"):
        if key not in meta:
            raise ArtifactError(f"{path}: metadata is missing {key!r}")
    if _data_digest(path) != meta["data_sha256"]:
        raise ArtifactError(f"{path}: tensor data does not match its recorded sha256 (corrupted file)")
    try:
        cfg = ModelConfig.from_dict(json.loads(meta["config"]))
    except (json.JSONDecodeError, ConfigError, TypeError) as e:
        raise ArtifactError(f"{path}: bad model config: {e}") from None
    try:
        codec = TextCodec.from_json(meta["tokenizer"], json.loads(meta.get("chat") or "{}"), cfg.eos_id)
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception on malformed JSON)
        raise ArtifactError(f"{path}: bad tokenizer: {e}") from None
    if codec.vocab_size > cfg.vocab_size:
        raise ArtifactError(f"{path}: tokenizer has {codec.vocab_size} tokens but the model's vocab_size is {cfg.vocab_size}")

    try:
        stored = json.loads(meta.get("weights") or '{"format": "fp32", "group": 0}')
        fmt, group = stored["format"], int(stored["group"])
        formats.check_format(fmt, group or formats.DEFAULT_GROUP)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, ConfigError) as e:
        raise ArtifactError(f"{path}: bad 'weights' metadata {meta.get('weights')!r}: {e}") from None
    expected_meta = _expected_tensors(cfg, fmt, group)
    expected = {k: tuple(v.shape) for k, v in expected_meta.items()}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise ArtifactError(f"{path}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        raise ArtifactError(f"{path}: unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    for k, shape in expected.items():
        if tuple(tensors[k].shape) != shape:
            raise ArtifactError(f"{path}: tensor {k} has shape {tuple(tensors[k].shape)}, config needs {shape}")
        if k.startswith(QUANTIZED) and tensors[k].dtype != expected_meta[k].dtype:
            raise ArtifactError(f"{path}: tensor {k} has dtype {tensors[k].dtype}, {fmt} needs {expected_meta[k].dtype}")
        if not k.startswith(QUANTIZED) and not tensors[k].is_floating_point():
            raise ArtifactError(f"{path}: tensor {k} has dtype {tensors[k].dtype}, expected a float type")
    try:
        beta = float(meta["beta"]) if meta.get("beta") else None
        table = {int(k): float(v) for k, v in json.loads(meta.get("loss_vs_loops") or "{}").items()}
        provenance = json.loads(meta.get("provenance") or "{}")
    except (ValueError, TypeError, AttributeError) as e:
        raise ArtifactError(f"{path}: bad beta / loss_vs_loops / provenance metadata: {e}") from None
    info = ArtifactInfo(str(path), cfg, codec, beta, table, provenance, fmt, group)
    if fmt != "fp32":
        info.matrices = {}
        for name, like in quantized_matrices(_meta_model(cfg, fmt, group).quantized).items():
            scale = tensors.pop(f"{QUANTIZED}{name}.scale", None)
            info.matrices[name] = formats.QMatrix(fmt, tensors.pop(f"{QUANTIZED}{name}.data"), scale, like.group, like.width)
    return info, tensors


def _meta_model(cfg: ModelConfig, fmt: str, group: int) -> LoopedLM:
    with shapes_only():
        net = LoopedLM(cfg, max_seq_len=1)
        quantize_weights(net, fmt, group or formats.DEFAULT_GROUP)
    return net


def _expected_tensors(cfg: ModelConfig, fmt: str = "fp32", group: int = 0) -> dict[str, torch.Tensor]:
    """The tensors (on the meta device) an artifact of this config and weight format holds, by name."""
    net = _meta_model(cfg, fmt, group)
    out = {k: v for k, v in net.state_dict().items() if v.numel()}
    if net.quantized is not None:
        for name, m in quantized_matrices(net.quantized).items():
            out[f"{QUANTIZED}{name}.data"] = m.data
            if m.scale is not None:
                out[f"{QUANTIZED}{name}.scale"] = m.scale
    return out


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in _expected_tensors(cfg).items()}


def read_config(path: str | Path) -> ModelConfig:
    """The model config of a .tinyloop file from its header alone (no tensors read): what a memory plan needs
    before anything large is loaded. ArtifactError when the header is not a TinyLoop artifact's."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no such artifact file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error types for every kind of malformed file)
        raise ArtifactError(f"{path}: not a readable safetensors file ({e})") from None
    if meta.get("format") != FORMAT or "config" not in meta:
        raise ArtifactError(f"{path}: not a TinyLoop artifact (metadata 'format' is {meta.get('format')!r})")
    try:
        return ModelConfig.from_dict(json.loads(meta["config"]))
    except (json.JSONDecodeError, ConfigError, TypeError) as e:
        raise ArtifactError(f"{path}: bad model config: {e}") from None
