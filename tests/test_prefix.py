"""PrefixCache and PrefixPool: exact reuse of a prefix's prefill, pool lookup, eviction, stats and errors."""
from __future__ import annotations

import threading

import pytest

import tinyloop
from tinyloop.cache import BLOCK_TOKENS
from conftest import ARCHS, ids
from tinyloop import GenerateConfig as G
from tinyloop.prefix import BLOCK



# every cache mode on one architecture, every architecture on the fp16 cache
@pytest.mark.parametrize("mode,arch", [("int8", "huginn"), ("int4", "huginn")] + [("fp16", a) for a in ARCHS])
def test_prefix_cache_equals_generate(make_artifact, mode, arch):
    model = tinyloop.load_model(make_artifact(**ARCHS[arch]), 128, cache_mode=mode)
    prefix = ids(37, 1)
    pc = tinyloop.create_prefix_cache(model, prefix, 3)
    cfg = G(max_tokens=8, loops=3)
    for suffix in (ids(6, 2), ids(1, 3), []):
        ref = tinyloop.generate(model, prefix + suffix, cfg)
        out = tinyloop.generate_from_prefix_cache(model, pc, suffix, cfg)
        assert out.tokens == ref.tokens and out.text == ref.text
        assert out.stats.prefix_hit_tokens == len(prefix) and out.stats.prompt_tokens == len(prefix) + len(suffix)
        assert out.stats.cache_mode == mode
    assert pc.nbytes > 0


def test_prefix_cache_sampling_and_stops_match_generate(tiny_model):
    prefix, suffix = ids(30, 4), ids(4, 5)
    pc = tinyloop.create_prefix_cache(tiny_model, prefix, 4)
    cfg = G(max_tokens=10, loops=4, temperature=0.9, top_k=50, seed=7, repetition_penalty=1.2)
    assert tinyloop.generate_from_prefix_cache(tiny_model, pc, suffix, cfg).tokens == \
        tinyloop.generate(tiny_model, prefix + suffix, cfg).tokens
    greedy = tinyloop.generate(tiny_model, prefix + suffix, G(max_tokens=10, loops=4)).tokens
    stop = G(max_tokens=10, loops=4, stop_sequences=[greedy[3:5]])
    ref = tinyloop.generate(tiny_model, prefix + suffix, stop)
    out = tinyloop.generate_from_prefix_cache(tiny_model, pc, suffix, stop)
    assert out.tokens == ref.tokens and out.stats.stop_reason == ref.stats.stop_reason == "stop_sequence"


def test_prefix_cache_with_grammar_and_early_exit(tiny_model):
    prefix, suffix = ids(25, 6), ids(3, 7)
    pc = tinyloop.create_prefix_cache(tiny_model, prefix, 4)
    for cfg in (G(max_tokens=8, loops=4, grammar={"regex": "[a-z ]+"}),
                G(max_tokens=8, loops=4, early_exit_threshold=0.5)):
        ref = tinyloop.generate(tiny_model, prefix + suffix, cfg)
        out = tinyloop.generate_from_prefix_cache(tiny_model, pc, suffix, cfg)
        assert out.tokens == ref.tokens and out.stats.stop_reason == ref.stats.stop_reason
        assert out.stats.loops_mean == ref.stats.loops_mean


def test_prefix_cache_rules(tiny_model, make_artifact):
    pc = tinyloop.create_prefix_cache(tiny_model, ids(20, 8), 4)
    with pytest.raises(tinyloop.ConfigError, match="n_loops 4"):
        tinyloop.generate_from_prefix_cache(tiny_model, pc, ids(3, 9), G(loops=8))
    with pytest.raises(tinyloop.ModeError, match="cache_window"):
        tinyloop.generate_from_prefix_cache(tiny_model, pc, ids(3, 9), G(loops=4, cache_window=8))
    with pytest.raises(tinyloop.ModeError, match="Beam"):
        tinyloop.generate_from_prefix_cache(tiny_model, pc, ids(3, 9), G(loops=4, beam_size=2))
    with pytest.raises(tinyloop.ConfigError, match="n_loops"):
        tinyloop.create_prefix_cache(tiny_model, ids(5, 1), 17)
    with pytest.raises(tinyloop.ConfigError, match="max_seq_len"):
        tinyloop.generate_from_prefix_cache(tiny_model, pc, ids(3, 9), G(loops=4, max_tokens=250))
    other = tinyloop.load_model(make_artifact(), 256)
    with pytest.raises(tinyloop.HandleError, match="bound to the model"):
        tinyloop.generate_from_prefix_cache(other, pc, ids(3, 9), G(loops=4))
    tinyloop.free_handle(pc)
    with pytest.raises(tinyloop.HandleError, match="freed"):
        tinyloop.generate_from_prefix_cache(tiny_model, pc, ids(3, 9), G(loops=4))
    assert pc.nbytes == 0


def test_prefix_cache_after_free_model(make_artifact):
    model = tinyloop.load_model(make_artifact(), 64)
    pc = tinyloop.create_prefix_cache(model, ids(10, 1), 4)
    tinyloop.free_model(model)
    with pytest.raises(tinyloop.HandleError, match="free"):
        tinyloop.generate_from_prefix_cache(model, pc, [5], G(loops=4))


def test_prefix_cache_busy(tiny_model):
    pc = tinyloop.create_prefix_cache(tiny_model, ids(20, 10), 4)
    errors = []

    def reenter(token, index):  # a second call on the handle while the first one is decoding
        with pytest.raises(tinyloop.BusyError, match="PrefixCache is already in use") as e:
            tinyloop.generate_from_prefix_cache(tiny_model, pc, [3], G(loops=4))
        errors.append(e.value)
        return False

    tinyloop.generate_from_prefix_cache(tiny_model, pc, [4], G(loops=4, max_tokens=3), on_token=reenter)
    assert len(errors) == 1

    # the same from another thread, while the first call is held inside its callback
    inside, release = threading.Event(), threading.Event()

    def hold(token, index):
        inside.set()
        release.wait(10)
        return False

    t = threading.Thread(target=tinyloop.generate_from_prefix_cache, args=(tiny_model, pc, [4], G(loops=4)),
                         kwargs=dict(on_token=hold))
    t.start()
    assert inside.wait(10)
    try:
        with pytest.raises(tinyloop.BusyError):
            tinyloop.generate_from_prefix_cache(tiny_model, pc, [3], G(loops=4))
    finally:
        release.set()
        t.join()
    assert tinyloop.generate_from_prefix_cache(tiny_model, pc, [3], G(loops=4, max_tokens=2)).stats.prefix_hit_tokens == 20


# --- the pool ------------------------------------------------------------------------------------------
def test_pool_longest_prefix_wins_and_no_match_falls_through(tiny_model):
    a, b = ids(2 * BLOCK + 5, 11), ids(BLOCK + 3, 12)  # lengths off the block boundary on purpose
    pool = tinyloop.create_prefix_pool(8)
    tinyloop.register_prefix(pool, tiny_model, a, 4)
    tinyloop.register_prefix(pool, tiny_model, a + b, 4)
    tinyloop.register_prefix(pool, tiny_model, a[:7], 4)
    tinyloop.register_prefix(pool, tiny_model, a + b, 2)  # same tokens at another loop count: its own entry
    cfg = G(max_tokens=6, loops=4)
    # the longest common token prefix with any registered scaffold; a prompt that ends inside one still prefills its
    # last token (its logits come from a forward)
    cases = [(a + b + ids(4, 13), len(a + b)), (a + ids(4, 14), len(a)), (a[:7] + [9, 9], 7), (a + b, len(a + b) - 1),
             (a[:5], 4), (a[:20] + [9] * 20, 20), (ids(40, 15), 0)]
    for prompt, hit in cases:
        out = tinyloop.generate_with_pool(tiny_model, pool, prompt, cfg)
        assert out.tokens == tinyloop.generate(tiny_model, prompt, cfg).tokens
        assert out.stats.prefix_hit_tokens == hit, (len(prompt), hit)
    out = tinyloop.generate_with_pool(tiny_model, pool, a + b + [1], G(max_tokens=6, loops=2))
    assert out.stats.prefix_hit_tokens == len(a + b)
    assert tinyloop.generate_with_pool(tiny_model, pool, a + [1], G(max_tokens=6, loops=2)).stats.prefix_hit_tokens == len(a)
    assert tinyloop.generate_with_pool(tiny_model, pool, b, G(max_tokens=6, loops=2)).stats.prefix_hit_tokens == 0
    st = pool.stats
    assert (st.entries, st.hits, st.misses, st.evictions) == (4, 8, 2, 0)
    assert st.hit_tokens == sum(h for _, h in cases) + len(a + b) + len(a)
    assert st.bytes == pool.nbytes == sum(pc.nbytes for pc in pool.entries.values()) > 0


def test_pool_string_prompts_match_generate(tiny_model):
    scaffold = "You are a helpful assistant. Answer in Python.\n" * 3
    pool = tinyloop.create_prefix_pool(2)
    tinyloop.register_prefix(pool, tiny_model, scaffold, 4)
    prompt = scaffold + "def add(a, b):"
    out = tinyloop.generate_with_pool(tiny_model, pool, prompt, G(max_tokens=6, loops=4))
    assert out.stats.prefix_hit_tokens > 0
    assert out.tokens == tinyloop.generate(tiny_model, prompt, G(max_tokens=6, loops=4)).tokens


def test_pool_evicts_least_recently_used(tiny_model):
    a, b, c = ids(20, 21), ids(20, 22), ids(20, 23)
    pool = tinyloop.create_prefix_pool(2)
    pa = tinyloop.register_prefix(pool, tiny_model, a, 4)
    pb = tinyloop.register_prefix(pool, tiny_model, b, 4)
    cfg = G(max_tokens=2, loops=4)
    assert tinyloop.generate_with_pool(tiny_model, pool, a + [5], cfg).stats.prefix_hit_tokens == 20  # a is now newest
    assert tinyloop.register_prefix(pool, tiny_model, a, 4) is pa  # already there: no rebuild, no eviction
    tinyloop.register_prefix(pool, tiny_model, c, 4)  # evicts b, the least recently used
    assert pool.stats.evictions == 1 and pool.stats.entries == 2 and pb.freed and pb.nbytes == 0
    assert tinyloop.generate_with_pool(tiny_model, pool, b + [5], cfg).stats.prefix_hit_tokens == 0
    assert tinyloop.generate_with_pool(tiny_model, pool, c + [5], cfg).stats.prefix_hit_tokens == 20  # c newest
    tinyloop.register_prefix(pool, tiny_model, b, 4)  # evicts a
    assert tinyloop.generate_with_pool(tiny_model, pool, a + [5], cfg).stats.prefix_hit_tokens == 0
    assert tinyloop.generate_with_pool(tiny_model, pool, c + [5], cfg).stats.prefix_hit_tokens == 20
    st = pool.stats
    assert (st.entries, st.hits, st.misses, st.evictions) == (2, 3, 2, 2)
    tinyloop.free_handle(pool.entries[(tuple(c), 4)])  # an entry freed by hand leaves the pool at the next lookup
    assert tinyloop.generate_with_pool(tiny_model, pool, c + [5], cfg).stats.prefix_hit_tokens == 0
    assert pool.stats.entries == 1


def test_pool_rules(tiny_model, make_artifact):
    with pytest.raises(tinyloop.ConfigError, match="capacity"):
        tinyloop.create_prefix_pool(0)
    pool = tinyloop.create_prefix_pool(2)
    tinyloop.register_prefix(pool, tiny_model, ids(10, 1), 4)
    with pytest.raises(tinyloop.ModeError, match="cache_window"):
        tinyloop.generate_with_pool(tiny_model, pool, ids(12, 1), G(loops=4, cache_window=4))
    other = tinyloop.load_model(make_artifact(), 64)
    with pytest.raises(tinyloop.HandleError, match="bound to the model"):
        tinyloop.register_prefix(pool, other, ids(10, 2), 4)
    with pytest.raises(tinyloop.HandleError, match="bound to the model"):
        tinyloop.generate_with_pool(other, pool, ids(10, 2), G(loops=4))

    def reenter(token, index):
        with pytest.raises(tinyloop.BusyError, match="PrefixPool"):
            tinyloop.generate_with_pool(tiny_model, pool, [1, 2], G(loops=4))
        return False

    tinyloop.generate_with_pool(tiny_model, pool, ids(12, 1), G(loops=4), on_token=reenter)
    tinyloop.free_handle(pool)
    with pytest.raises(tinyloop.HandleError, match="freed"):
        tinyloop.generate_with_pool(tiny_model, pool, ids(12, 1), G(loops=4))


@pytest.mark.parametrize("mode", ["fp16", "int8", "int4"])
def test_prefix_cache_bytes_within_memory_plan(make_artifact, mode):
    model = tinyloop.load_model(make_artifact(), 64, cache_mode=mode)
    prefix = ids(24, 30)
    pc = tinyloop.create_prefix_cache(model, prefix, model.cfg.max_loops)  # the deepest, largest cache
    plan = tinyloop.plan_memory(model, max_handles=1, handle_tokens=len(prefix))
    per_slot = tinyloop.bytes_per_token_slot(model.cfg, mode, 4)
    blocks = -(-len(prefix) // BLOCK_TOKENS)  # whole blocks of the pool, shared with the calls that use them
    assert pc.nbytes == blocks * BLOCK_TOKENS * model.cfg.n_slots() * per_slot + model.cfg.vocab_size * 4
    assert pc.nbytes <= plan.per_handle_bytes
