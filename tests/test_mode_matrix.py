"""Every cell of the mode matrix (tinyloop.modes.MATRIX, the data the guards read) as a test.

"yes" cells run the call with the mode on and check the output: single decode against a cache-free
recompute (exact for fp16, grammar and cache_window; near-argmax for the quantised caches; beam scores
recomputed), every other call kind against single decode with the same settings, grammar output against the
grammar. "no" cells must raise ModeError naming both the mode and the call kind.
"""
from __future__ import annotations

import re

import pytest
import torch

import tinyloop
from tinyloop import (CACHE_MODES, MATRIX, GenerateConfig, ModeError, build_resume_handle, create_prefix_cache,
                      create_prefix_pool, generate, generate_batch, generate_from_prefix_cache, generate_with_pool,
                      register_prefix, resume_generate)
from tinyloop.grammar import GrammarState
from tinyloop.engine import forward as paged
from tinyloop.modes import CALL_TITLES, CALLS, MODE_TITLES, MODES
from tinyloop.speculative import SpeculativeConfig, generate_speculative

LOOPS, MAX_TOKENS, WINDOW, BEAM = 4, 12, 6, 3
PROMPT = "def add(a, b):\n    return a + b\n"
OTHER = [5, 6, 7]  # a second, much shorter batch lane
REGEX = r"(yes|no)-[0-9]{2}-[a-z]{1,4}\."
MODE_SETTINGS = {"fp16": {}, "int8": {}, "int4": {}, "grammar": {"grammar": {"regex": REGEX}},
                 "cache_window": {"cache_window": WINDOW}, "beam": {"beam_size": BEAM}}
QUANT_TOL = 0.1  # largest logit gap between a quantised-cache pick and the exact argmax (tiny model: logit std ~0.16)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(make_artifact):
    return {mode: tinyloop.load_model(make_artifact(), 256, cache_mode=mode) for mode in CACHE_MODES}


def config(mode: str) -> GenerateConfig:
    return GenerateConfig(max_tokens=MAX_TOKENS, loops=LOOPS, **MODE_SETTINGS[mode])


# --- the call kinds (columns) ----------------------------------------------------------------------------
def run_single(model, prompt, cfg):
    return generate(model, prompt, cfg)


def run_batch(model, prompt, cfg):
    out = generate_batch(model, [prompt, OTHER], cfg)
    assert out[1].tokens == generate(model, OTHER, cfg).tokens  # the other lane is right too
    return out[0]


def run_speculative(model, prompt, cfg):
    return generate_speculative(model, prompt, SpeculativeConfig(draft_loops=2, verify_loops=LOOPS, draft_ahead=3), cfg)


def run_tree_speculative(model, prompt, cfg):
    sc = SpeculativeConfig(draft_loops=2, verify_loops=LOOPS, draft_ahead=3, tree_width=2)
    return generate_speculative(model, prompt, sc, cfg)


def run_prefix(model, prompt, cfg):
    ids = model.encode_prompt(prompt)
    pc = create_prefix_cache(model, ids[:8], LOOPS)
    from_cache = generate_from_prefix_cache(model, pc, ids[8:], cfg)
    pool = create_prefix_pool(2)
    register_prefix(pool, model, ids[:8], LOOPS)
    from_pool = generate_with_pool(model, pool, ids, cfg)
    assert from_pool.tokens == from_cache.tokens and from_pool.stats.prefix_hit_tokens == 8
    return from_cache


def run_warm_start(model, prompt, cfg):
    handle = build_resume_handle(model, prompt, 2, cache_window=cfg.cache_window)
    return resume_generate(handle, LOOPS, cfg)


RUNNERS = {"single": run_single, "batch": run_batch, "speculative": run_speculative,
           "tree_speculative": run_tree_speculative, "prefix": run_prefix, "warm_start": run_warm_start}


# --- references for single decode ------------------------------------------------------------------------
@torch.inference_mode()
def exact_logits(model, ids: list[int], window: int = 0) -> torch.Tensor:
    """Cache-free forward over the whole sequence: logits [T, V]."""
    step = model.net.make_step(torch.arange(len(ids)).unsqueeze(0), len(ids), window=window)
    return model.net(torch.tensor([ids]), LOOPS, step)[0].float()


@torch.inference_mode()
def quantised_logits(model, ids: list[int]) -> torch.Tensor:
    cache = tinyloop.KVCache(model.cfg, 1, len(ids), model.cache_mode, device=model.device, dtype=model.dtype).reserve_all()
    step = model.net.make_step(torch.arange(len(ids)).unsqueeze(0), len(ids))
    return paged.forward(model.net, torch.tensor([ids]), LOOPS, step, cache)[0].float()


def recompute_greedy(model, prompt, window: int = 0, grammar=None) -> list[int]:
    """Greedy decode that recomputes everything for every token (no cache), optionally grammar-masked."""
    ids, out = model.encode_prompt(prompt), []
    state = GrammarState.for_model(model, grammar) if grammar is not None else None
    for _ in range(MAX_TOKENS):
        logits = exact_logits(model, ids + out, window)[-1]
        token = int(torch.argmax(state.mask(logits) if state is not None else logits))
        if state is not None:
            state.accept(token)
        if token == model.eos_id:
            break
        out.append(token)
        if state is not None and state.must_end():
            break
    return out


def sequence_logprob(model, prompt, tokens: list[int], eos: bool) -> float:
    ids = model.encode_prompt(prompt)
    seq = tokens + ([model.eos_id] if eos else [])
    logp = torch.log_softmax(exact_logits(model, ids + seq), dim=-1)
    return sum(float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(seq))


def check_single(model, mode: str, result) -> None:
    if mode == "fp16":
        assert result.tokens == recompute_greedy(model, PROMPT)
    elif mode in ("int8", "int4"):
        ids, n = model.encode_prompt(PROMPT), len(result.tokens)
        picked = torch.tensor(result.tokens)
        # exact for the storage format: one prefill of prompt + output through a fresh cache of this mode
        # (quantisation is per token, so chunking does not matter) gives the decoded tokens as its argmaxes
        rows = quantised_logits(model, ids + result.tokens)[len(ids) - 1:len(ids) - 1 + n]
        assert torch.equal(rows.argmax(-1), picked)
        # and close to full precision: each pick is near the exact argmax given its own prefix
        rows = exact_logits(model, ids + result.tokens)[len(ids) - 1:len(ids) - 1 + n]
        gaps = rows.max(-1).values - rows[torch.arange(n), picked]
        assert n == MAX_TOKENS and float(gaps.max()) <= QUANT_TOL and float(gaps.mean()) <= QUANT_TOL / 2
    elif mode == "grammar":
        assert result.tokens == recompute_greedy(model, PROMPT, grammar={"regex": REGEX})
    elif mode == "cache_window":
        assert result.tokens == recompute_greedy(model, PROMPT, window=WINDOW)
    elif mode == "beam":
        greedy = generate(model, PROMPT, config("fp16"))
        greedy_lp = sequence_logprob(model, PROMPT, greedy.tokens, greedy.stats.stop_reason == "eos")
        assert len(result.n_best) == BEAM and result.tokens == result.n_best[0].tokens
        assert result.n_best[0].logprob >= greedy_lp - 1e-4
        for h in result.n_best:
            assert h.logprob == pytest.approx(sequence_logprob(model, PROMPT, h.tokens, h.stop_reason == "eos"), abs=1e-3)


CELLS = [(mode, call) for mode in MODES for call in CALLS]


def test_every_cell_is_decided_and_has_a_runner():
    assert sorted(MATRIX) == sorted(CELLS)
    assert set(MATRIX.values()) <= {"yes", "no"}  # no cell left "partial"
    assert set(RUNNERS) == set(CALLS)


@pytest.mark.parametrize(("mode", "call"), CELLS, ids=[f"{m}-{c}" for m, c in CELLS])
def test_cell(models, mode, call):
    model = models[mode if mode in CACHE_MODES else "fp16"]
    cfg = config(mode)
    if MATRIX[(mode, call)] == "no":
        with pytest.raises(ModeError) as err:
            RUNNERS[call](model, PROMPT, cfg)
        assert MODE_TITLES[mode] in str(err.value) and CALL_TITLES[call] in str(err.value)
        return
    result = RUNNERS[call](model, PROMPT, cfg)
    assert result.stats.generated_tokens == len(result.tokens) > 0
    if call == "single":
        check_single(model, mode, result)
    else:  # every other call kind must give what single decode gives with the same settings
        reference = generate(model, PROMPT, cfg)
        assert (result.tokens, result.text) == (reference.tokens, reference.text)
    if mode == "grammar":
        assert re.fullmatch(REGEX, result.text) and result.stats.stop_reason == "grammar_complete"
