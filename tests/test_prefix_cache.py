"""Automatic prefix caching: every call reuses the longest cached token prefix of its prompt at its loop count, output
equals generate on the whole text, registered scaffolds are pinned entries of the same cache, LRU eviction under the
block budget."""
from __future__ import annotations

import pytest

import tinyloop
from conftest import ARCHS, ids
from tinyloop import GenerateConfig as G
from tinyloop.prefix_tree import common_length

# Scaffolds registered as text that end where the tokenizer merges the boundary with what follows.
BASE = "import os\nprint(os.getcwd())\nclass Point:\n    x: int = 0\n"
SCAFFOLDS = [BASE + "def add(a, b):\n    return a + b\n\n", BASE + "print(os.getcwd()) ", BASE + "    y: ",
             BASE + "def add(a, b):\n    ", BASE + "print(os.getcwd()).", BASE + "    x: int = 0,"]
SUFFIXES = ["def sub(a, b):", "import sys", "return x", "\n", " z = 1"]


def pair(make_artifact, mode="fp16", **arch):
    """(a model with prefix caching, the same model without): the second gives generate's reference output."""
    art = make_artifact(**arch)
    return (tinyloop.load_model(art, 256, cache_mode=mode, prefix_caching=True),
            tinyloop.load_model(art, 256, cache_mode=mode))


@pytest.mark.parametrize("mode", ["fp16", "int8", "int4"])
def test_scaffold_continuations_hit_and_equal_generate(make_artifact, tiny_codec, mode):
    cached, plain = pair(make_artifact, mode)
    cfg = G(max_tokens=6, loops=4)
    seen: list[list[int]] = []  # the whole blocks earlier prompts left in the cache
    for scaffold in SCAFFOLDS:
        for suffix in ["pass", *SUFFIXES]:
            prompt = scaffold + suffix
            out, ref = tinyloop.generate(cached, prompt, cfg), tinyloop.generate(plain, prompt, cfg)
            assert out.tokens == ref.tokens and out.text == ref.text
            whole = tiny_codec.encode(prompt)
            expect = min(len(whole) - 1, max((common_length(p, whole) for p in seen), default=0))
            assert out.stats.prefix_hit_tokens >= expect, (scaffold, suffix)
            assert out.stats.prefix_hit_tokens > 0 or not seen
            seen.append(whole[:len(whole) // 16 * 16])
    assert cached.prefixes.hits == len(SCAFFOLDS) * (len(SUFFIXES) + 1) - 1
    assert plain.prefixes.lookups == 0 and plain.pool.used == 0  # off by default in-process: nothing kept


@pytest.mark.parametrize("arch", list(ARCHS))
def test_longest_token_prefix_across_requests(make_artifact, arch):
    """Whole blocks and the shared part of the next block of any earlier prompt (and of its answer) are reused, at the
    same loop count only; sampling and early exit give generate's tokens."""
    cached, plain = pair(make_artifact, **ARCHS[arch])
    a = ids(40, 1)
    cfgs = [G(max_tokens=8, loops=4), G(max_tokens=8, loops=4, temperature=0.8, seed=3, repetition_penalty=1.2),
            G(max_tokens=8, loops=4, early_exit_threshold=0.3)]
    for cfg in cfgs:
        first = tinyloop.generate(cached, a, cfg)
        assert first.tokens == tinyloop.generate(plain, a, cfg).tokens
        # whole blocks are kept (40 prompt tokens: 32); the next block is matched as far as it agrees
        # (an exit gate decodes at adaptive depth: no answer blocks are kept, so a + ... finds 32, not a[:37] + ...'s)
        gate = bool(ARCHS[arch].get("exit_gate"))
        for prompt, hit in ((a[:37] + ids(5, 2), 32), (a + ids(3, 4), 32 if gate else 37), (a[:20], 19), (ids(30, 5), 0)):
            out = tinyloop.generate(cached, prompt, cfg)
            assert out.tokens == tinyloop.generate(plain, prompt, cfg).tokens
            got = out.stats.prefix_hit_tokens
            assert got == hit if cfg is cfgs[0] else got >= hit  # later rounds find the earlier rounds' blocks too
    five = G(max_tokens=2, loops=5)  # another loop count: its own cache
    assert tinyloop.generate(cached, a + [7], five).stats.prefix_hit_tokens == 0
    assert tinyloop.generate(cached, a + [8], five).stats.prefix_hit_tokens == 32
    # a later turn extends the first prompt and its answer: the answer's whole blocks are reused too (plain decode)
    long = G(max_tokens=30, loops=4)
    history = a + tinyloop.generate(cached, a, long).tokens
    out = tinyloop.generate(cached, history + ids(4, 6), long)
    if gate:  # decode at adaptive depth copies entries into skipped loops: prompt blocks only
        assert out.stats.prefix_hit_tokens == 32
    else:  # every token fed to the decode has its entries: all but the last answer token
        assert out.stats.prefix_hit_tokens == (len(history) - 1) // 16 * 16 > 32
    assert out.tokens == tinyloop.generate(plain, history + ids(4, 6), long).tokens


def test_batch_lanes_and_beams_reuse_and_equal_generate(make_artifact):
    cached, plain = pair(make_artifact)
    scaffold = ids(35, 7)
    prompts = [scaffold + ids(3 + i, 10 + i) for i in range(4)]
    cfg = G(max_tokens=6, loops=4)
    batch = tinyloop.generate_batch(cached, prompts, cfg)
    assert [r.tokens for r in batch] == [tinyloop.generate(plain, p, cfg).tokens for p in prompts]
    assert batch[0].stats.prefix_hit_tokens == 0 and all(r.stats.prefix_hit_tokens == 32 for r in batch[1:])  # whole blocks
    beam = G(max_tokens=6, loops=4, beam_size=3)
    out = tinyloop.generate(cached, scaffold + [5, 6], beam)
    assert out.stats.prefix_hit_tokens == 32 and out.tokens == tinyloop.generate(plain, scaffold + [5, 6], beam).tokens


def test_a_prompt_cached_but_its_last_token_joins_the_decode_rows(make_artifact, caplog):
    """A prompt the cache holds all but the last token of feeds that token as a row of the running lanes' decode
    forward instead of a forward of its own (engine/runner.py); the output stays generate's, beside a lane mid-decode."""
    cached, plain = pair(make_artifact)
    cfg = G(max_tokens=8, loops=4)
    prompts = [ids(n, 20 + n) for n in (10, 17, 30, 45)]  # + 7 answer tokens kept: whole blocks cover n - 1
    tinyloop.generate_batch(cached, prompts, cfg)
    sched = tinyloop.Scheduler(cached, lanes=5)
    fresh = sched.submit(ids(12, 3), cfg)
    sched.step(), sched.step()
    seqs = [sched.submit(p, cfg) for p in prompts]
    with caplog.at_level("DEBUG", logger="tinyloop.scheduler"):
        while not sched.idle():
            sched.step()
    assert fresh.result().tokens == tinyloop.generate(plain, ids(12, 3), cfg).tokens
    for p, seq in zip(prompts, seqs):
        out = seq.result()
        assert out.tokens == tinyloop.generate(plain, p, cfg).tokens
        assert out.stats.prefix_hit_tokens == len(p) - 1
    assert caplog.text.count("joins the decode rows") == len(prompts)
    assert "prefill #" not in caplog.text  # none of them ran a forward of its own


def test_registered_scaffold_ending_in_whitespace_hits_its_continuation(make_artifact, tiny_codec):
    """The boundary miss: a scaffold registered as text and a request continuing it tokenize differently at the seam;
    every token before it is reused, in the pool and in a PrefixCache, and the output is generate's on the text."""
    model = tinyloop.load_model(make_artifact(), 256)
    cfg = G(max_tokens=6, loops=4)
    pool = tinyloop.create_prefix_pool(len(SCAFFOLDS))
    for scaffold in SCAFFOLDS:
        tinyloop.register_prefix(pool, model, scaffold, 4)
    misses = 0
    for scaffold in SCAFFOLDS:
        pc = tinyloop.create_prefix_cache(model, scaffold, 4)
        for suffix in SUFFIXES:
            prompt = scaffold + suffix
            ref = tinyloop.generate(model, prompt, cfg)
            whole, alone = tiny_codec.encode(prompt), tiny_codec.encode(scaffold)
            misses += whole[:len(alone)] != alone  # how often the seam merges
            for out in (tinyloop.generate_with_pool(model, pool, prompt, cfg),
                        tinyloop.generate_from_prefix_cache(model, pc, suffix, cfg)):
                assert out.tokens == ref.tokens and out.text == ref.text
                assert out.stats.prefix_hit_tokens >= len(alone) - 2, (scaffold, suffix)
        tinyloop.free_handle(pc)
    assert misses >= len(SCAFFOLDS) // 2  # the seam really merges in these cases
    assert pool.stats.hits == len(SCAFFOLDS) * len(SUFFIXES) and pool.stats.misses == 0


def test_lru_eviction_under_a_small_budget_keeps_pinned_scaffolds(make_artifact):
    art = make_artifact()
    probe = tinyloop.load_model(art, 128)
    budget = tinyloop.plan_memory(probe, lanes=3, loops=4).total_bytes  # room for about three sequences
    model = tinyloop.load_model(art, 128, memory_budget=budget, prefix_caching=True)
    pool = tinyloop.create_prefix_pool(1)
    scaffold = ids(40, 20)
    tinyloop.register_prefix(pool, model, scaffold, 4)
    cfg = G(max_tokens=8, loops=4)
    tree = model.prefixes
    for i in range(12):  # distinct prompts: each leaves its blocks cached until the pool needs them
        prompt = ids(60, 100 + i)
        assert tinyloop.generate(model, prompt, cfg).tokens == tinyloop.generate(probe, prompt, cfg).tokens
    assert tree.evictions > 0 and model.pool.used <= model.pool.num_blocks
    again = tinyloop.generate(model, ids(60, 111), cfg)  # the newest survived
    assert again.stats.prefix_hit_tokens == 59
    assert tinyloop.generate(model, ids(60, 100), cfg).stats.prefix_hit_tokens == 0  # the oldest was evicted
    out = tinyloop.generate_with_pool(model, pool, scaffold + [3, 4], cfg)  # pinned: never evicted
    assert out.stats.prefix_hit_tokens == 40
    assert out.tokens == tinyloop.generate(probe, scaffold + [3, 4], cfg).tokens
    # a batch that needs the whole pool takes the cached blocks back; pinned ones stay
    batch = tinyloop.generate_batch(model, [ids(70, 200 + i) for i in range(4)], G(max_tokens=40, loops=4))
    assert [r.tokens for r in batch] == [tinyloop.generate(probe, ids(70, 200 + i), G(max_tokens=40, loops=4)).tokens
                                         for i in range(4)]
    assert tinyloop.generate_with_pool(model, pool, scaffold + [3], cfg).stats.prefix_hit_tokens == 40
    tinyloop.free_handle(pool)  # unpinned: the scaffold's blocks become ordinary cache, freed on demand
    tree.clear()
    assert model.pool.used == 0 and tree.nodes == 0
