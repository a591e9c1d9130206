"""GGUF files as TinyLoop models (tinyloop/gguf.py, tinyloop/models/llama.py; docs/gguf.md).

Each test writes a small Llama-architecture GGUF file with the `gguf` package (random weights, a byte-level BPE
trained here), as llama.cpp's converter lays it out (q / k rows in interleaved-RoPE order). The reference is
written independently of TinyLoop's reader: the tensors' values from the gguf package's own dequantizer and a plain
Llama forward with llama.cpp's interleaved RoPE over the file's rows as they are.
"""
from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tinyloop
from tinyloop.tokenizer import train_tokenizer

D, H, KV, FFN, LAYERS, THETA, EPS = 64, 4, 2, 128, 2, 10000.0, 1e-5
HD = D // H
TEXT = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
        "The capital of France is Paris. 12345 apples and 678 pears.\n"] * 20
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def vocab():
    tok = train_tokenizer(TEXT, 300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokens = [t for t, _ in sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    return tok, tokens, merges


def weights(vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights large enough that every layer matters, by GGUF name (q / k rows as the file holds them)."""
    g = torch.Generator().manual_seed(seed)

    def mat(n, k):
        return (torch.randn(n, k, generator=g) / k ** 0.5).numpy()

    def norm():
        return (0.5 + torch.rand(D, generator=g)).numpy()

    out = {"token_embd.weight": torch.randn(vocab_size, D, generator=g).numpy(), "output_norm.weight": norm()}
    for i in range(LAYERS):
        out.update({f"blk.{i}.attn_norm.weight": norm(), f"blk.{i}.ffn_norm.weight": norm(),
                    f"blk.{i}.attn_q.weight": mat(H * HD, D), f"blk.{i}.attn_k.weight": mat(KV * HD, D),
                    f"blk.{i}.attn_v.weight": mat(KV * HD, D), f"blk.{i}.attn_output.weight": mat(D, H * HD),
                    f"blk.{i}.ffn_gate.weight": mat(FFN, D), f"blk.{i}.ffn_up.weight": mat(FFN, D),
                    f"blk.{i}.ffn_down.weight": mat(D, FFN)})
    return out


def write(path, vocab, qtype: str = "F32", arch: str = "llama", tokenizer: str = "gpt2", extra=None,
          embed_type: str | None = None, raw=None):
    """A Llama GGUF file: matrices in qtype, norms F32, the embedding in embed_type (default qtype); extra: more
    tensors; raw: name -> (bytes, type) in place of a tensor."""
    _, tokens, merges = vocab
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_dimension_count(HD)
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(EPS)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(tokenizer)
    w.add_tokenizer_pre("gpt2")  # the trained tokenizer's own split (smollm's: tests/test_gguf_llamacpp.py)
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for name, a in {**weights(len(tokens)), **(extra or {})}.items():
        if name in (raw or {}):
            w.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
            continue
        kind = embed_type if name == "token_embd.weight" and embed_type else qtype
        if a.ndim == 1 or kind == "F32":
            w.add_tensor(name, a.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            t = getattr(gguf.GGMLQuantizationType, kind)
            w.add_tensor(name, gguf.quants.quantize(a.astype(np.float32), t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_logits(path, ids: list[int]) -> torch.Tensor:
    """A plain Llama forward of the file's values (the gguf package's dequantizer) with llama.cpp's RoPE: pairs
    (2i, 2i + 1) of each head's rows, as the file stores q and k."""
    r = gguf.GGUFReader(str(path))
    t = {x.name: torch.from_numpy(np.array(gguf.quants.dequantize(x.data, x.tensor_type), dtype=np.float32)
                                  .reshape([int(n) for n in reversed(x.shape)])) for x in r.tensors}
    T = len(ids)
    inv = THETA ** (-torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = ang.cos().float(), ang.sin().float()

    def rope(x):  # x [T, heads, HD], interleaved pairs
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos[:, None] - b * sin[:, None], a * sin[:, None] + b * cos[:, None]), -1).flatten(-2)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w

    x = t["token_embd.weight"][ids]
    for i in range(LAYERS):
        p = f"blk.{i}."
        h = rms(x, t[p + "attn_norm.weight"])
        q = rope((h @ t[p + "attn_q.weight"].T).view(T, H, HD)).transpose(0, 1)
        k = rope((h @ t[p + "attn_k.weight"].T).view(T, KV, HD)).transpose(0, 1).repeat_interleave(H // KV, 0)
        v = (h @ t[p + "attn_v.weight"].T).view(T, KV, HD).transpose(0, 1).repeat_interleave(H // KV, 0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(T, D)
        x = x + a @ t[p + "attn_output.weight"].T
        h = rms(x, t[p + "ffn_norm.weight"])
        x = x + (F.silu(h @ t[p + "ffn_gate.weight"].T) * (h @ t[p + "ffn_up.weight"].T)) @ t[p + "ffn_down.weight"].T
    return rms(x, t["output_norm.weight"]) @ t["token_embd.weight"].T


def logits_of(model, ids: list[int]) -> torch.Tensor:
    return model.net(torch.tensor([ids]), 1)[0].float()


PROMPT = "def fibonacci(n):\n    return"


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_1", "Q4_0"])
def test_gguf_logits_equal_a_plain_llama_forward_of_the_files_values(tmp_path, vocab, qtype):
    """Every type the reader decodes itself gives the file's values: F32 / F16 as stored, Q8_0 and Q4_1 dequantized
    to fp32 (the default), Q4_0 as TinyLoop int4 read as it is (weight-only products, so exact values)."""
    path = write(tmp_path / f"m-{qtype}.gguf", vocab, qtype)
    model = tinyloop.load_model(str(path), 128, act_quant=False)
    assert model.weights == ("int4" if qtype == "Q4_0" else "fp32")
    assert model.cfg.dense and model.cfg.n_core == LAYERS and model.cfg.tie_embeddings
    ids = model.codec.encode(PROMPT)
    got, want = logits_of(model, ids), reference_logits(path, ids)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    # cached greedy decode follows the full forward
    out = tinyloop.generate(model, ids, tinyloop.GenerateConfig(max_tokens=6, temperature=0.0, ignore_eos=True))
    seq = list(ids)
    for _ in range(6):
        seq.append(int(reference_logits(path, seq)[-1].argmax()))
    assert out.tokens == seq[len(ids):]


def test_q4_0_blocks_become_int4_without_a_detour(tmp_path, vocab):
    """A Q4_0 block and TinyLoop's int4 group of 32 pack the same way: the matrix's bytes are the file's."""
    path = write(tmp_path / "q4.gguf", vocab, "Q4_0")
    model = tinyloop.load_model(str(path), 64)
    raw = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.attn_output.weight")
    blocks = np.asarray(raw.data).reshape(-1, 18)
    held = model.net.quantized.core[0].wo
    assert held.fmt == "int4" and held.group == 32
    assert np.array_equal(held.data.numpy().reshape(-1, 16), blocks[:, 2:])
    assert np.array_equal(held.scale.numpy().reshape(-1), blocks[:, :2].copy().view(np.float16).reshape(-1).astype(np.float32))


def test_asked_format_requantizes_a_gguf(tmp_path, vocab):
    """Q4_1 asked as int4 is quantised again from its values (TinyLoop's int4 has no per-group minimum): it runs,
    close to the file's values, not equal."""
    path = write(tmp_path / "q41.gguf", vocab, "Q4_1")
    model = tinyloop.load_model(str(path), 64, weights="int4", act_quant=False)
    assert model.weights == "int4"
    ids = model.codec.encode(PROMPT)
    got, want = logits_of(model, ids), reference_logits(path, ids)
    assert 0 < (got - want).abs().max() < 0.25 * want.abs().max()


def test_gguf_tokenizer_and_chat(tmp_path, vocab):
    tok, tokens, _ = vocab
    model = tinyloop.load_model(str(write(tmp_path / "t.gguf", vocab)), 64)
    for text in TEXT[:2] + ["12 + 345 = x", "<|im_start|>user\nhi<|im_end|>"]:
        assert model.codec.encode(text) == tok.encode(text).ids
        assert model.codec.decode(model.codec.encode(text)) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    # the end-of-turn token ends generation (llama.cpp's EOT rule), the template comes from the file
    assert model.eos_id == tokens.index("<|im_end|>")
    text, ids = tinyloop.chat.chat_prompt(model, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" and ids[0] == tokens.index("<|im_start|>")


def test_dense_model_refuses_looped_features(tmp_path, vocab):
    model = tinyloop.load_model(str(write(tmp_path / "d.gguf", vocab)), 64)
    for cfg in (tinyloop.GenerateConfig(loops=2), tinyloop.GenerateConfig(early_exit_threshold=0.1)):
        with pytest.raises(tinyloop.ModeError, match="dense model"):
            tinyloop.generate(model, "def", cfg)
    with pytest.raises(tinyloop.ModeError, match="dense model"):
        tinyloop.generate_speculative(model, "def", tinyloop.SpeculativeConfig(draft_loops=1, verify_loops=2))
    assert len(tinyloop.generate(model, "def", tinyloop.GenerateConfig(max_tokens=3, loops=1)).tokens) <= 3


def test_bad_gguf_files_are_named(tmp_path, vocab):
    with pytest.raises(tinyloop.ArtifactError, match="architecture 'falcon' is not one TinyLoop loads"):
        tinyloop.load_model(str(write(tmp_path / "a.gguf", vocab, arch="falcon")))
    q8_1 = np.zeros((H * HD, D // 32 * 40), dtype=np.uint8)  # llama.cpp's activation type: never a weight's
    write(tmp_path / "c.gguf", vocab, raw={"blk.0.attn_q.weight": (q8_1, gguf.GGMLQuantizationType.Q8_1)})
    with pytest.raises(tinyloop.ArtifactError, match="blk.0.attn_q.weight has GGUF type Q8_1"):
        tinyloop.load_model(str(tmp_path / "c.gguf"))
    with pytest.raises(tinyloop.ArtifactError, match="unexpected tensor 'blk.0.attn_q_norm.weight'"):
        tinyloop.load_model(str(write(tmp_path / "e.gguf", vocab, extra={"blk.0.attn_q_norm.weight": np.ones(HD)})))
    with pytest.raises(tinyloop.ArtifactError, match="tokenizer.ggml.model 'llama'"):
        tinyloop.load_model(str(write(tmp_path / "f.gguf", vocab, tokenizer="llama")))
    (tmp_path / "g.gguf").write_bytes((tmp_path / "c.gguf").read_bytes()[:1000])
    with pytest.raises(tinyloop.ArtifactError, match="not a readable GGUF file"):
        tinyloop.load_model(str(tmp_path / "g.gguf"))


def test_cli_convert_inspect_and_generate_take_a_gguf(tmp_path, vocab):
    path = write(tmp_path / "c.gguf", vocab, "Q4_0", embed_type="Q8_0")
    run = [sys.executable, "-m", "scripts.cli"]
    out = subprocess.run(run + ["inspect", "--config-only", str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "dense" not in out.stderr and "n_core                 2" in out.stdout
    art = tmp_path / "c.tinyloop"
    out = subprocess.run(run + ["convert", str(path), str(art)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    a, b = tinyloop.load_model(str(path), 64), tinyloop.load_model(str(art), 64)
    assert b.weights == "int4"
    ids = a.codec.encode(PROMPT)
    assert torch.equal(logits_of(a, ids), logits_of(b, ids))
