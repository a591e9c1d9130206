"""The dense twin (scripts/bench/twin.py), its GGUF file, and `tinyloop bench --peers --json/--plot` (docs/kernels.md,
Peers). The peers themselves (transformers, llama.cpp) are not installed here: whether their greedy tokens agree
with TinyLoop's is checked and printed by the bench itself."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from scripts.bench.peers import QUICK, randomize
from tinyloop.config import ModelConfig
from tinyloop.errors import ConfigError
from tinyloop.model import LoopedLM
from tinyloop.rotary import apply_rope, rope_tables
from scripts.bench.twin import check_twin, rope_interleave, schedule, twin_layers, write_gguf

REPO = Path(__file__).resolve().parent.parent
CFG = ModelConfig(vocab_size=300, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, n_prelude=1, n_core=2,
                  n_coda=1, max_loops=3, default_loops=3, injection="none", state_init="embed", bos_id=1, eos_id=2)


def looped(cfg: ModelConfig = CFG) -> LoopedLM:
    net = LoopedLM(cfg, 32).eval().requires_grad_(False)
    randomize(net, 0)
    return net


@torch.no_grad()
def test_twin_layers_unrolled_give_the_looped_models_logits():
    """A plain stack built from twin_layers (a looped model of depth 1 whose prelude holds every twin layer) computes
    the looped model's logits at 3 loops: the schedule and the roles map the right tensors to the right layers."""
    net = looped()
    layers = twin_layers(net, 3)
    assert [p for p, _ in schedule(CFG, 3)] == ["prelude"] + ["core"] * 6 + ["coda"]
    flat = LoopedLM(ModelConfig(**{**CFG.to_dict(), "n_prelude": len(layers) - 1, "n_core": 1, "n_coda": 0,
                                   "max_loops": 1, "default_loops": 1}), 32).eval()
    blocks = list(flat.prelude) + list(flat.core)
    for b, layer in zip(blocks, layers):
        a, m = b.attn, b.mlp
        for mod, role in ((b.attn_norm, "attn_norm"), (a.wq, "wq"), (a.wk, "wk"), (a.wv, "wv"), (a.wo, "wo"),
                          (b.mlp_norm, "mlp_norm"), (m.w_gate, "w_gate"), (m.w_up, "w_up"), (m.w_down, "w_down")):
            mod.weight.copy_(layer[role])
    flat.embed.weight.copy_(net.embed.weight)
    flat.norm.weight.copy_(net.norm.weight)
    ids = torch.randint(3, CFG.vocab_size, (2, 10))
    want = net(ids, 3)
    assert torch.allclose(flat(ids, 1), want, atol=1e-4, rtol=1e-5)
    assert not torch.allclose(net(ids, 2), want, atol=1e-2)  # the loop count matters: the check has teeth


def test_no_twin_for_models_whose_loop_is_not_a_layer_stack():
    for field, value, word in (("injection", "adapter", "injection"), ("state_init", "zeros", "state_init"),
                               ("sandwich_norm", True, "sandwich")):
        with pytest.raises(ConfigError, match=word):
            check_twin(ModelConfig(**{**CFG.to_dict(), field: value}))


def interleaved_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's "normal" RoPE: pairs (2i, 2i + 1) of each head turn by pos * theta^(-2i / hd). x [T, H, hd]."""
    hd = x.shape[-1]
    ang = pos[:, None].double() * theta ** (-torch.arange(0, hd, 2).double() / hd)
    cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def test_rope_interleave_gives_llama_cpps_rope_the_same_scores():
    """q/k rows reordered by rope_interleave, rotated the interleaved way, equal the rotate-half rotation of the
    original rows reordered the same way; so every head's q.k scores are unchanged."""
    torch.manual_seed(0)
    H, hd, d, T = 3, 16, 24, 7
    wq, wk, x = torch.randn(H * hd, d), torch.randn(H * hd, d), torch.randn(T, d)
    pos = torch.arange(T) * 3
    cos, sin = rope_tables(hd, 64, 10000.0)
    half = lambda w: apply_rope((x @ w.T).view(1, T, H, hd), cos[pos].view(1, T, 1, -1), sin[pos].view(1, T, 1, -1))[0]  # noqa: E731
    inter = lambda w: interleaved_rope((x @ rope_interleave(w, H).T).view(T, H, hd), pos, 10000.0)  # noqa: E731
    assert torch.allclose(inter(wq), rope_interleave(half(wq).reshape(T, -1).T, H).T.reshape(T, H, hd), atol=1e-5)
    scores = lambda q, k: torch.einsum("thd,shd->hts", q, k)  # noqa: E731
    assert torch.allclose(scores(inter(wq), inter(wk)), scores(half(wq), half(wk)), atol=1e-3)


@pytest.mark.parametrize("qtype,tol", [("F32", 0.0), ("F16", 1e-3), ("Q8_0", 0.0)])
def test_gguf_twin_holds_every_layer_of_the_schedule(tmp_path, qtype, tol):
    import gguf

    net = looped()
    path = write_gguf(net, 3, tmp_path / f"twin-{qtype}.gguf", qtype)
    r = gguf.GGUFReader(str(path))
    field = lambda k: r.fields[k].contents()  # noqa: E731
    assert field("general.architecture") == "llama"
    assert field("llama.block_count") == 8 and field("llama.attention.head_count_kv") == CFG.n_kv_heads
    assert field("llama.rope.dimension_count") == CFG.head_dim and len(field("tokenizer.ggml.tokens")) == CFG.vocab_size
    assert field("tokenizer.ggml.eos_token_id") == CFG.eos_id
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 2 + 8 * 9  # token_embd, output_norm (tied head: no output.weight), 9 per layer

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))

    for i, (part, j) in enumerate(schedule(CFG, 3)):
        block = getattr(net, part)[j]
        for name, want in ((f"blk.{i}.attn_q.weight", rope_interleave(block.attn.wq.weight, CFG.n_heads)),
                           (f"blk.{i}.attn_k.weight", rope_interleave(block.attn.wk.weight, CFG.n_kv_heads)),
                           (f"blk.{i}.ffn_down.weight", block.mlp.w_down.weight),
                           (f"blk.{i}.ffn_norm.weight", block.mlp_norm.weight)):
            got, want = torch.from_numpy(read(name).copy()), want.float()
            if qtype == "Q8_0" and not name.endswith("norm.weight"):
                # rounding to the block's scale / 2, plus the scale's own fp16 rounding times up to 127
                scale = want.view(-1, 32).abs().amax(-1, keepdim=True) / 127
                assert ((got.view(-1, 32) - want.view(-1, 32)).abs() <= scale * (0.5 + 127 * 2**-11)).all(), name
            else:
                assert torch.allclose(got, want, rtol=tol, atol=tol * 1e-3), name  # fp16 subnormals: absolute
    assert tensors["blk.1.attn_q.weight"].tensor_type == getattr(gguf.GGMLQuantizationType, qtype)
    assert tensors["blk.1.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_bench_peers_json_and_plot(tmp_path):
    """The quick peers section as a user runs it: every TinyLoop format at batch 1 and 16, each peer either
    measured or named with its install command, the bandwidth fractions consistent, a PNG drawn."""
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    run = subprocess.run([sys.executable, "-m", "scripts.cli", "bench", "--peers", "--quick", "--json", str(out),
                          "--plot", str(png)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert list(res["sections"]) == ["peers", "gguf"]  # the gguf section: llama.cpp on SmolLM2's file (tests/test_gguf_llamacpp.py)
    assert res["sections"]["gguf"]["lines"][0].startswith(("llama.cpp: NOT INSTALLED", "NO GGUF FILE", "file: "))
    lines, data = res["sections"]["peers"]["lines"], res["sections"]["peers"]["data"]
    assert "\n".join(lines) in run.stdout
    assert data["bandwidth_Bps"] > 1e8 and data["threads"] == res["threads"]
    rows = data["rows"]
    got = {(r["system"], r["format"], r["batch"]) for r in rows if r["system"] == "tinyloop"}
    assert got == {("tinyloop", f, b) for f in ("fp32", "bf16", "int8", "int4", "int8 weight-only", "int4 weight-only")
                   for b in (1, 16)}
    cfg = QUICK["d128"]
    for r in rows:
        assert r["tok_s"] > 0 and len(r["tokens"]) == r["batch"]
        assert all(len(t) == data["configs"]["d128"]["new_tokens"] for t in r["tokens"])
        frac = r["weight_bytes_per_step"] * r["tok_s"] / r["batch"] / data["bandwidth_Bps"]
        assert r["bandwidth_fraction"] == pytest.approx(frac)
    ours = {(r["format"], r["batch"]): r for r in rows if r["system"] == "tinyloop"}
    for (fmt, b), r in ours.items():  # each format's bytes per weight, on the same weights read per step
        assert r["weight_bytes_per_step"] == pytest.approx(ours["fp32", b]["weight_bytes_per_step"] / 4 *
                                                           {"fp32": 4, "bf16": 2, "int8": 1, "int4": 0.625}[fmt.split()[0]])
    fp32 = [r for r in rows if r["system"] == "tinyloop" and r["format"] == "fp32"]
    per_step = sum(p.numel() for n, p in LoopedLM(cfg, 2).named_parameters() if "norm" not in n)  # distinct blocks
    per_block = (per_step - cfg.vocab_size * cfg.d_model) // (cfg.n_prelude + cfg.n_core + cfg.n_coda)
    passes = cfg.n_prelude + cfg.n_core * cfg.default_loops + cfg.n_coda
    assert fp32[0]["weight_bytes_per_step"] == 4 * (passes * per_block + cfg.vocab_size * cfg.d_model)
    assert all(r["greedy_agreement"] == 1.0 for r in fp32)
    assert ours["bf16", 1]["greedy_agreement"] > 0.5  # bf16 rounds the random weights slightly: mostly the same
    measured = {r["system"] for r in rows}
    missing = {m["peer"].split()[0]: m["install"] for m in data["missing_peers"]}
    for peer in ("transformers", "llama.cpp"):
        assert (peer in measured) != (peer in missing)
        if peer in missing:
            assert "pip install" in missing[peer] and f"peer {peer}" in run.stdout and "NOT INSTALLED" in run.stdout
    assert {(r["config"], r["batch"], r["tinyloop"]) for r in data["ratios"]} <= {("d128", b, f) for _, f, b in got}
    import matplotlib.image

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(str(png)).shape[2] in (3, 4)


# --plot of sections that measured no decode rows: test_cli.py's test_bench_quick_prints_ratios_and_plots_only_decode_rows
# (on the decode section's run).


def test_llama_peer_that_cannot_load_fails_its_own_row_with_the_reason(tmp_path):
    """llama.cpp runs in a process of its own (scripts/bench/llama_peer.py); a model it cannot load (here a file that
    does not exist, or llama-cpp-python not installed) is a PeerCrashed naming why, and the bench process goes on."""
    from scripts.bench.llama_peer import LlamaPeer, PeerCrashed

    with pytest.raises(PeerCrashed, match=r"llama\.cpp could not load .*missing\.gguf"):
        LlamaPeer(tmp_path / "missing.gguf", 64, 1)
