"""Weight formats (tinyloop/formats.py) end to end: the stored layouts, load_model(weights=...), quantised artifacts
from `tinyloop quantize`, the memory plan, the held-out loss goals, the CLI and a worker serving int4 weights."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tinyloop
from broker import launcher
from broker.client import Client
from tests.conftest import direct
from tinyloop.artifact import DEFAULT_ARTIFACT, _data_digest, read_artifact, save_artifact
from tinyloop.errors import ArtifactError, ConfigError
from tinyloop.formats import QMatrix, dequantize, parse_spec, quantize, quantize_activations, reference_linear

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "scripts.cli"]


def test_layouts_hold_what_the_docs_say():
    torch.manual_seed(0)
    w = torch.randn(6, 80) * 0.05
    q8 = quantize(w, "int8")
    assert q8.data.dtype == torch.int8 and q8.scale.shape == (6,)
    torch.testing.assert_close(q8.scale, w.abs().amax(1) / 127)
    assert int(q8.data.abs().max()) == 127  # each row's largest value maps to +-127
    q4 = quantize(w, "int4", 32)  # 80 is not a multiple of 32: stored padded to 96 with zeros
    assert q4.shape == (6, 80) and q4.padded_width == 96 and q4.data.shape == (6, 48) and q4.scale.shape == (6, 3)
    # byte j of a 32-value block: value j in the low nibble, value j + 16 in the high one, both offset by 8
    q = (torch.round(w[:, :32] / q4.scale[:, :1]).clamp(-8, 7) + 8).to(torch.uint8)
    assert torch.equal(q4.data[:, :16], q[:, :16] | (q[:, 16:32] << 4))
    for fmt, bound in (("bf16", 2 ** -8), ("int8", 0.5 / 127), ("int4", 0.5 / 7)):
        err = (dequantize(quantize(w, fmt)) - w).abs().max() / w.abs().max()
        assert 0 < err <= bound * 1.0001
    rows = q4.rows(2, 5)
    assert torch.equal(dequantize(rows), dequantize(q4)[2:5])
    x = torch.randn(3, 80)
    torch.testing.assert_close(reference_linear(x, q4), x @ dequantize(q4).T)


def test_quantize_activations_rounds_each_block_of_32_to_int8():
    x = torch.randn(3, 100) * torch.linspace(0.1, 10, 100)  # blocks of very different scales; a tail of 4
    x[1, 32:64] = 0.0  # an all-zero block stays zero (no division by its zero max)
    qx = quantize_activations(x)
    assert torch.equal(qx[:, 96:], x[:, 96:])  # the partial last block is not quantised
    blocks, qblocks = x[:, :96].reshape(3, 3, 32), qx[:, :96].reshape(3, 3, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    q = qblocks / torch.where(step > 0, step, 1)
    torch.testing.assert_close(q, q.round(), atol=1e-4, rtol=0)  # integers ...
    assert q.abs().max() <= 127 + 1e-4 and torch.equal(q.abs().amax(-1)[step[..., 0] > 0].round(), torch.full((8,), 127.0))
    assert (qblocks - blocks).abs().le(step / 2 * 1.0001).all()  # ... rounded to nearest
    assert torch.equal(qx[1, 32:64], torch.zeros(32))


def test_act_quant_products_quantise_their_rows_on_every_path():
    """An act_quant matrix multiplies quantize_activations(x): the CPU kernel (few rows), the widened product
    (many rows) and the reference agree, int4 included at a width its group does not divide (quantised as the
    kernels see the row: zero-padded)."""
    from tinyloop.kernels.linear import linear

    torch.manual_seed(0)
    for fmt, K in (("int8", 100), ("int4", 80)):
        w = quantize(torch.randn(24, K) * 0.05, fmt)
        aq = QMatrix(w.fmt, w.data, w.scale, w.group, w.width, act_quant=True)
        for rows in (3, 40):  # the C kernel, then past its 32-row cap
            x = torch.randn(rows, K)
            got, want, weight_only = linear(x, aq), reference_linear(x, aq), reference_linear(x, w)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert (got - weight_only).abs().max() > 1e-5


def test_int8_and_int4_quantise_activations_on_the_cpu_unless_told_not_to(monkeypatch):
    ids = torch.tensor([[5, 17, 99, 3, 42, 8]])
    for fmt in ("int8", "int4"):
        fast, weight_only = tinyloop.load_model(weights=fmt), tinyloop.load_model(weights=fmt, act_quant=False)
        assert fast.act_quant and not weight_only.act_quant
        a, b = fast.net(ids, 4), weight_only.net(ids, 4)
        assert 0 < (a - b).abs().max() < 0.05 * b.abs().max()  # a different, close product
    monkeypatch.setenv("TINYLOOP_ACT_QUANT", "off")
    assert not tinyloop.load_model(weights="int8").act_quant
    assert tinyloop.load_model(weights="int8", act_quant=True).act_quant  # the argument wins over the environment
    monkeypatch.setenv("TINYLOOP_ACT_QUANT", "sometimes")
    with pytest.raises(ConfigError, match="TINYLOOP_ACT_QUANT"):
        tinyloop.load_model(weights="int8")
    monkeypatch.delenv("TINYLOOP_ACT_QUANT")
    assert not tinyloop.load_model(weights="bf16").act_quant  # weight-only formats have nothing to quantise


def test_bad_format_specs_name_the_problem():
    assert parse_spec("int4:64") == ("int4", 64) and parse_spec("int8") == ("int8", 32)
    for spec, words in (("int3", "not one of"), ("int4:48", "multiple of 32"), ("int8:64", "only int4"),
                        ("int4:x", "must be a number")):
        with pytest.raises(ConfigError, match=words):
            parse_spec(spec)
    with pytest.raises(ConfigError, match="weight format 'fp8'"):
        tinyloop.load_model(weights="fp8")


def test_formats_shrink_the_model_and_keep_its_quality():
    """Each format holds its matrices once (the fp32 linear weights are released), the plan counts exactly what is
    held, and the held-out loss stays within the goals: int8 within 0.01 nats of fp32, int4 within 0.05."""
    from scripts.inspect_model import format_losses

    held = {}
    for fmt in ("fp32", "bf16", "int8", "int4"):
        model = tinyloop.load_model(weights=fmt)
        held[fmt] = model.weight_bytes()
        assert model.weights == fmt
        assert tinyloop.plan_memory(model).bytes_of("weights") == held[fmt]
        assert tinyloop.plan_memory(model.cfg, weights=fmt).bytes_of("weights") == held[fmt]  # before loading
        if fmt != "fp32":
            assert all(p.numel() == 0 for p in model.net.core[0].parameters() if p.dim() == 2)
        tinyloop.free_model(model)
    assert held["fp32"] > held["bf16"] > held["int8"] > held["int4"]
    losses = format_losses(tokens=2048)
    assert abs(losses["bf16"] - losses["fp32"]) < 0.01
    assert abs(losses["int8"] - losses["fp32"]) < 0.01
    assert abs(losses["int4"] - losses["fp32"]) < 0.05 and losses["int4"] != losses["fp32"]
    weight_only = format_losses(tokens=2048, formats=("int8", "int4"), act_quant=False)  # the CPU default quantises x
    assert abs(weight_only["int8"] - losses["fp32"]) < 0.01 and abs(weight_only["int4"] - losses["fp32"]) < 0.05
    assert weight_only["int8"] != losses["int8"] and weight_only["int4"] != losses["int4"]


def test_quantize_command_writes_an_artifact_that_loads_in_its_format(tmp_path):
    out = tmp_path / "int4.tinyloop"
    run = subprocess.run([*CLI, "quantize", str(DEFAULT_ARTIFACT), str(out), "--weights", "int4:64"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "int4 weights" in run.stdout
    info, _ = read_artifact(out)
    assert (info.weights, info.group) == ("int4", 64)
    stored = tinyloop.load_model(out)
    fresh = tinyloop.load_model(weights="int4", group=64)
    assert stored.weights == "int4" and stored.weight_bytes() == fresh.weight_bytes()
    assert out.stat().st_size < DEFAULT_ARTIFACT.stat().st_size
    prompt = "def add(a, b):\n"
    assert direct(stored, prompt, max_tokens=16).tokens == direct(fresh, prompt, max_tokens=16).tokens
    with pytest.raises(ConfigError, match="holds int4 weights"):
        tinyloop.load_model(out, weights="int8")
    bad = subprocess.run([*CLI, "generate", "x", "--model", str(out), "--weights", "bf16", "--max-tokens", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "holds int4 weights" in bad.stderr
    gen = subprocess.run([*CLI, "generate", prompt, "--weights", "int8", "--max-tokens", "8"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr
    int8 = tinyloop.load_model(weights="int8")
    assert gen.stdout.startswith(prompt + direct(int8, prompt, max_tokens=8).text)


def test_a_damaged_quantised_artifact_is_refused(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    src = tmp_path / "q.tinyloop"
    model = tinyloop.load_model(weights="int8")
    save_artifact(src, model.net, model.info.codec)
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(src))
    tensors["quantized.core.0.wo.data"] = tensors["quantized.core.0.wo.data"].float()
    bad = tmp_path / "bad.tinyloop"
    save_file(tensors, str(bad), metadata=meta)
    meta["data_sha256"] = _data_digest(bad)  # a consistent file of the wrong dtype, not a flipped bit
    save_file(tensors, str(bad), metadata=meta)
    with pytest.raises(ArtifactError, match="quantized.core.0.wo.data"):
        read_artifact(bad)


def test_a_worker_serves_int4_weights():
    """`tinyloop serve --weights int4`: the worker holds int4 matrices (its announced plan counts them) and answers
    what load_model(weights='int4') answers in-process."""
    args = ["--max-seq-len", "256", "--threads", "1", "--weights", "int4"]
    model = tinyloop.load_model(None, 256, weights="int4")
    with launcher.LocalService(1, args, heartbeat_interval=0.3, startup_timeout=300) as svc:
        with Client(svc.frontend, timeout=120) as client:
            reply = client.submit("generate", {"prompt": "import os\n", "max_tokens": 16}).result()
            plan = client.status()["workers"][0]["plan_bytes"]
    assert reply.tokens == direct(model, "import os\n", max_tokens=16).tokens
    fp32_plan = tinyloop.plan_memory(model.cfg, 256, lanes=1, max_handles=8)
    int4_plan = tinyloop.plan_memory(model.cfg, 256, lanes=1, max_handles=8, weights="int4")
    # the announced plan is the model's (int4 weights) plus the process baseline the worker measured at start
    baseline = plan - int4_plan.total_bytes
    assert 0 < baseline < 2**30 and int4_plan.bytes_of("weights") < fp32_plan.bytes_of("weights")
