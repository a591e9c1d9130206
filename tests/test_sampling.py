"""The one sampler (tinyloop/sampling.py): every lane's row in one pass, each with its own settings and generator,
drawing as it would alone; the right distribution; safe at the extremes the field table admits."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import tinyloop
from conftest import ids
from tinyloop.sampling import (LaneSampling, accepts, adjust, beam_candidates, distribution, draw, filter_logits,
                               filter_rows, greedy_choice, greedy_proposals, race, residual, sample)

V = 50


def lanes(seed: int = 0) -> list[LaneSampling]:
    """Five lanes that differ in every setting (fresh generators: the same seeds give the same draws)."""
    gen = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    return [LaneSampling(0.0, 0, 1.0, 1.0, [], None),
            LaneSampling(1.0, 0, 1.0, 1.0, [], gen(seed + 1)),
            LaneSampling(0.7, 5, 1.0, 1.0, [], gen(seed + 2)),
            LaneSampling(1.3, 0, 0.6, 1.0, [], gen(seed + 3)),
            LaneSampling(0.9, 10, 0.9, 1.8, [3, 7, 7, 11], gen(seed + 4))]


def test_a_lane_draws_the_same_alone_or_in_a_batch():
    rows = torch.randn(5, V, generator=torch.Generator().manual_seed(7)) * 3
    batched, alone = lanes(), lanes()
    for _ in range(20):
        together = sample(rows, batched)
        one_by_one = [sample(rows[i:i + 1], [alone[i]])[0] for i in range(5)]
        assert together == one_by_one
    assert together[0] == int(rows[0].argmax())


def test_rows_are_filtered_by_their_own_settings():
    rows = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    t, k, p = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([3, 0, 7]), torch.tensor([1.0, 0.5, 0.8])
    together = filter_rows(rows, t, k, p)
    for i in range(3):
        assert torch.equal(together[i], filter_logits(rows[i], float(t[i]), int(k[i]), float(p[i])))
    assert int(torch.isfinite(together[0]).sum()) == 3


def test_the_race_draws_from_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    lane = LaneSampling(1.0, 0, 1.0, 1.0, [], torch.Generator().manual_seed(0))
    n = 20000
    counts = torch.bincount(torch.tensor([sample(logits[None], [lane])[0] for _ in range(n)]), minlength=5)
    expected = torch.softmax(logits, -1) * n
    assert ((counts - expected).abs() <= 4 * expected.sqrt() + 5).all(), (counts, expected)


def test_extreme_settings_stay_finite_and_batch_mates_are_untouched():
    model = tinyloop.load_model(None, 256)
    greedy = tinyloop.GenerateConfig(max_tokens=12)
    alone = tinyloop.generate(model, "def f(x):", greedy).tokens
    tiny_t = tinyloop.GenerateConfig(max_tokens=12, temperature=1e-38, seed=1)  # below the floor: greedy
    tiny_penalty = tinyloop.GenerateConfig(max_tokens=12, temperature=0.8, repetition_penalty=1e-45, seed=2)
    results = tinyloop.generate_batch(model, ["def f(x):"] * 3, [greedy, tiny_t, tiny_penalty])
    assert results[0].tokens == alone and results[1].tokens == alone
    assert results[2].stats.generated_tokens >= 1 and results[2].stats.stop_reason in ("max_tokens", "eos")


def test_presence_frequency_bias_and_bans_adjust_their_rows_only():
    from tinyloop.sampling import adjust

    rows = torch.zeros(2, 10)
    plain = LaneSampling(1.0, 0, 1.0, 1.0, [], None)
    lane = LaneSampling(1.0, 0, 1.0, 1.0, [1, 5, 5, 7], None, presence_penalty=0.5, frequency_penalty=1.0,
                        output=[5, 5, 7], bias={2: 3.0}, banned=[9])
    out = adjust(rows, [plain, lane])
    assert torch.equal(out[0], rows[0])
    assert out[1, 5] == -2.5 and out[1, 7] == -1.5 and out[1, 2] == 3.0 and out[1, 9] == float("-inf")
    assert out[1, 1] == 0.0  # a prompt token: the presence and frequency penalties count the output only


def test_min_p_keeps_tokens_near_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    kept = torch.isfinite(filter_rows(logits, torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1),
                                      torch.tensor([0.15])))
    assert kept.tolist() == [[True, True, True, False, False]]  # p >= 0.15 x 0.5


def test_ignore_eos_min_tokens_and_stop_token_ids(bundled_model):
    model, eos = bundled_model, bundled_model.eos_id
    forced = {eos: 100.0}  # the model would end at once
    ended = tinyloop.generate(model, "def f(x):", tinyloop.GenerateConfig(max_tokens=8, logit_bias=forced))
    assert ended.tokens == [] and ended.stats.stop_reason == "eos"
    kept = tinyloop.generate(model, "def f(x):", tinyloop.GenerateConfig(max_tokens=8, logit_bias=forced, ignore_eos=True))
    assert kept.stats.generated_tokens == 8 and kept.stats.stop_reason == "max_tokens"
    held = tinyloop.generate(model, "def f(x):", tinyloop.GenerateConfig(max_tokens=8, logit_bias=forced, min_tokens=5))
    assert held.stats.generated_tokens == 5 and held.stats.stop_reason == "eos" and eos not in held.tokens
    free = tinyloop.generate(model, "def f(x):", tinyloop.GenerateConfig(max_tokens=12)).tokens
    stop = free[3]
    cut = tinyloop.generate(model, "def f(x):", tinyloop.GenerateConfig(max_tokens=12, stop_token_ids=[stop]))
    assert cut.tokens == free[:free.index(stop)] and cut.stats.stop_reason == "stop_sequence"
    late = tinyloop.generate(model, "def f(x):",
                             tinyloop.GenerateConfig(max_tokens=12, stop_token_ids=[stop], min_tokens=6))
    assert len(late.tokens) >= 6 and stop not in late.tokens[:6]
    with pytest.raises(tinyloop.ConfigError, match="logit_bias"):
        tinyloop.generate(model, "x", tinyloop.GenerateConfig(logit_bias={10**6: 1.0}))
    with pytest.raises(tinyloop.ConfigError, match="presence_penalty"):
        tinyloop.generate(model, "x", tinyloop.GenerateConfig(presence_penalty=float("nan")))


# --- the rules every token choice goes through -----------------------------------------------------------------
def test_the_greedy_choice_takes_the_first_of_equal_maxima():
    rows = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0], [-1.0, -5.0, -1.0, float("-inf")]])
    assert greedy_choice(rows).tolist() == [1, 0, 0]
    assert sample(rows, [LaneSampling(0.0, 0, 1.0, 1.0, [], None)] * 3) == [1, 0, 0]
    assert greedy_proposals(rows[0], 1)[0] == [1] and greedy_proposals(rows[0], 2)[0] in ([1, 3], [3, 1])


def test_a_plain_argmax_is_a_greedy_lane_that_nothing_adjusts():
    plain = LaneSampling(0.0, 0, 1.0, 1.0, [3, 4], None)
    assert plain.greedy and plain.plain_argmax
    assert LaneSampling(1e-6, 40, 0.5, 1.0, [], None).plain_argmax  # below MIN_TEMPERATURE; filters choose nothing
    for changed in (dict(temperature=0.5), dict(repetition_penalty=1.1), dict(presence_penalty=0.2),
                    dict(frequency_penalty=0.1), dict(bias={3: 1.0}), dict(banned=[0]), dict(constrained=True)):
        assert not dataclasses.replace(plain, **changed).plain_argmax, changed
    rows = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    assert sample(rows, [plain] * 4) == greedy_choice(rows).tolist()  # its adjusted rows are its raw ones


def test_a_sampled_lane_races_over_its_distribution():
    """sample is the rules composed: a greedy lane's greedy choice, the others' race over their distribution, each
    from its own generator; one row's distribution is filter_logits' softmax, min-p included."""
    rows = torch.randn(5, V, generator=torch.Generator().manual_seed(5)) * 3
    mine, theirs = lanes(3), lanes(3)
    hot = [1, 2, 3, 4]
    for _ in range(10):
        adjusted = adjust(rows, theirs)[hot]
        expected = race(distribution(adjusted, [theirs[i] for i in hot]), [theirs[i].generator for i in hot])
        assert sample(rows, mine) == [int(greedy_choice(rows[0]))] + expected.tolist()
    for lane in lanes()[1:4]:
        assert torch.equal(distribution(rows[:1], [lane])[0],
                           torch.softmax(filter_logits(rows[0], lane.temperature, lane.top_k, lane.top_p), dim=-1))
    floor = LaneSampling(1.0, 0, 1.0, 1.0, [], None, min_p=0.15)
    probs = distribution(torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]])), [floor])[0]
    assert (probs > 0).tolist() == [True, True, True, False, False] and float(probs.sum()) == pytest.approx(1.0)


def test_accepting_drafts_and_drawing_the_residual_keeps_the_target():
    """Speculative sampling's rules: a draft drawn from q kept with probability min(1, p/q), else a token from the
    residual max(0, p - q): the tokens come out distributed as p."""
    p, q = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0]), torch.tensor([0.1, 0.5, 0.1, 0.1, 0.2])
    assert torch.allclose(residual(p, q), torch.tensor([0.8, 0.0, 0.2, 0.0, 0.0]))
    assert torch.equal(residual(q, q), q)  # no mass beyond the draft: the target itself
    gen = torch.Generator().manual_seed(0)
    assert all(accepts(0, p, q, gen) for _ in range(100))  # p >= q: always kept
    assert not any(accepts(4, p, q, gen) for _ in range(100))  # p = 0: never
    n, counts = 10000, torch.zeros(5)
    for _ in range(n):
        x = draw(q, gen)[0]
        counts[x if accepts(x, p, q, gen) else draw(residual(p, q), gen)[0]] += 1
    expected = p * n
    assert ((counts - expected).abs() <= 4 * expected.sqrt() + 5).all(), (counts, expected)
    again = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert draw(q, again[0], 6) == draw(q, again[1], 6)  # a lane's draws are its generator's alone


def test_beam_candidates_are_the_top_log_probabilities_the_grammar_allows():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0, 2.5])
    logp = torch.log_softmax(logits, dim=-1)
    got = beam_candidates(logits, 3)
    assert [t for _, t in got] == [1, 4, 2] and [lp for lp, _ in got] == logp[[1, 4, 2]].tolist()
    only_2 = torch.tensor([True, True, False, True, True])
    masked = beam_candidates(logits, 3, lambda x: x.masked_fill(only_2, float("-inf")))
    assert masked == [(float(logp[2]), 2)]  # the model's log-probability (not renormalised); forbidden ones left out


def test_tokens_drawn_ahead_in_c_are_the_samplers_greedy_choice(make_artifact, monkeypatch):
    """Greedy rows draw their next tokens inside the C passes (the scheduler's run-ahead, for lanes whose choice is a
    plain argmax: LaneSampling.plain_argmax). Asking for log-probabilities, they bring back the logits each draw was
    taken from (Until.kept): every token C drew is the sampler's greedy choice of them, beside a sampled row and one
    exiting early, and every request equals itself alone; among equal maxima both take the first."""
    from tinyloop import GenerateConfig as G
    from tinyloop.kernels import cpu_block
    model = tinyloop.load_model(make_artifact(), 128)
    drawn = []  # (token C drew, the logits it drew it from)
    until = cpu_block.DecodeStep.iterate_until

    def spying(*a, **k):
        got = until(*a, **k)
        for tokens, kept in zip(got.drawn, got.kept):
            if tokens and kept is not None:
                drawn.extend((token, row.clone()) for (token, _), row in zip(tokens, kept))
        return got
    monkeypatch.setattr(cpu_block.DecodeStep, "iterate_until", spying)
    cfgs = [G(max_tokens=30, loops=4, logprobs=2, ignore_eos=True),
            G(max_tokens=24, loops=6, logprobs=1, ignore_eos=True, early_exit_threshold=0.25),
            G(max_tokens=10, loops=5, temperature=0.9, seed=3, ignore_eos=True),
            G(max_tokens=20, loops=3, logprobs=1)]
    prompts = [ids(4 + i, 30 + i) for i in range(len(cfgs))]
    sched = tinyloop.Scheduler(model, lanes=len(cfgs))
    seqs = [sched.submit(p, c) for p, c in zip(prompts, cfgs)]
    while not sched.idle():
        sched.step()
    assert len(drawn) > 30  # most of the greedy rows' tokens were drawn in C
    greedy = LaneSampling(0.0, 0, 1.0, 1.0, [], None)
    for token, logits in drawn:
        assert token == int(greedy_choice(logits)) == sample(logits[None], [greedy])[0]
    for p, c, seq in zip(prompts, cfgs, seqs):
        got, alone = seq.result(), tinyloop.generate(model, p, c)
        assert (got.tokens, got.logprobs, got.top_logprobs) == (alone.tokens, alone.logprobs, alone.top_logprobs), c
    # ties: the tied head's rows (the embeddings) made r / 2, with r at 100..149 and -r at 200..249, give 50 equal
    # maxima at 100..149 (or, where the state's logit of r is negative, at 200..249): C takes the first of them, as
    # greedy_choice does
    with torch.no_grad():
        w = model.net.embed.weight
        r = w[7].clone()
        w[:] = r / 2
        w[100:150], w[200:250] = r, -r
    drawn.clear()
    tied = tinyloop.generate(model, prompts[0], G(max_tokens=12, loops=4, logprobs=1, ignore_eos=True))
    assert len(drawn) >= 8 and set(tied.tokens) <= {100, 200}
    for token, logits in drawn:
        assert int((logits == logits.max()).sum()) == 50 and token == int(greedy_choice(logits))
