"""The looped model and its loop-aware KV cache: cached decode equals a full recompute."""
import pytest
import torch

import tinyloop
from tinyloop.cache import KVCache
from tinyloop.engine.runner import Runner


def cached_logits(model, ids: list[int], loops: int, cache, prefill: int = 5) -> torch.Tensor:
    """Prefill the first `prefill` tokens, then feed the rest one at a time; logits for every position."""
    cache.reset()
    cache.reserve_all()  # (forwards outside an engine step: their blocks are taken first)
    runner = Runner(model, cache, loops)
    out = [runner.prefill(ids[:prefill], 0, all_rows=True)]
    for t in range(prefill, len(ids)):
        out.append(runner.decode([ids[t]], [t])[0])
    return torch.cat(out)


@pytest.mark.parametrize("injection", ["none", "add", "adapter"])
@pytest.mark.parametrize("loops", [1, 3, 8])
def test_cached_decode_equals_full_recompute(make_artifact, injection, loops):
    model = tinyloop.load_model(make_artifact(injection=injection), 64)
    ids = torch.randint(1, 320, (24,), generator=torch.Generator().manual_seed(loops)).tolist()
    full = model.net(torch.tensor([ids]), loops)[0]
    assert torch.allclose(cached_logits(model, ids, loops, model.new_cache(1, model.max_seq_len)), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("overrides", [
    dict(state_init="embed", injection="add"),
    dict(state_init="normal", init_sigma=0.7, injection="adapter"),
    dict(n_prelude=0, n_coda=0, injection="none", exit_gate=True),  # Ouro-style: whole stack looped
    dict(n_prelude=2, n_core=4, n_coda=2, sandwich_norm=True, tie_embeddings=False, n_kv_heads=1),  # Huginn-style
])
def test_architecture_variants_cache_exactly(make_artifact, overrides):
    model = tinyloop.load_model(make_artifact(**overrides), 64)
    ids = torch.randint(1, 320, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    full = model.net(torch.tensor([ids]), 5)[0]
    assert torch.allclose(cached_logits(model, ids, 5, model.new_cache(1, model.max_seq_len), prefill=3), full, atol=1e-4, rtol=1e-4)


def test_more_loops_change_the_output(make_artifact):
    model = tinyloop.load_model(make_artifact(), 64)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert not torch.allclose(model.net(ids, 1), model.net(ids, 4))


@pytest.mark.parametrize("mode,tol", [("int8", 0.05), ("int4", 0.25)])
def test_quantised_cache_logits_stay_close_to_fp16(make_artifact, mode, tol):
    path = make_artifact()
    ref, quant = tinyloop.load_model(path, 64), tinyloop.load_model(path, 64, cache_mode=mode)
    ids = torch.randint(1, 320, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    a = cached_logits(ref, ids, 4, ref.new_cache(1, ref.max_seq_len))
    b = cached_logits(quant, ids, 4, quant.new_cache(1, quant.max_seq_len))
    rel = (a - b).norm() / a.norm()
    assert 0 < rel < tol  # quantisation changes something, but not much


def test_quantised_cache_logits_on_bundled_model(bundled_model):
    """The trained model: int8 and int4 caches keep next-token distributions close to fp16."""
    ids = bundled_model.encode_prompt("import os\nimport sys\n\n\ndef main(argv):\n    parser = ")
    ref = torch.softmax(cached_logits(bundled_model, ids, 8, bundled_model.new_cache(1, bundled_model.max_seq_len)), -1)
    for mode, max_tv in (("int8", 0.02), ("int4", 0.15)):
        cache = KVCache(bundled_model.cfg, 1, 128, mode)
        probs = torch.softmax(cached_logits(bundled_model, ids, 8, cache), -1)
        tv = 0.5 * (ref - probs).abs().sum(-1).mean()
        assert tv < max_tv, f"{mode}: mean total variation {tv:.4f} from fp16"


def test_sliding_window_cache_equals_masked_full_attention(make_artifact):
    model = tinyloop.load_model(make_artifact(), 64)
    ids = torch.randint(1, 320, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    window = 7
    step = model.net.make_step(torch.arange(30).unsqueeze(0), 30, window=window)
    full = model.net(torch.tensor([ids]), 3, step)[0]
    ring = KVCache(model.cfg, 1, 64, "fp16", window=window)
    # prefill longer than the window (the chunk wraps the ring), then single tokens around the ring
    assert torch.allclose(cached_logits(model, ids, 3, ring, prefill=10), full, atol=1e-4, rtol=1e-4)
    unwindowed = model.net(torch.tensor([ids]), 3)[0]
    assert not torch.allclose(full[-1], unwindowed[-1], atol=1e-3)  # the window really limits attention


def test_early_exit_copies_kv_into_skipped_loops(make_artifact):
    """With early exit, later tokens still find keys at every depth: equal to a recompute that freezes states."""
    model = tinyloop.load_model(make_artifact(), 64)
    ids = [5, 9, 14, 3, 22, 40, 7]
    cache = model.new_cache(1, model.max_seq_len)
    cache.reset()
    cache.reserve_all()
    runner = Runner(model, cache, 8, early_exit=0.5)  # large threshold: tokens exit after few loops
    runner.prefill(ids[:3], 0)
    used = [runner.decode([ids[t]], [t])[1][0] for t in range(3, len(ids))]
    assert all(u < 8 for u in used), used
    cfg = model.cfg
    for t, u in zip(range(3, len(ids)), used):
        for k in range(u, 8):
            for j in range(cfg.n_core):
                src, dst = cfg.core_slot(u - 1, j), cfg.core_slot(k, j)
                assert torch.equal(cache.dense("k")[dst, 0, t], cache.dense("k")[src, 0, t])
