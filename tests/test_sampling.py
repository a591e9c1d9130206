"""The one sampler (tinyloop/sampling.py): every lane's row in one pass, each with its own settings and generator,
drawing as it would alone; the right distribution; safe at the extremes the field table admits."""
from __future__ import annotations

import pytest
import torch

import tinyloop
from tinyloop.sampling import LaneSampling, filter_logits, filter_rows, sample

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
