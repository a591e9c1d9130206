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
from tinyloop.model import LoopedLM, quantize_weights  # noqa: E402
from tinyloop.rotary import apply_rope  # noqa: E402

# tiny shapes: one intra-op thread (two stall on a busy machine: 0.2 s tests took 35 s with the other core taken)
pytestmark = pytest.mark.usefixtures("one_thread")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MODES = ("fp16", "int8", "int4")

# (n_heads, n_kv_heads, d_model, window, ring): GQA ratios 1, 2, 4; head dims 8 (padded), 24 (not a power
# of two), 32; rings that have wrapped, one holding more cells than the window (speculative decode's slack).
SHAPES = [(4, 4, 128, 0, 0), (4, 2, 96, 0, 0), (8, 2, 64, 5, 0), (4, 1, 128, 4, 6)]
LENGTHS = [5, 13, 1]  # lanes of different, odd lengths; 13 wraps every ring above


def project_kv(attn, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K (rotated) and V of attention inputs h [B, T, d], straight from the module's weights."""
    B, T, _ = h.shape
    hd = cos.shape[-1] * 2
    k = attn.wk(h).view(B, T, -1, hd)
    return apply_rope(k, cos, sin), attn.wv(h).view(B, T, -1, hd)


def filled_cache(mode: str, n_heads: int, n_kv: int, d: int, window: int, ring: int):
    """A cache whose lanes hold LENGTHS random tokens in slot 1, written one token at a time like decode."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=d, n_heads=n_heads, n_kv_heads=n_kv, ffn_hidden=32, n_prelude=1,
                      n_core=1, n_coda=0, max_loops=1, default_loops=1)
    net = LoopedLM(cfg, 32).to(DEV)
    attn = net.prelude[0].attn
    cache = KVCache(cfg, len(LENGTHS), 32, mode, device=DEV, window=window, ring=ring)
    cache.reset()
    cache.reserve_all()
    with torch.no_grad():
        for lane, n in enumerate(LENGTHS):
            view = cache.lane_view(lane)
            for p in range(n):
                pos = torch.tensor([[p]], device=DEV)
                h = torch.randn(1, 1, d, device=DEV)
                step = net.make_step(pos, p + 1)
                k, v = project_kv(attn, h, step.cos, step.sin)
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
        cache.lane_view(lane).take_blocks([(1, [0], [lo], [hi - 1])])  # (copying a shared block: copy-on-write)
        write_tokens(cache.lane_view(lane), 1, pos, h, *project_kv(attn, h, step.cos, step.sin))
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
            keys, values = decode_entries(mode, encode_entries(mode, h, *project_kv(attn, h, step.cos, step.sin)),
                                          torch.float32, lambda hh: project_kv(attn, hh, step.cos, step.sin))
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


def test_decode_attention_reference_matches_the_cached_step():
    """The reference reads the layout the way the cached step's torch path (gather + SDPA) does (here: int8,
    wrapped window)."""
    from tinyloop.engine import forward as paged
    from tinyloop.model import fused_weights
    net, attn, cache = filled_cache("int8", 8, 2, 64, 5, 0)
    B = len(LENGTHS)
    pos = torch.tensor(LENGTHS, device=DEV).unsqueeze(1)
    h = torch.randn(B, 1, 64, device=DEV)
    with torch.no_grad():
        step = net.make_step(pos, int(pos.max()) + 1)
        q = apply_rope(attn.wq(h).view(B, 1, 8, 8), step.cos, step.sin)
        k, v = project_kv(attn, h, step.cos, step.sin)
        ctx = paged.Cached(net, cache, step, fused_weights(net), triton=False)
        want = ctx.attend(fused_weights(net).core[0], 1, q, h, k, v)[:, :, 0]
        got = decode_attention_ref(q[:, 0], cache.store, cache.table, 1, pos[:, 0], cache.ring, mode="int8", window=5,
                                   cell_pos=cache.cell_pos)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ("int8", "int4"))
@pytest.mark.parametrize("window", (0, 3))
def test_quantise_on_write_writes_the_same_bytes(mode, window, monkeypatch):
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=64, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=32, n_prelude=1, n_core=1,
                      n_coda=0, max_loops=1, default_loops=1)
    caches = [KVCache(cfg, 3, 16, mode, device=DEV, window=window).reserve_all() for _ in range(2)]
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


# --- the cached step (tinyloop/engine/forward.py): the model's one forward over the paged cache ------------------
ARCHS = [dict(), dict(injection="add", sandwich_norm=True, tie_embeddings=False, state_init="normal", n_prelude=0,
                      n_coda=2, n_kv_heads=1),
         dict(injection="none", state_init="embed", n_kv_heads=4, ffn_hidden=200)]
SMALL = dict(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, n_core=2, max_loops=3)


def small_net(cfg: ModelConfig) -> LoopedLM:
    torch.manual_seed(0)
    return LoopedLM(cfg, 64).to(DEV).eval().requires_grad_(False)


def cached_decode(cfg: ModelConfig, mode: str, window: int, lengths: list[int], steps: int = 4, loops: int = 3,
                  weights: str = "fp32") -> tuple[torch.Tensor, list[list[int]]]:
    """Per-lane prefill of random prompts, then `steps` greedy lockstep decode steps over lanes of different lengths,
    all through engine.forward.forward, the model's matrices in format `weights`: the logits [steps, B, 1, V] and each
    lane's tokens (prompt + decoded)."""
    from tinyloop.engine import forward as step
    net = small_net(cfg)
    quantize_weights(net, weights, 32)
    cache = KVCache(cfg, len(lengths), 64, mode, device=DEV, window=window).reserve_all()
    gen = torch.Generator().manual_seed(1)
    seqs = []
    with torch.inference_mode():
        for lane, n in enumerate(lengths):  # per-lane prefill, as generate_batch does
            ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(DEV)
            seqs.append(ids[0].tolist())
            step.forward(net, ids, loops, net.make_step(torch.arange(n, device=DEV).unsqueeze(0), n),
                         cache.lane_view(lane))
        pos = torch.tensor(lengths, device=DEV).unsqueeze(1)
        tok = torch.randint(0, cfg.vocab_size, (len(lengths), 1), generator=gen).to(DEV)
        out = []
        for _ in range(steps):
            for seq, t in zip(seqs, tok[:, 0].tolist()):
                seq.append(t)
            logits = step.forward(net, tok, loops, net.make_step(pos, int(pos.max()) + 1), cache)
            out.append(logits)
            tok, pos = logits.argmax(-1), pos + 1
    return torch.stack(out), seqs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", range(len(ARCHS)))
def test_cached_decode_equals_one_chunk_over_the_whole_sequence(mode, arch, monkeypatch):
    """Prefill chunks then decode rows through the paged cache give the logits of one chunk over each lane's whole
    sequence through a fresh cache of the same mode (which stores and reads the same rounded entries), and in the
    fp16 mode also those of the cache-free forward (the model's Dense context; with a window, its windowed mask).
    Ragged lanes, lanes in lockstep (SDPA runs without a mask), one lane, a wrapped ring; 20 steps cross block
    boundaries, where the decode rows' read-ahead buffer, kept from step to step, is gathered again."""
    from tinyloop.engine import forward as paged
    monkeypatch.setenv("TINYLOOP_TRITON", "0")
    cfg = ModelConfig(**{**SMALL, **ARCHS[arch]})
    net = small_net(cfg)
    # quantised caches: a last-bit difference in K or V can move a value across a rounding boundary
    tol = dict(atol=2e-5, rtol=1e-5) if mode == "fp16" else dict(atol=2e-3, rtol=1e-3)
    for window, lengths in ((0, [1]), (0, [9, 2, 5]), (0, [4, 4, 4]), (4, [9, 2, 5])):
        steps = 20
        logits, seqs = cached_decode(cfg, mode, window, lengths, steps)
        with torch.inference_mode():
            for lane, (n, seq) in enumerate(zip(lengths, seqs)):
                T, x = len(seq), torch.tensor([seq], device=DEV)
                step = net.make_step(torch.arange(T, device=DEV).unsqueeze(0), T)
                chunk = paged.forward(net, x, 3, step, KVCache(cfg, 1, 64, mode, device=DEV, window=window).reserve_all())[0]
                torch.testing.assert_close(logits[:, lane, 0], chunk[n:n + steps], **tol)
                if mode == "fp16":
                    full = net(x, 3, net.make_step(step.pos, T, window))[0]
                    torch.testing.assert_close(logits[:, lane, 0], full[n:n + steps], **tol)


@pytest.mark.parametrize("fmt", ("bf16", "int8", "int4"))
def test_cached_step_multiplies_through_the_weight_format(fmt, monkeypatch):
    """A model whose matrices are held in a weight format: prefill chunks and decode rows through the paged cache
    (CPU kernels for few rows, torch above) give the logits of the cache-free forward of the same quantised model
    (formats.reference_linear: x @ dequantize(W).T), to fp32 rounding; and they differ from the fp32 model's by the
    format's quantisation error, so the quantised matrices are what ran."""
    monkeypatch.setenv("TINYLOOP_TRITON", "0")
    cfg = ModelConfig(**{**SMALL, **ARCHS[0]})
    fp32, _ = cached_decode(cfg, "fp16", 0, [9, 2, 5], steps=6)
    logits, seqs = cached_decode(cfg, "fp16", 0, [9, 2, 5], steps=6, weights=fmt)
    net = small_net(cfg)
    quantize_weights(net, fmt, 32)
    with torch.inference_mode():
        for lane, (n, seq) in enumerate(zip([9, 2, 5], seqs)):
            full = net(torch.tensor([seq], device=DEV), 3)[0]
            torch.testing.assert_close(logits[:, lane, 0], full[n:n + 6], atol=1e-4, rtol=1e-4)
    first = float((logits[0] - fp32[0]).abs().max())  # the first step reads the same tokens in both
    assert 0 < first < {"bf16": 0.05, "int8": 0.1, "int4": 1.0}[fmt]


@pytest.mark.parametrize("mode", ("int8", "int4"))
def test_decode_through_triton_kernels_matches_torch(mode, monkeypatch):
    """Decode rows through the kernel path (norm, RoPE, quantise-on-write, attention over block tables), ring wrapped,
    against the same decode through torch."""
    cfg = ModelConfig(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, n_core=1, max_loops=2,
                      sandwich_norm=mode == "int8")
    monkeypatch.setenv("TINYLOOP_TRITON", "0")
    plain, _ = cached_decode(cfg, mode, 4, [6, 2], steps=3, loops=2)
    monkeypatch.setenv("TINYLOOP_TRITON", "1")
    kernels, _ = cached_decode(cfg, mode, 4, [6, 2], steps=3, loops=2)
    assert torch.equal(plain.argmax(-1), kernels.argmax(-1))
    torch.testing.assert_close(kernels, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ("int8", "int4"))
def test_decode_through_triton_kernels_with_quantised_weights(fmt, monkeypatch):
    """A model holding its matrices in a weight format decodes rows through the kernel path too: the attention
    kernel's view of the k|v rows (engine/forward.py's _KVProxy) once sliced the matrix as a tensor, and a quantised
    matrix (formats.QMatrix) is not one (TypeError). Same tokens and logits as the torch path of the same model."""
    cfg = ModelConfig(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, n_core=1, max_loops=2)
    monkeypatch.setenv("TINYLOOP_TRITON", "0")
    plain, _ = cached_decode(cfg, "int8", 0, [6, 2], steps=3, loops=2, weights=fmt)
    monkeypatch.setenv("TINYLOOP_TRITON", "1")
    kernels, _ = cached_decode(cfg, "int8", 0, [6, 2], steps=3, loops=2, weights=fmt)
    assert torch.equal(plain.argmax(-1), kernels.argmax(-1))
    torch.testing.assert_close(kernels, plain, atol=1e-4, rtol=1e-4)


def test_decode_threads_policy(monkeypatch):
    from tinyloop.kernels import cpu
    from tinyloop.engine.forward import decode_threads
    monkeypatch.delenv("TINYLOOP_DECODE_THREADS", raising=False)
    small, big = ModelConfig(d_model=256), ModelConfig(d_model=768, n_heads=12, n_kv_heads=4)
    assert decode_threads(1, small) == 1 and decode_threads(16, small) == 0 and decode_threads(1, big) == 0
    # decode rows whose blocks run as C calls keep torch's threads (one OpenMP team per block)
    assert decode_threads(1, small, KVCache(small, 1, 16, "fp16")) == (0 if cpu.available() else 1)
    assert decode_threads(1, small, KVCache(small, 1, 16, "int8")) == 1
    monkeypatch.setenv("TINYLOOP_DECODE_THREADS", "3")
    assert decode_threads(1, small) == 3
    monkeypatch.setenv("TINYLOOP_DECODE_THREADS", "many")
    with pytest.raises(ConfigError, match="TINYLOOP_DECODE_THREADS"):
        decode_threads(1, small)


def test_cached_step_follows_weight_updates(monkeypatch):
    """The fused weights are rebuilt when the model's parameters change in place."""
    monkeypatch.setenv("TINYLOOP_TRITON", "0")
    from tinyloop.engine import forward as step
    cfg = ModelConfig(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, n_core=1, max_loops=2)
    net = small_net(cfg)
    ids, pos = torch.tensor([[5]]), torch.tensor([[0]])
    with torch.inference_mode():
        step.forward(net, ids, 2, net.make_step(pos, 1), KVCache(cfg, 1, 16).reserve_all())
        net.core[0].mlp.w_up.weight.mul_(3.0)
        want = net(ids, 2, net.make_step(pos, 1))  # the cache-free forward reads the parameters as they are now
        got = step.forward(net, ids, 2, net.make_step(pos, 1), KVCache(cfg, 1, 16).reserve_all())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_cuda_graph_step_body_reads_full_length_correctly(monkeypatch):
    """What CudaGraphStep captures, run eagerly: Step.end fixed at the cache's full length (shapes never change
    between replays) and the kernels follow each lane's own length from the positions on the device."""
    from tinyloop.engine import forward as step
    cfg = ModelConfig(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, n_core=1, max_loops=2)
    monkeypatch.setenv("TINYLOOP_TRITON", "0")
    plain, _ = cached_decode(cfg, "int8", 0, [6, 2], steps=1, loops=2)
    net = small_net(cfg)
    cache = KVCache(cfg, 2, 64, "int8", device=DEV).reserve_all()
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for lane, n in enumerate([6, 2]):
            ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(DEV)
            step.forward(net, ids, 2, net.make_step(torch.arange(n, device=DEV).unsqueeze(0), n), cache.lane_view(lane))
        tok = torch.randint(0, cfg.vocab_size, (2, 1), generator=gen).to(DEV)
        monkeypatch.setenv("TINYLOOP_TRITON", "1")
        graph_step = step.CudaGraphStep(net, cache, 2, 2)
        graph_step.ids.copy_(tok)
        graph_step.pos.copy_(torch.tensor([[6], [2]]))
        graph_step.require()
        got = step.loop_range(net, graph_step._context(), 0, 2, None, graph_step.ids)
    torch.testing.assert_close(got, plain[0], atol=1e-5, rtol=1e-5)
