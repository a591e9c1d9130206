"""The one sampler (tinyloop/sampling.py): every lane's row in one pass, each with its own settings and generator,
drawing as it would alone; the right distribution; safe at the extremes the field table admits."""
from __future__ import annotations

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
