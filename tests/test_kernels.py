"""Triton kernels (tinyloop/kernels) against their torch references, and generation through them.

Without a GPU the kernels run under TRITON_INTERPRET=1 (set below, before any kernel is decorated); with
one they compile. The interpreter is slow, so shapes are small and generations short.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import tinyloop  # noqa: E402
from tinyloop.cache import BlockPool, KVCache  # noqa: E402
from tinyloop.config import ModelConfig  # noqa: E402
from tinyloop.errors import ConfigError  # noqa: E402
from tinyloop.kernels import dispatch  # noqa: E402
from tinyloop.kernels.attention import decode_attention_ref, decode_attention_triton  # noqa: E402
from tinyloop.kernels.norm import add_rmsnorm_ref, add_rmsnorm_triton  # noqa: E402
from tinyloop.kernels.quant import write_tokens, write_tokens_ref  # noqa: E402
from tinyloop.kernels.rope import rope_ref, rope_triton  # noqa: E402
from tinyloop.model import LoopedLM  # noqa: E402

# tiny shapes: one intra-op thread (two stall on a busy machine: 0.2 s tests took 35 s with the other core taken)
pytestmark = pytest.mark.usefixtures("one_thread")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MODES = ("fp16", "int8", "int4")

# (n_heads, n_kv_heads, d_model, window, ring): GQA ratios 1, 2, 4; head dims 8 (padded), 24 (not a power
# of two), 32; rings that have wrapped, one holding more cells than the window (speculative decode's slack).
SHAPES = [(4, 4, 128, 0, 0), (4, 2, 96, 0, 0), (8, 2, 64, 5, 0), (4, 1, 128, 4, 6)]
LENGTHS = [5, 13, 1]  # lanes of different, odd lengths; 13 wraps every ring above


def filled_cache(mode: str, n_heads: int, n_kv: int, d: int, window: int, ring: int):
    """A cache whose lanes hold LENGTHS random tokens in slot 1, written one token at a time like decode."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=d, n_heads=n_heads, n_kv_heads=n_kv, ffn_hidden=32, n_prelude=1,
                      n_core=1, n_coda=0, max_loops=1, default_loops=1)
    net = LoopedLM(cfg, 32).to(DEV)
    attn = net.prelude[0].attn
    cache = KVCache(cfg, len(LENGTHS), 32, mode, device=DEV, window=window, ring=ring)
    cache.reset()
    with torch.no_grad():
        for lane, n in enumerate(LENGTHS):
            view = cache.lane_view(lane)
            for p in range(n):
                pos = torch.tensor([[p]], device=DEV)
                h = torch.randn(1, 1, d, device=DEV)
                step = net.make_step(pos, p + 1)
                k, v = attn.project_kv(h, step.cos, step.sin)
                write_tokens_ref(view, 1, pos, h, k, v)
    return net, attn, cache


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}w{s[3]}r{s[4]}")
def test_decode_attention_matches_reference(mode, shape):
    n_heads, n_kv, d, window, ring = shape
    net, attn, cache = filled_cache(mode, n_heads, n_kv, d, window, ring)
    pos = torch.tensor(LENGTHS, device=DEV) - 1
    q = torch.randn(len(LENGTHS), n_heads, d // n_heads, device=DEV)
    n_cells = cache.ring if window else max(LENGTHS)
    kw = dict(mode=mode, window=window, cell_pos=cache.cell_pos, wk=attn.wk.weight, wv=attn.wv.weight,
              rope_cos=net.rope_cos, rope_sin=net.rope_sin)
    with torch.no_grad():
        want = decode_attention_ref(q, cache.store, cache.table, 1, pos, n_cells, **kw)
        got = decode_attention_triton(q, cache.store, cache.table, 1, pos, n_cells, **kw)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    if window:  # the window really excluded something: lane 1 wrote 13 tokens into a smaller ring
        assert (cache.cell_pos[1, 1] >= 0).sum() == cache.ring < 13


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", (0, 6))
def test_decode_attention_reads_scattered_blocks(mode, window, monkeypatch):
    """Lanes whose blocks lie anywhere in the pool are read as the tokens they were given: allocations interleaved
    across lanes a few tokens at a time, and a lane that took another's blocks (reorder_lanes, as beam search does) and
    copied the one it then wrote into (copy-on-write). Tokens go in through the write kernels; reference and
    kernel reads both match attention computed directly from each lane's own tokens, which knows nothing of
    blocks. Blocks of 4 tokens keep the sequences short (interpreted kernels) and try another block size."""
    from tinyloop.cache import decode_entries, encode_entries
    torch.manual_seed(4)
    cfg = ModelConfig(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=32, n_prelude=1, n_core=1,
                      n_coda=0, max_loops=1, default_loops=1)
    net = LoopedLM(cfg, 64).to(DEV)
    attn = net.prelude[0].attn
    pool = BlockPool(cfg, mode, 64, device=DEV, block_tokens=4)
    cache = KVCache(cfg, 3, 16, mode, device=DEV, window=window, pool=pool)
    lengths = [11, 9, 6]  # 2-3 blocks per lane; 11 and 9 wrap the ring of 6 (two blocks, the second half used)
    written = [[] for _ in lengths]  # per lane: chunks of h [1, T, d], positions 0, 1, ... in order

    def put(lane: int, lo: int, hi: int) -> None:  # positions lo..hi-1 in one write
        h, pos = torch.randn(1, hi - lo, 64, device=DEV), torch.arange(lo, hi, device=DEV).unsqueeze(0)
        step = net.make_step(pos)
        write_tokens(cache.lane_view(lane), 1, pos, h, *attn.project_kv(h, step.cos, step.sin))
        written[lane].append(h)

    monkeypatch.setenv("TINYLOOP_TRITON", "1")  # int8 / int4: the quantise-on-write kernels
    with torch.no_grad():
        for p in range(0, max(lengths), 3):  # 3 tokens per lane in turn: each lane's blocks alternate with the others'
            for lane, n in enumerate(lengths):
                if p < n:
                    put(lane, p, min(p + 3, n))
        cache.reorder_lanes(torch.tensor([1, 1, 2]))  # lane 0 shares lane 1's blocks ...
        written[0] = list(written[1])
        put(0, 9, 10)  # ... and copies before writing: lane 1 must keep its own cell
        blocks = cache.table[1, 0, :len(cache.held[1][0])]
        assert (blocks[1:] != blocks[:-1] + 1).any(), blocks  # lane 0's blocks are not one run in the pool
        # only the block written into was copied; a ring prepares all its cells, so it copied every block
        assert (cache.held[1][0][0] == cache.held[1][1][0]) == (window == 0)

        B, n_heads, hd = 3, cfg.n_heads, cfg.head_dim
        pos = torch.tensor([sum(h.shape[1] for h in hs) - 1 for hs in written], device=DEV)
        q = torch.randn(B, n_heads, hd, device=DEV)
        want = []
        for lane, hs in enumerate(written):
            h = torch.cat(hs, dim=1)  # [1, n, d]
            kpos = torch.arange(h.shape[1], device=DEV).unsqueeze(0)
            step = net.make_step(kpos)
            keys, values = decode_entries(mode, encode_entries(mode, h, *attn.project_kv(h, step.cos, step.sin)),
                                          torch.float32, lambda hh: attn.project_kv(hh, step.cos, step.sin))
            seen = kpos > pos[lane] - window if window else kpos >= 0
            want.append(torch.nn.functional.scaled_dot_product_attention(
                q[lane:lane + 1, :, None], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=seen[:, None, None],
                enable_gqa=True)[:, :, 0])
        want = torch.cat(want)
        kw = dict(mode=mode, window=window, cell_pos=cache.cell_pos, wk=attn.wk.weight, wv=attn.wv.weight,
                  rope_cos=net.rope_cos, rope_sin=net.rope_sin)
        n_cells = cache.ring if window else int(pos.max()) + 1
        ref = decode_attention_ref(q, cache.store, cache.table, 1, pos, n_cells, **kw)
        got = decode_attention_triton(q, cache.store, cache.table, 1, pos, n_cells, **kw)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_decode_attention_reference_matches_cache_update():
    """The reference reads the layout the way KVCache.update + SDPA do (here: int8, wrapped window)."""
    net, attn, cache = filled_cache("int8", 8, 2, 64, 5, 0)
    B = len(LENGTHS)
    pos = torch.tensor(LENGTHS, device=DEV).unsqueeze(1)
    h = torch.randn(B, 1, 64, device=DEV)
    with torch.no_grad():
        step = net.make_step(pos, int(pos.max()) + 1)
        q = attn.wq(h).view(B, 1, 8, 8)
        from tinyloop.model import apply_rope
        q = apply_rope(q, step.cos, step.sin)
        k, v = attn.project_kv(h, step.cos, step.sin)
        keys, values, mask = cache.update(attn, 1, step, h, k, v)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, enable_gqa=True)[:, :, 0]
        got = decode_attention_ref(q[:, 0], cache.store, cache.table, 1, pos[:, 0], cache.ring, mode="int8", window=5,
                                   cell_pos=cache.cell_pos)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ("int8", "int4"))
@pytest.mark.parametrize("window", (0, 3))
def test_quantise_on_write_writes_the_same_bytes(mode, window, monkeypatch):
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=32, n_prelude=1, n_core=1,
                      n_coda=0, max_loops=1, default_loops=1)
    caches = [KVCache(cfg, 3, 16, mode, device=DEV, window=window) for _ in range(2)]
    B, T = 3, 3 if window else 5
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [2, 3, 4, 5, 6]], device=DEV)[:, :T]
    h = torch.randn(B, T, 64, device=DEV) * 3
    k = torch.randn(B, T, 2, 16, device=DEV)
    # exact halves of the step: round half to even must agree with torch.round
    k[0, 0, 0] = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, 126.5] * 2)
    h[0, 0, :32] = torch.tensor([7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -3.5, 6.5] * 4)
    v = torch.randn(B, T, 2, 16, device=DEV)
    write_tokens_ref(caches[0], 1, pos, h, k, v)
    monkeypatch.setenv("TINYLOOP_TRITON", "1")
    write_tokens(caches[1], 1, pos, h, k, v)
    for name in caches[0].store:  # through the tables: blocks nobody took are uninitialised pool memory
        assert torch.equal(caches[0].dense(name), caches[1].dense(name)), name
    assert caches[0].blocks_held() > 0
    if window:
        assert torch.equal(caches[0].cell_pos, caches[1].cell_pos)


@pytest.mark.parametrize("d", (64, 48))
def test_add_rmsnorm_matches_reference(d):
    torch.manual_seed(2)
    x, r, w = torch.randn(3, 5, d, device=DEV), torch.randn(3, 5, d, device=DEV), torch.randn(d, device=DEV)
    for res in (r, None):
        want = add_rmsnorm_ref(x, res, w, 1e-5)
        got = add_rmsnorm_triton(x, res, w, 1e-5)
        torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads, hd", ((4, 16), (3, 24)))
def test_rope_matches_reference(heads, hd):
    torch.manual_seed(3)
    net = LoopedLM(ModelConfig(d_model=heads * hd, n_heads=heads, n_kv_heads=1, vocab_size=64), 64).to(DEV)
    x = torch.randn(2, 3, heads, hd, device=DEV)
    pos = torch.tensor([[0, 1, 2], [40, 17, 63]], device=DEV)
    torch.testing.assert_close(rope_triton(x, pos, net.rope_cos, net.rope_sin),
                               rope_ref(x, pos, net.rope_cos, net.rope_sin), atol=1e-6, rtol=1e-6)


def test_dispatch_defaults_and_errors(monkeypatch):
    monkeypatch.delenv("TINYLOOP_TRITON", raising=False)
    assert dispatch.use_triton(torch.device("cpu")) is False  # CPU default: the torch path
    monkeypatch.setenv("TINYLOOP_TRITON", "0")
    assert dispatch.use_triton(torch.device("cuda")) is False
    monkeypatch.setenv("TINYLOOP_TRITON", "yes")
    with pytest.raises(ConfigError, match="TINYLOOP_TRITON"):
        dispatch.use_triton(torch.device("cpu"))
    monkeypatch.setenv("TINYLOOP_TRITON", "1")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        dispatch.use_triton(torch.device("cpu"))


@pytest.mark.parametrize("mode, window", (("fp16", 0), ("int8", 4), ("int4", 0)))
def test_greedy_generation_through_triton_equals_torch(make_artifact, monkeypatch, mode, window):
    """Greedy decode with every attention step in the Triton kernels gives the torch path's tokens."""
    path = make_artifact(n_core=1, max_loops=4, default_loops=2)
    model = tinyloop.load_model(path, 64, device=DEV, dtype=torch.float32, cache_mode=mode)
    cfg = tinyloop.GenerateConfig(max_tokens=8, loops=2, cache_window=window)
    monkeypatch.setenv("TINYLOOP_TRITON", "0")
    want = tinyloop.generate(model, "def add(a", cfg)
    monkeypatch.setenv("TINYLOOP_TRITON", "1")
    calls = []
    import tinyloop.kernels.attention as attention
    real = attention.decode_attention_triton
    monkeypatch.setattr(attention, "decode_attention_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = tinyloop.generate(model, "def add(a", cfg)
    assert got.tokens == want.tokens and len(got.tokens) == 8
    assert len(calls) == 7 * 4  # 7 decode steps x (prelude + 2 loops x 1 core + coda) slots


# --- the lean decode step (tinyloop/kernels/lean.py) -------------------------------------------------------
ARCHS = [dict(), dict(injection="add", sandwich_norm=True, tie_embeddings=False, state_init="normal", n_prelude=0,
                      n_coda=2, n_kv_heads=1),
         dict(injection="none", state_init="embed", n_kv_heads=4, ffn_hidden=200)]


def decode_both_ways(cfg: ModelConfig, mode: str, window: int, lengths: list[int], steps: int = 4, loops: int = 3,
                     ways: tuple[bool, ...] = (False, True)):
    """Logits of `steps` greedy lockstep decode steps over lanes of different lengths, plain path vs lean."""
    from tinyloop.kernels.lean import decode_forward, set_enabled
    torch.manual_seed(0)
    net = LoopedLM(cfg, 64).to(DEV).eval().requires_grad_(False)
    runs = []
    for lean in ways:
        set_enabled(lean)
        try:
            cache = KVCache(cfg, len(lengths), 64, mode, device=DEV, window=window)
            cache.reset()
            gen = torch.Generator().manual_seed(1)
            with torch.inference_mode():
                for lane, n in enumerate(lengths):  # per-lane prefill, as generate_batch does
                    ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(DEV)
                    net(ids, loops, net.make_step(torch.arange(n, device=DEV).unsqueeze(0), n), cache.lane_view(lane))
                pos = torch.tensor(lengths, device=DEV).unsqueeze(1)
                tok = torch.randint(0, cfg.vocab_size, (len(lengths), 1), generator=gen).to(DEV)
                out = []
                for _ in range(steps):
                    logits = decode_forward(net, tok, loops, net.make_step(pos, int(pos.max()) + 1), cache)
                    out.append(logits)
                    tok, pos = logits.argmax(-1), pos + 1
        finally:
            set_enabled(None)
        runs.append(torch.stack(out))
    return runs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", range(len(ARCHS)))
def test_lean_step_equals_plain_path(mode, arch, monkeypatch):
    monkeypatch.setenv("TINYLOOP_TRITON", "0")
    cfg = ModelConfig(**{**dict(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, n_core=2,
                                max_loops=3), **ARCHS[arch]})
    # [4, 4, 4]: lanes in lockstep, where the step writes the cache by slice and SDPA runs without a mask
    for window, lengths in ((0, [1]), (0, [9, 2, 5]), (0, [4, 4, 4]), (4, [9, 2, 5])):
        plain, lean = decode_both_ways(cfg, mode, window, lengths)
        assert torch.equal(plain.argmax(-1), lean.argmax(-1))
        # the same operations in the same order: on CPU the bits agree (tolerance for other BLAS builds)
        torch.testing.assert_close(lean, plain, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_packed_weights_keep_the_plain_greedy_tokens(mode, monkeypatch):
    """TINYLOOP_LEAN_WEIGHTS=packed: fp32 matmuls on pre-transposed (1 lane) or oneDNN-blocked (more lanes)
    copies of the weights, RoPE as a product with a rotation matrix. The sums run in another order, so close to
    the plain path rather than bit-equal."""
    monkeypatch.setenv("TINYLOOP_TRITON", "0")
    monkeypatch.setenv("TINYLOOP_LEAN_WEIGHTS", "packed")
    exact_products = []
    real = torch.nn.functional.linear
    # the lean step multiplies rows [B, d]; the plain path (prefill) and the int4 recompute multiply [B, T, d]
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, w, b=None: exact_products.append(x.shape) if x.dim() == 2 else real(x, w, b))
    for arch in ARCHS:
        cfg = ModelConfig(**{**dict(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, n_core=2,
                                    max_loops=3), **arch})
        for window, lengths in ((0, [1]), (0, [4, 4, 4]), (0, [9, 2, 5]), (4, [9, 2, 5])):
            plain, packed = decode_both_ways(cfg, mode, window, lengths)
            assert torch.equal(plain.argmax(-1), packed.argmax(-1))
            # quantised caches: a last-bit difference in K or V can move a value across an int8/int4 rounding
            # boundary, one quantisation step
            torch.testing.assert_close(packed, plain, atol=1e-5 if mode == "fp16" else 1e-3, rtol=1e-4)
            assert not torch.equal(packed, plain)  # the packed step ran: other summation order, other last bits
    assert exact_products == []  # every product of every lean step went through the packed copies


def test_rotation_matrix_is_the_rotation():
    from tinyloop.kernels.lean import rope_factors, rotate, rotation_matrices
    net = LoopedLM(ModelConfig(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96), 64)
    pos = torch.tensor([[0], [7], [63]])
    cos2, sin2 = rope_factors(*net.make_step(pos).rope_at(pos))  # [3, 1, 1, hd]
    x = torch.randn(3, 6, 16)
    want = rotate(x.unsqueeze(1), cos2, sin2)[:, 0]
    torch.testing.assert_close(torch.bmm(x, rotation_matrices(cos2[:, 0, 0], sin2[:, 0, 0])), want)


def test_weight_layout_settings(monkeypatch):
    from tinyloop.kernels import lean
    monkeypatch.delenv("TINYLOOP_LEAN_WEIGHTS", raising=False)
    assert lean.layout() == "exact"
    monkeypatch.setenv("TINYLOOP_LEAN_WEIGHTS", "packed")
    assert lean.layout() == "packed"
    lean.set_layout("exact")
    try:
        assert lean.layout() == "exact"
    finally:
        lean.set_layout(None)
    monkeypatch.setenv("TINYLOOP_LEAN_WEIGHTS", "bf16")
    with pytest.raises(ConfigError, match="TINYLOOP_LEAN_WEIGHTS"):
        lean.layout()
    with pytest.raises(ConfigError, match="layout"):
        lean.set_layout("int8")


@pytest.mark.parametrize("mode", ("int8", "int4"))
def test_lean_step_through_triton_kernels_matches(mode, monkeypatch):
    """The lean step's kernel path (fused norm, RoPE, quantise-on-write, attention), ring wrapped."""
    cfg = ModelConfig(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, n_core=1, max_loops=2,
                      sandwich_norm=mode == "int8")
    monkeypatch.setenv("TINYLOOP_TRITON", "0")
    plain, = decode_both_ways(cfg, mode, 4, [6, 2], steps=3, loops=2, ways=(False,))
    monkeypatch.setenv("TINYLOOP_TRITON", "1")
    lean, = decode_both_ways(cfg, mode, 4, [6, 2], steps=3, loops=2, ways=(True,))
    assert torch.equal(plain.argmax(-1), lean.argmax(-1))
    torch.testing.assert_close(lean, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_generate_is_token_identical_with_and_without_lean_step(make_artifact, mode, monkeypatch):
    from tinyloop.kernels.lean import set_enabled
    monkeypatch.setenv("TINYLOOP_TRITON", "0")
    model = tinyloop.load_model(make_artifact(), 128, device=DEV, dtype=torch.float32, cache_mode=mode)
    results = []
    for lean in (False, True):
        set_enabled(lean)
        try:
            results.append([tinyloop.generate(model, p, tinyloop.GenerateConfig(max_tokens=24, loops=l, cache_window=w)).tokens
                            for p, l, w in (("def add(a, b):", 4, 0), ("import os", 2, 6))])
        finally:
            set_enabled(None)
    assert results[0] == results[1]
    assert all(len(t) > 0 for t in results[0])


def test_decode_threads_policy(monkeypatch):
    from tinyloop.kernels.lean import decode_threads
    monkeypatch.delenv("TINYLOOP_DECODE_THREADS", raising=False)
    small, big = ModelConfig(d_model=256), ModelConfig(d_model=768, n_heads=12, n_kv_heads=4)
    assert decode_threads(1, small) == 1 and decode_threads(16, small) == 0 and decode_threads(1, big) == 0
    monkeypatch.setenv("TINYLOOP_DECODE_THREADS", "3")
    assert decode_threads(1, small) == 3
    monkeypatch.setenv("TINYLOOP_DECODE_THREADS", "many")
    with pytest.raises(ConfigError, match="TINYLOOP_DECODE_THREADS"):
        decode_threads(1, small)


@pytest.mark.parametrize("layout", ("exact", "packed"))
def test_lean_step_follows_weight_updates(layout, monkeypatch):
    """The fused (and packed) weight copies are rebuilt when the model's parameters change in place."""
    monkeypatch.setenv("TINYLOOP_TRITON", "0")
    monkeypatch.setenv("TINYLOOP_LEAN_WEIGHTS", layout)
    from tinyloop.kernels.lean import lean_step
    cfg = ModelConfig(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, n_core=1, max_loops=2)
    torch.manual_seed(0)
    net = LoopedLM(cfg, 16).eval().requires_grad_(False)
    ids, pos = torch.tensor([[5]]), torch.tensor([[0]])
    with torch.inference_mode():
        lean_step(net).forward(ids, 2, net.make_step(pos, 1), KVCache(cfg, 1, 16))
        net.core[0].mlp.w_up.weight.mul_(3.0)
        want = net(ids, 2, net.make_step(pos, 1), KVCache(cfg, 1, 16))
        got = lean_step(net).forward(ids, 2, net.make_step(pos, 1), KVCache(cfg, 1, 16))
    torch.testing.assert_close(got, want, atol=1e-6 if layout == "exact" else 1e-5, rtol=1e-6 if layout == "exact" else 1e-4)


def test_cuda_graph_step_body_reads_full_length_correctly(monkeypatch):
    """What CudaGraphStep captures, run eagerly: Step.end fixed at the cache's full length (shapes never change
    between replays) and the kernels follow each lane's own length from the positions on the device."""
    from tinyloop.kernels.lean import CudaGraphStep
    cfg = ModelConfig(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, n_core=1, max_loops=2)
    monkeypatch.setenv("TINYLOOP_TRITON", "0")
    plain, = decode_both_ways(cfg, "int8", 0, [6, 2], steps=1, loops=2, ways=(False,))
    torch.manual_seed(0)
    net = LoopedLM(cfg, 64).to(DEV).eval().requires_grad_(False)
    cache = KVCache(cfg, 2, 64, "int8", device=DEV)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for lane, n in enumerate([6, 2]):
            ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(DEV)
            net(ids, 2, net.make_step(torch.arange(n, device=DEV).unsqueeze(0), n), cache.lane_view(lane))
        tok = torch.randint(0, cfg.vocab_size, (2, 1), generator=gen).to(DEV)
        monkeypatch.setenv("TINYLOOP_TRITON", "1")
        graph_step = CudaGraphStep(net, cache, 2, 2)
        graph_step.ids.copy_(tok)
        graph_step.pos.copy_(torch.tensor([[6], [2]]))
        got = graph_step._step()
    torch.testing.assert_close(got, plain[0], atol=1e-5, rtol=1e-5)
