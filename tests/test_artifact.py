"""The .tinyloop artifact: round trip, and a clear ArtifactError for every kind of broken file."""
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import tinyloop
from tinyloop.artifact import DEFAULT_ARTIFACT


def rewrite(src, dst, tensors=None, **meta_changes):
    with safe_open(src, framework="pt") as f:
        meta = dict(f.metadata())
        data = {k: f.get_tensor(k) for k in f.keys()}
    data = tensors(data) if tensors else data
    for k, v in meta_changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    save_file(data, str(dst), metadata=meta)
    return str(dst)


def test_round_trip_keeps_weights_and_tokenizer(make_artifact, tiny_codec):
    model = tinyloop.load_model(make_artifact(), 32)
    assert model.codec.encode("def add(a, b):") == tiny_codec.encode("def add(a, b):")
    with safe_open(make_artifact(), framework="pt") as f:
        assert torch.equal(model.net.embed.weight, f.get_tensor("embed.weight").float())


def test_bundled_artifact_loads_by_default():
    model = tinyloop.load_model(None, 64)
    assert model.info.path == str(DEFAULT_ARTIFACT)
    assert DEFAULT_ARTIFACT.stat().st_size <= 30 * 2**20
    assert model.info.beta is not None and model.info.loss_vs_loops


def test_missing_file(tmp_path):
    with pytest.raises(tinyloop.ArtifactError, match="no such artifact"):
        tinyloop.load_model(str(tmp_path / "nope.tinyloop"))


@pytest.mark.parametrize("keep", [0, 5, 100, -1000])
def test_truncated_file(make_artifact, tmp_path, keep):
    raw = open(make_artifact(), "rb").read()
    bad = tmp_path / "cut.tinyloop"
    bad.write_bytes(raw[:keep] if keep >= 0 else raw[:keep])
    with pytest.raises(tinyloop.ArtifactError, match="truncated|not a readable"):
        tinyloop.load_model(str(bad))


def test_flipped_bit_in_weights_is_detected(make_artifact, tmp_path):
    raw = bytearray(open(make_artifact(), "rb").read())
    raw[-100] ^= 0x10
    bad = tmp_path / "flip.tinyloop"
    bad.write_bytes(bytes(raw))
    with pytest.raises(tinyloop.ArtifactError, match="sha256"):
        tinyloop.load_model(str(bad))


def test_unknown_format_version(make_artifact, tmp_path):
    bad = rewrite(make_artifact(), tmp_path / "v.tinyloop", format_version="99")
    with pytest.raises(tinyloop.ArtifactError, match="unknown format_version '99'"):
        tinyloop.load_model(bad)


def test_not_a_tinyloop_file(make_artifact, tmp_path):
    bad = rewrite(make_artifact(), tmp_path / "f.tinyloop", format=None)
    with pytest.raises(tinyloop.ArtifactError, match="'format'"):
        tinyloop.load_model(bad)


def resign(path):
    """Recompute the data digest so only the intended fault remains."""
    from tinyloop.artifact import _data_digest
    with safe_open(path, framework="pt") as f:
        meta, data = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    meta["data_sha256"] = _data_digest(path)
    save_file(data, path, metadata=meta)
    return path


def test_missing_tensor(make_artifact, tmp_path):
    bad = resign(rewrite(make_artifact(), tmp_path / "m.tinyloop", tensors=lambda d: {k: v for k, v in d.items() if k != "norm.weight"}))
    with pytest.raises(tinyloop.ArtifactError, match=r"missing tensor\(s\) \['norm.weight'\]"):
        tinyloop.load_model(bad)


def test_misshaped_tensor(make_artifact, tmp_path):
    bad = resign(rewrite(make_artifact(), tmp_path / "s.tinyloop", tensors=lambda d: {**d, "norm.weight": torch.ones(3, dtype=torch.float16)}))
    with pytest.raises(tinyloop.ArtifactError, match=r"tensor norm.weight has shape \(3,\), config needs \(64,\)"):
        tinyloop.load_model(bad)


@pytest.mark.parametrize("change,message", [
    (lambda c: {**c, "injection": "multiply"}, "injection 'multiply'"),
    (lambda c: {**c, "n_heads": 5}, "not divisible by n_heads"),
    (lambda c: {**c, "d_model": "big"}, "d_model must be int"),
    (lambda c: {**c, "flux": 1}, r"unknown field\(s\) \['flux'\]"),
])
def test_bad_config(make_artifact, tmp_path, change, message):
    with safe_open(make_artifact(), framework="pt") as f:
        cfg = json.loads(f.metadata()["config"])
    bad = rewrite(make_artifact(), tmp_path / "c.tinyloop", config=json.dumps(change(cfg)))
    with pytest.raises(tinyloop.ArtifactError, match=message):
        tinyloop.load_model(bad)


def test_config_that_is_not_json(make_artifact, tmp_path):
    bad = rewrite(make_artifact(), tmp_path / "j.tinyloop", config="{not json")
    with pytest.raises(tinyloop.ArtifactError, match="bad model config"):
        tinyloop.load_model(bad)


def test_bad_tokenizer(make_artifact, tmp_path):
    bad = rewrite(make_artifact(), tmp_path / "t.tinyloop", tokenizer="[]")
    with pytest.raises(tinyloop.ArtifactError, match="bad tokenizer"):
        tinyloop.load_model(bad)


def test_garbage_header(tmp_path):
    bad = tmp_path / "g.tinyloop"
    bad.write_bytes(struct.pack("<Q", 10) + b"not json!!" + b"\0" * 64)
    with pytest.raises(tinyloop.ArtifactError, match="not a readable safetensors"):
        tinyloop.load_model(str(bad))


def test_loading_and_generating_import_no_compiler_and_no_grammar_library(fresh_modules):
    """Every CLI command and worker starts by loading a model: that must not pull in torch._dynamo (which building
    a model on the meta device would, through nn.init, and so would counting a quantised model's bytes on it through
    torch's Python meta ops, ~1.3 s) or xgrammar (which imports transformers), ~2.5 s together. A grammar request
    still imports xgrammar when it comes. (The fresh interpreter's steps: conftest.fresh_modules.)"""
    heavy = ("torch._dynamo", "xgrammar", "transformers")
    seen = {step: sorted(m for m in heavy if m in fresh_modules[step]) for step in ("generate", "quantised")}
    seen["grammar"] = ["xgrammar"] if "xgrammar" in fresh_modules["grammar"] else []
    assert seen == {"generate": [], "quantised": [], "grammar": ["xgrammar"]}
