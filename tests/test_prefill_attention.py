"""tinyloop/kernels/cpu_attention.c: a prefill chunk's causal attention straight over the paged cache, against the
torch path it replaces (the lanes' cells gathered out of the blocks, SDPA with the boolean mask), alone and in a
model's cached prefill."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tinyloop
from tinyloop.cache import KVCache
from tinyloop.config import ModelConfig
from tinyloop.engine import forward as paged
from tinyloop.kernels import cpu
from tinyloop.model import LoopedLM


def paged_inputs(B: int, T: int, H: int, KV: int, hd: int, starts: list[int], bt: int = 16, seed: int = 0, pos=None):
    """q (a strided view of a qkv tensor, as the model passes it), a pool's k / v stores holding random values in
    every cell (so cells a row may not see hold something), lane tables over shuffled blocks (a lane's row of a
    3-D slot x lane x block table), positions [B, T]."""
    g = torch.Generator().manual_seed(seed)
    if pos is None:
        pos = torch.stack([torch.arange(s, s + T) for s in starts])
    end = int(pos.max()) + 1
    nb = -(-end // bt) + 1
    k, v = (torch.randn(B * nb + 1, bt, KV, hd, generator=g) for _ in range(2))
    table = torch.zeros(2, B, nb, dtype=torch.long)
    table[1] = (torch.randperm(B * nb, generator=g) + 1).view(B, nb)
    q = torch.randn(B, T, H + 2 * KV, hd, generator=g)[:, :, :H]
    return q, k, v, table[1], pos, end


def sdpa(q, k, v, table, pos, end):
    """Engine's torch path: KVCache.gather's copy, then SDPA with Cached's mask."""
    B, bt = q.shape[0], k.shape[1]
    nb = -(-end // bt)
    ids = table[:, :nb].reshape(-1)
    keys, values = (t.index_select(0, ids).view(B, nb * bt, *t.shape[2:])[:, :end] for t in (k, v))
    mask = torch.arange(end).view(1, 1, 1, -1) <= pos.view(B, 1, -1, 1)
    return F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                          attn_mask=mask, enable_gqa=True)


# (B, T, H, KV, hd, starts): T from 2 to 300, lanes at different starts (chunks crossing blocks of 16 at every
# offset), GQA groups of 1 to 4 (and 3, which does not divide a tile of rows), head sizes 16 to 128; the 32 lanes
# start at every offset within the kernel's chunks of cells, so some tile's first row sits at each cell of a chunk
CASES = [
    (32, 40, 2, 2, 16, list(range(32))),
    (32, 40, 6, 2, 16, list(range(32))),
    (1, 2, 4, 2, 64, [0]),
    (1, 2, 4, 2, 64, [45]),
    (3, 37, 12, 4, 64, [0, 5, 100]),
    (2, 300, 8, 2, 32, [17, 0]),
    (2, 5, 6, 6, 128, [3, 31]),
    (4, 33, 4, 1, 16, [15, 16, 1, 200]),
    (2, 129, 16, 4, 64, [63, 7]),
]


@pytest.mark.parametrize("B,T,H,KV,hd,starts", CASES)
def test_kernel_matches_gathered_sdpa(B, T, H, KV, hd, starts):
    args = paged_inputs(B, T, H, KV, hd, starts)
    got = cpu.prefill_attention(*args)
    torch.testing.assert_close(got.transpose(1, 2), sdpa(*args), atol=1e-5, rtol=0)
    # a work item's rows are one thread's: the bits do not depend on the thread count
    assert torch.equal(cpu.prefill_attention(*args, threads=1), got)


def test_rows_follow_their_own_positions():
    """Positions need not be a run: repeated, out of order and past other lanes' (the mask is kpos <= pos)."""
    pos = torch.tensor([[9, 3, 3, 40, 0, 17], [2, 2, 2, 2, 2, 2]])
    args = paged_inputs(2, 6, 8, 2, 64, [], pos=pos)
    torch.testing.assert_close(cpu.prefill_attention(*args).transpose(1, 2), sdpa(*args), atol=1e-5, rtol=0)


def small_net() -> LoopedLM:
    cfg = ModelConfig(vocab_size=96, d_model=96, n_heads=6, n_kv_heads=2, ffn_hidden=128, n_prelude=1, n_core=2,
                      n_coda=1, max_loops=3)
    torch.manual_seed(0)
    return LoopedLM(cfg, 512).eval().requires_grad_(False)


def prefill(net: LoopedLM, chunks: list[torch.Tensor], starts: list[int], monkeypatch, kernel: bool) -> torch.Tensor:
    """Logits of each lane's prompt fed in chunks (lane b's prompt from starts[b]: its earlier cells are another
    chunk's), with the C attention or SDPA."""
    monkeypatch.setenv("TINYLOOP_CPU_ATTENTION", "1" if kernel else "0")
    B = chunks[0].shape[0]
    cache = KVCache(net.cfg, B, 512, "fp16").reserve_all()
    out, at = [], torch.tensor(starts).unsqueeze(1)
    with torch.inference_mode():
        head = torch.randint(0, net.cfg.vocab_size, (1, max(starts)), generator=torch.Generator().manual_seed(2))
        for b, s in enumerate(starts):  # what lies before each lane's chunks, lane by lane
            if s:
                paged.forward(net, head[:, :s], 3, net.make_step(torch.arange(s).unsqueeze(0)), cache.lane_view(b))
        for ids in chunks:
            pos = at + torch.arange(ids.shape[1])
            step = net.make_step(pos)
            assert paged.context(net, step, cache).c_attention == kernel
            out.append(paged.forward(net, ids, 3, step, cache))
            at = at + ids.shape[1]
    return torch.cat(out, 1)


def test_model_prefill_matches_sdpa(monkeypatch):
    """Two lanes at different positions, chunks of 70 and 41 tokens crossing blocks (not the C step's chunks of
    up to 32 rows)."""
    net = small_net()
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randint(0, 96, (2, n), generator=g) for n in (70, 41)]
    got = prefill(net, chunks, [0, 23], monkeypatch, kernel=True)
    want = prefill(net, chunks, [0, 23], monkeypatch, kernel=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bundled_model_prefill_matches_sdpa(monkeypatch):
    model = tinyloop.load_model(None, 512, cache_mode="fp16")
    tokens = torch.tensor([model.codec.encode("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
                                              "        a, b = b, a + b\n    return a\n" * 8)[:300]])
    got = prefill(model.net, [tokens], [0], monkeypatch, kernel=True)
    want = prefill(model.net, [tokens], [0], monkeypatch, kernel=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
