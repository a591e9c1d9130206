"""Beam search: beam_size 1 is greedy, scores are the model's log-probabilities, beams beat greedy."""
from __future__ import annotations

import re

import pytest
import torch

import tinyloop
from tinyloop import ConfigError, GenerateConfig, ModeError, beam_search, generate, generate_stream
from tinyloop.beam_decode import LENGTH_PENALTY

PROMPTS = ["def add(a, b):\n    return", "import os\n", [11, 12, 13], "class Point:\n    x: int = 0\n    y"]


pytestmark = pytest.mark.usefixtures("one_thread")


@torch.inference_mode()
def sequence_logprob(model, prompt, tokens: list[int], eos: bool, loops: int) -> float:
    """Sum of log p(token | prefix) by one cache-free forward over prompt + tokens (+ EOS)."""
    ids = model.encode_prompt(prompt)
    seq = tokens + ([model.eos_id] if eos else [])
    logp = torch.log_softmax(model.net(torch.tensor([ids + seq]), loops)[0].float(), dim=-1)
    return sum(float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(seq))


@pytest.mark.parametrize("cache_mode", ["fp16", "int8", "int4"])
def test_beam_size_one_is_greedy(make_artifact, cache_mode):
    model = tinyloop.load_model(make_artifact(), 256, cache_mode=cache_mode)
    for prompt in PROMPTS:
        cfg = GenerateConfig(max_tokens=16, loops=3, beam_size=1)
        greedy = generate(model, prompt, cfg)
        beam = beam_search(model, prompt, cfg)
        assert beam.tokens == greedy.tokens and beam.text == greedy.text
        assert beam.stats.stop_reason == greedy.stats.stop_reason
        assert len(beam.n_best) == 1
    # also with a stop sequence cutting the output and a repetition penalty
    free = generate(model, PROMPTS[0], GenerateConfig(max_tokens=16, loops=3)).tokens
    cfg = GenerateConfig(max_tokens=16, loops=3, stop_sequences=[[free[5]]], repetition_penalty=1.2)
    assert beam_search(model, PROMPTS[0], cfg).tokens == generate(model, PROMPTS[0], cfg).tokens


def test_beam_finds_at_least_greedy_logprob_and_scores_are_exact(tiny_model):
    model, loops = tiny_model, 4
    for prompt in PROMPTS:
        greedy = generate(model, prompt, GenerateConfig(max_tokens=12, loops=loops))
        greedy_lp = sequence_logprob(model, prompt, greedy.tokens, greedy.stats.stop_reason == "eos", loops)
        res = generate(model, prompt, GenerateConfig(max_tokens=12, loops=loops, beam_size=4))
        best = res.n_best[0]
        assert (res.tokens, res.text, res.stats.stop_reason) == (best.tokens, best.text, best.stop_reason)
        assert best.logprob >= greedy_lp - 1e-4
        assert 1 <= len(res.n_best) <= 4
        assert len({tuple(h.tokens) for h in res.n_best}) == len(res.n_best)
        assert [h.score for h in res.n_best] == sorted((h.score for h in res.n_best), reverse=True)
        for h in res.n_best:  # logprob is the model's, score its documented length normalisation
            ended_eos = h.stop_reason == "eos"
            assert h.logprob == pytest.approx(sequence_logprob(model, prompt, h.tokens, ended_eos, loops), abs=1e-3)
            assert h.score == pytest.approx(h.logprob / (len(h.tokens) + ended_eos) ** LENGTH_PENALTY)
            assert h.text == model.codec.decode(h.tokens)
    assert res.stats.generated_tokens == len(res.tokens) and res.stats.loops_mean == loops


def test_beam_with_grammar_every_hypothesis_matches(tiny_model):
    pattern = r"(yes|no|maybe)-[0-9]{2}"
    res = generate(tiny_model, "answer:", GenerateConfig(max_tokens=20, beam_size=3, grammar={"regex": pattern}))
    assert res.stats.stop_reason == "grammar_complete" and re.fullmatch(pattern, res.text)
    assert len(res.n_best) == 3 and all(re.fullmatch(pattern, h.text) for h in res.n_best)


def test_beam_with_cache_window_and_early_exit(make_artifact):
    model = tinyloop.load_model(make_artifact(), 256)
    prompt = "def add(a, b):\n    return a + b\n" * 2
    for extra in (dict(cache_window=8), dict(early_exit_threshold=0.7, loops=8)):
        cfg = GenerateConfig(max_tokens=14, beam_size=1, **extra)
        assert beam_search(model, prompt, cfg).tokens == generate(model, prompt, cfg).tokens
        wide = generate(model, prompt, GenerateConfig(max_tokens=14, beam_size=3, **extra))
        assert len(wide.tokens) == 14 and len(wide.n_best) == 3
    # a window wider than the whole sequence changes nothing
    full = generate(model, prompt, GenerateConfig(max_tokens=10, beam_size=3))
    assert generate(model, prompt, GenerateConfig(max_tokens=10, beam_size=3, cache_window=200)).tokens == full.tokens


def test_beam_streams_final_tokens_and_cancels(tiny_model):
    got: list[int] = []
    res = generate_stream(tiny_model, "import", GenerateConfig(max_tokens=10, beam_size=3),
                          lambda t, i: got.append(t) is None)
    assert got == res.tokens
    cut = generate_stream(tiny_model, "import", GenerateConfig(max_tokens=10, beam_size=3), lambda t, i: i < 3)
    assert cut.stats.stop_reason == "cancelled" and cut.tokens == res.tokens[:4]


def test_beam_rules(tiny_model):
    with pytest.raises(ConfigError, match="temperature"):
        generate(tiny_model, "a", GenerateConfig(beam_size=2, temperature=0.7))
    with pytest.raises(ModeError, match=r"Beam search.*Speculative"):
        tinyloop.generate_speculative(tiny_model, "a", tinyloop.SpeculativeConfig(2, 4, 2), GenerateConfig(beam_size=2))
    with pytest.raises(ConfigError, match="beam_size"):
        generate(tiny_model, "a", GenerateConfig(beam_size=0))
