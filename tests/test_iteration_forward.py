"""tinyloop/engine/iteration.py: one iteration-level step (rows at different loop indices in one forward) against
the token-level forward. Lanes at different depths decoded through a schedule of iteration steps give each lane the
logits and the KV cache of that lane decoded alone at its own loop count: bit for bit on the C step, to fp32 rounding
through torch."""
from __future__ import annotations

import pytest
import torch

import tinyloop
from tinyloop.cache import KVCache
from tinyloop.config import ModelConfig
from tinyloop.engine import forward as paged
from tinyloop.engine.iteration import iterate
from tinyloop.kernels import cpu_block
from tinyloop.model import LoopedLM, fused_weights, quantize_weights

from test_cpu_kernels import needs_kernels

SMALL = dict(vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, n_prelude=1, n_core=2, n_coda=1,
             max_loops=9, injection="adapter", state_init="normal", sandwich_norm=True)


@pytest.fixture(scope="module")
def bundled() -> LoopedLM:
    return tinyloop.load_model().net


def small_net(**over) -> LoopedLM:
    torch.manual_seed(0)
    net = LoopedLM(ModelConfig(**{**SMALL, **over}), 128).eval().requires_grad_(False)
    with torch.no_grad():  # norms and biases away from their init, so a dropped one shows
        for name, p in net.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape) * 0.1)
    return net


def prefilled(net: LoopedLM, depths: list[int], prompt: list[int], mode: str, window: int = 0) -> KVCache:
    """A cache whose lane i holds a prompt of prompt[i] tokens prefilled at depths[i] loops."""
    cache = KVCache(net.cfg, len(depths), 128, mode, window=window, dtype=net.embed.weight.dtype).reserve_all()
    gen = torch.Generator().manual_seed(5)
    for lane, (loops, n) in enumerate(zip(depths, prompt)):
        ids = torch.randint(0, net.cfg.vocab_size, (1, n), generator=gen)
        paged.forward(net, ids, loops, net.make_step(torch.arange(n).unsqueeze(0)), cache.lane_view(lane))
    return cache


def alone(net: LoopedLM, depths: list[int], prompt: list[int], feed: list[list[int]], mode: str, window: int = 0):
    """Each lane's tokens decoded one at a time at its own loop count: logits per lane [tokens, V], and the cache."""
    cache = prefilled(net, depths, prompt, mode, window)
    out = []
    for lane, (loops, toks) in enumerate(zip(depths, feed)):
        view = cache.lane_view(lane)
        out.append(torch.stack([paged.decode_rows(net, [t], [prompt[lane] + i], loops, view)[0]
                                for i, t in enumerate(toks)]))
    return out, cache


def iterated(net: LoopedLM, depths: list[int], prompt: list[int], feed: list[list[int]], mode: str,
             window: int = 0):
    """The same tokens through iteration steps: each step runs every unfinished lane's next core pass (a lane whose
    token finished starts its next one at the next step), rows of lanes at different loop indices in one forward.
    Returns the logits per lane, the cache and the loop indices of each step's rows."""
    cache = prefilled(net, depths, prompt, mode, window)
    d, n = net.cfg.d_model, len(depths)
    e, s = (torch.zeros(n, 1, d, dtype=net.embed.weight.dtype) for _ in range(2))  # each lane's latent between steps
    done, loop, out, seen = [0] * n, [0] * n, [[] for _ in range(n)], []
    while any(done[i] < len(feed[i]) for i in range(n)):
        rows = [i for i in range(n) if done[i] < len(feed[i])]
        finish = [loop[i] == depths[i] - 1 for i in rows]
        latent = paged.Latent(e[rows].clone(), s[rows].clone())
        logits = iterate(net, cache, [prompt[i] + done[i] for i in rows], [loop[i] for i in rows],
                         [feed[i][done[i]] if loop[i] == 0 else None for i in rows], finish, latent, lanes=rows)
        assert logits.shape == (sum(finish), net.cfg.vocab_size)
        e[rows], s[rows] = latent.e, latent.s
        seen.append([loop[i] for i in rows])
        ended = [i for i, f in zip(rows, finish) if f]
        for i, row in zip(ended, logits):
            out[i].append(row)
            done[i], loop[i] = done[i] + 1, -1
        for i in rows:
            loop[i] += 1
    return [torch.stack(o) for o in out], cache, seen


DEPTHS, PROMPT = [2, 5, 8], [7, 19, 3]


def check(net: LoopedLM, mode: str, exact: bool, took: str, depths: list[int] = DEPTHS,
          prompt: list[int] = PROMPT, window: int = 0, atol: float = 1e-5) -> None:
    calls = []
    real = cpu_block.DecodeStep.iterate
    with pytest.MonkeyPatch.context() as m, torch.inference_mode():
        m.setattr(cpu_block.DecodeStep, "iterate", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
        gen = torch.Generator().manual_seed(9)
        toks = torch.randint(0, net.cfg.vocab_size, (len(depths), 3), generator=gen).tolist()
        want, ref = alone(net, depths, prompt, toks, mode, window)
        got, cache, seen = iterated(net, depths, prompt, toks, mode, window)
    assert bool(calls) == (took == "c") and len(calls) in (0, len(seen))
    assert any(len(set(rows)) == len(rows) > 1 for rows in seen)  # rows at different loop indices shared steps
    for lane in range(len(depths)):
        if exact:
            assert torch.equal(got[lane], want[lane]), lane
        else:
            torch.testing.assert_close(got[lane], want[lane], atol=atol, rtol=0)
    for name in cache.store:
        a, b = cache.dense(name), ref.dense(name)
        assert torch.equal(a, b) if exact else torch.allclose(a.float(), b.float(), atol=atol, rtol=0), name


@needs_kernels
def test_the_c_step_gives_each_lane_its_tokens_decoded_alone(bundled):
    check(bundled, "fp16", exact=True, took="c")


@needs_kernels
def test_the_c_step_on_a_random_config():
    check(small_net(), "fp16", exact=True, took="c")


@needs_kernels
@pytest.mark.parametrize("c_step", [True, False])
def test_a_token_of_one_loop_starts_and_finishes_in_one_step(c_step, monkeypatch):
    if not c_step:
        monkeypatch.setattr(cpu_block, "supported", lambda *a: False)
    check(small_net(), "fp16", exact=c_step, took="c" if c_step else "torch", depths=[1, 3, 2], prompt=[4, 17, 30])


@needs_kernels
def test_c_blocks_run_each_loop_group_where_the_c_step_does_not_fit():
    """int4 weights of a width their groups do not divide: the C blocks take the model, the whole C step does not
    (its head would be padded), so each group of rows at one loop index runs its pass through the C blocks."""
    net = small_net(d_model=72, n_heads=3, n_kv_heads=1)
    quantize_weights(net, "int4", 32)
    assert cpu_block.decode_step(net, fused_weights(net)) is None
    check(net, "fp16", exact=True, took="torch")


@pytest.mark.parametrize("how", ["no_kernels", "int8_cache"])
def test_the_torch_step_gives_each_lane_its_tokens_decoded_alone(how, bundled, monkeypatch):
    if how == "no_kernels":
        monkeypatch.setenv("TINYLOOP_CPU_KERNELS", "0")
    check(bundled, "int8" if how == "int8_cache" else "fp16", exact=False, took="torch")


@pytest.mark.parametrize("over", [{}, dict(injection="add", state_init="embed", qk_bias=True)])
def test_the_torch_step_on_random_configs(over, monkeypatch):
    monkeypatch.setenv("TINYLOOP_CPU_KERNELS", "0")
    check(small_net(**over), "fp16", exact=False, took="torch")


def test_a_bf16_model_runs_the_torch_step():
    """bf16 products depend on the batch's shape (torch's): a few of bf16's steps (2^-7 at 1) apart."""
    check(small_net().to(torch.bfloat16), "fp16", exact=False, took="torch", atol=3 * 2 ** -7)


def test_a_sliding_window_runs_the_torch_step():
    """A windowed cache (rings of 8 cells, prompts longer than them) is not the C step's: torch runs it."""
    check(small_net(), "fp16", exact=False, took="torch", prompt=[5, 12, 3], window=8)


@pytest.mark.parametrize("c_step", [True, False])
def test_a_step_copies_a_shared_block_before_writing_it(c_step, monkeypatch):
    """Lane 1 shares lane 0's blocks (a beam's fork): taking lane 1's blocks for its next cell (a step's schedule)
    copies the shared ones, its passes at loops 0 and then 1 write those copies, and lane 0 keeps what it held."""
    if not c_step:
        monkeypatch.setattr(cpu_block, "supported", lambda *a: False)
    net = small_net()
    with torch.inference_mode():
        cache = prefilled(net, [3, 3], [10, 1], "fp16")
        cache.assign_lanes([1], [0])
        before = cache.dense("k")[:, 0].clone()
        latent = paged.Latent.empty(1, 1, net)
        cache.reserve([1], [10], [10], 2)
        for k, token in ((0, 5), (1, None)):
            iterate(net, cache, [10], [k], [token], [k == 1], latent, lanes=[1])
        after = cache.dense("k")
    assert torch.equal(after[:, 0], before)
    written = [net.cfg.core_slot(k, j) for k in (0, 1) for j in range(net.cfg.n_core)]
    assert all(after[slot, 1, 10].abs().sum() > 0 for slot in [0, *written, net.cfg.coda_slot(0)])
    assert torch.equal(after[:, 1, :10], before[:, :10])


def test_a_bad_step_is_a_clear_error():
    net = small_net()
    cache = KVCache(net.cfg, 2, 128, "fp16").reserve_all()
    lat = paged.Latent.empty(2, 1, net)
    with torch.inference_mode():
        for args, what in ((([0, 0], [0], [1, 2], [False, False]), "one or more rows"),
                           (([0, 0], [0, 9], [1, None], [False, False]), "loop index 9 is outside 0..8"),
                           (([0, 0], [0, 3], [1, 2], [False, False]), "starts a token at loop index 3"),
                           (([0, 0], [0, -1], [1, None], [False, False]), "loop index -1")):
            with pytest.raises(ValueError, match=what):
                iterate(net, cache, *args, lat)
        with pytest.raises(ValueError, match="one row per lane"):
            iterate(net, cache, [0, 0], [0, 0], [1, 2], [True, True], lat, lanes=[1, 1])
        with pytest.raises(ValueError, match="latent.e must hold 2 rows"):
            iterate(net, cache, [0, 0], [0, 0], [1, 2], [True, True], paged.Latent.empty(3, 1, net))
