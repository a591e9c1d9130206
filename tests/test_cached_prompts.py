"""Every mode on a cached prompt: beam, speculative, grammar, resume, the prefix pool, a sliding window and early exit,
each on a prompt that is (a) wholly cached, (b) a prefix of a cached one, (c) an extension of one, at lengths on
both sides of every block boundary a short prompt crosses. The output equals the same call on a cold cache."""
from __future__ import annotations

import pytest

import tinyloop
from conftest import ids
from tinyloop import GenerateConfig as G

LOOPS = 4


def call(mode: str, model, prompt: list[int]):
    """The mode's call on `prompt` (greedy, a few tokens)."""
    cfg = G(max_tokens=6, loops=LOOPS)
    if mode == "beam":
        return tinyloop.generate(model, prompt, G(max_tokens=6, loops=LOOPS, beam_size=2))
    if mode == "speculative":
        return tinyloop.generate_speculative(model, prompt, tinyloop.SpeculativeConfig(2, LOOPS, 3), cfg)
    if mode == "grammar":
        return tinyloop.generate(model, prompt, G(max_tokens=6, loops=LOOPS, grammar={"regex": "[a-z ]{1,6}"}))
    if mode == "resume":
        return tinyloop.resume_generate(tinyloop.build_resume_handle(model, prompt, 2), LOOPS, cfg)
    if mode == "pool":
        pool = tinyloop.create_prefix_pool(2)
        tinyloop.register_prefix(pool, model, prompt[:16], LOOPS)
        return tinyloop.generate_with_pool(model, pool, prompt, cfg)
    if mode == "window":
        return tinyloop.generate(model, prompt, G(max_tokens=6, loops=LOOPS, cache_window=24))
    if mode == "early_exit":
        return tinyloop.generate(model, prompt, G(max_tokens=6, loops=LOOPS, early_exit_threshold=0.05))
    raise AssertionError(mode)


MODES = ["beam", "speculative", "grammar", "resume", "pool", "window", "early_exit"]
RELATIONS = ["whole", "prefix", "extension"]
REUSE = {"beam", "grammar", "pool", "early_exit"}  # the calls that take a prompt's prefix from the model's cache


@pytest.fixture(scope="module")
def models(make_artifact):
    art = make_artifact()
    return tinyloop.load_model(art, 256, prefix_caching=True), tinyloop.load_model(art, 256)


@pytest.mark.parametrize("length", [15, 16, 17, 32, 33])
@pytest.mark.parametrize("relation", RELATIONS)
@pytest.mark.parametrize("mode", MODES)
def test_a_mode_on_a_cached_prompt_equals_a_cold_cache(models, mode, relation, length):
    cached, cold = models
    base = ids(length, seed=length)
    if relation == "prefix":
        tinyloop.generate(cached, base + ids(9, seed=1), G(max_tokens=2, loops=LOOPS))  # cache a longer prompt
    else:
        tinyloop.generate(cached, base, G(max_tokens=8, loops=LOOPS))  # cache the prompt and an answer to it
    prompt = base + ids(5, seed=2) if relation == "extension" else base
    out, ref = call(mode, cached, prompt), call(mode, cold, prompt)
    assert (out.tokens, out.text, out.stats.stop_reason) == (ref.tokens, ref.text, ref.stats.stop_reason)
    if mode in REUSE:  # the call really started from the cache (the cold pool holds its scaffold only)
        assert out.stats.prefix_hit_tokens > 0 and (mode == "pool" or ref.stats.prefix_hit_tokens == 0)
