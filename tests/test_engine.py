"""The engine's memory: one block pool per model that every cache draws from, a budget that holds, preemption
that keeps outputs exact, windows that hold O(window) blocks."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import tinyloop
from conftest import ids
from tinyloop import GenerateConfig as G
from tinyloop.memory import blocks_for


def test_absurd_lengths_raise_budget_error_before_allocating(make_artifact):
    with pytest.raises(tinyloop.BudgetError, match="max_seq_len 1000000000 does not fit"):
        tinyloop.load_model(make_artifact(), 10**9)
    with pytest.raises(tinyloop.BudgetError, match="memory_budget"):
        tinyloop.load_model(make_artifact(), 4096, memory_budget=2**20)
    with pytest.raises(tinyloop.ConfigError, match="memory_budget must be a positive"):
        tinyloop.load_model(make_artifact(), 64, memory_budget=-5)


def test_calls_that_can_never_fit_raise_budget_error(make_artifact):
    model = tinyloop.load_model(make_artifact(), 128)
    small = tinyloop.load_model(make_artifact(), 64,
                                memory_budget=tinyloop.plan_memory(model, max_seq_len=64, loops=4).total_bytes)
    with pytest.raises(tinyloop.BudgetError, match="can never fit"):  # 64 beams, a pool for one sequence
        tinyloop.generate(small, ids(8, 1), G(max_tokens=8, beam_size=64))
    with pytest.raises(tinyloop.BudgetError, match="can never fit"):
        tinyloop.generate_batch(small, [ids(8, 1)] * 3, G(max_tokens=50, loops=16))
    assert model.pool.used == small.pool.used == 0  # nothing was taken
    assert tinyloop.generate(model, ids(8, 1), G(max_tokens=4)).stats.generated_tokens == 4  # the model still serves


def test_a_sequence_holds_blocks_for_the_loops_it_runs(make_artifact):
    model = tinyloop.load_model(make_artifact(), 128)
    held = {}
    for loops in (4, 16):
        model.pool.peak_used = 0
        tinyloop.generate(model, ids(20, 2), G(max_tokens=12, loops=loops))
        held[loops] = model.pool.peak_used
        assert model.pool.used == 0  # every block went back when the call ended
    cfg = model.cfg
    assert held[4] == blocks_for(cfg, 32, 4) and held[16] == blocks_for(cfg, 32, 16)
    assert held[4] < held[16] / 2


@pytest.mark.parametrize("mode,temperature", [("fp16", 0.0), ("int8", 0.8), ("int4", 0.0)])
def test_preempted_lanes_are_recomputed_exactly(make_artifact, mode, temperature):
    """A pool with room for about three lanes runs a batch of eight: lanes wait, the youngest is preempted when the
    pool runs out, and every output equals generate of that prompt alone."""
    art = make_artifact(eos_id=319)  # an end token this random model never picks: every lane runs its full length
    probe = tinyloop.load_model(art, 96, cache_mode=mode)
    budget = tinyloop.plan_memory(probe, lanes=2, loops=4).total_bytes  # about three lanes of this batch
    model = tinyloop.load_model(art, 96, cache_mode=mode, memory_budget=budget)
    prompts = [ids(6 + 3 * i, 40 + i) for i in range(8)]
    cfgs = [G(max_tokens=30 + i, loops=4, temperature=temperature, seed=i) for i in range(8)]
    batch = tinyloop.generate_batch(model, prompts, cfgs)
    assert sum(r.stats.preempted for r in batch) > 0
    assert model.pool.peak_used <= model.pool.num_blocks and model.pool.used == 0
    for p, c, r in zip(prompts, cfgs, batch):
        alone = tinyloop.generate(probe, p, c)
        assert r.tokens == alone.tokens


def test_windowed_generation_runs_past_max_seq_len_in_bounded_blocks(make_artifact):
    art = make_artifact(eos_id=319)  # an end token this random model never picks: the run goes the full length
    short = tinyloop.load_model(art, 64)
    long = tinyloop.load_model(art, 512)
    cfg = G(max_tokens=256, loops=4, cache_window=16)
    short.pool.peak_used = 0
    out = tinyloop.generate(short, ids(8, 3), cfg)
    assert out.stats.generated_tokens == 256  # 4 x max_seq_len of the model that ran it
    assert short.pool.peak_used == short.cfg.n_slots(4)  # one 16-token block per slot: the ring
    assert out.tokens == tinyloop.generate(long, ids(8, 3), cfg).tokens


def test_handles_and_beams_share_blocks(make_artifact):
    model = tinyloop.load_model(make_artifact(), 128)
    pc = tinyloop.create_prefix_cache(model, ids(40, 4), 4)
    held = model.pool.used
    assert held == blocks_for(model.cfg, 40, 4) and pc.nbytes >= held * model.pool.block_bytes
    out = tinyloop.generate_from_prefix_cache(model, pc, ids(5, 5), G(max_tokens=6, loops=4))
    assert out.tokens == tinyloop.generate(model, ids(40, 4) + ids(5, 5), G(max_tokens=6, loops=4)).tokens
    assert model.pool.used == held  # the call's copies of the shared last block went back
    tinyloop.free_handle(pc)
    assert model.pool.used == 0
    # four beams share their prompt's three full blocks per slot and copy the rest on write
    model.pool.peak_used = 0
    tinyloop.generate(model, ids(60, 6), G(max_tokens=8, beam_size=4, loops=4))
    slots = model.cfg.n_slots(4)
    assert model.pool.peak_used <= 3 * slots + 4 * 2 * slots < 4 * blocks_for(model.cfg, 68, 4)


def test_loaded_run_stays_within_the_budget():
    """RSS growth of a process serving more concurrent sequences than its pool holds (lanes wait and are preempted)
    stays within what the plan set aside beside the weights: the block pool and one step's workspace."""
    script = textwrap.dedent("""
        import torch, tinyloop
        torch.set_num_threads(1)
        def rss():
            return int(open('/proc/self/statm').read().split()[1]) * 4096
        probe = tinyloop.load_model(None, 256)
        plan = tinyloop.plan_memory(probe, lanes=4, max_seq_len=256, loops=8)
        del probe
        model = tinyloop.load_model(None, 256, memory_budget=plan.total_bytes)
        tinyloop.generate(model, "x", tinyloop.GenerateConfig(max_tokens=2))  # start-up: fused weights, kernels
        base = rss()
        peak = [base]
        prompts = ["def f(x):\\n    return x" + " " * i for i in range(16)]
        cb = lambda lane, tok, i: peak.append(rss()) or True
        out = tinyloop.generate_batch(model, prompts, tinyloop.GenerateConfig(max_tokens=96, loops=8), cb)
        print(plan.total_bytes - plan.bytes_of("weights"), max(peak) - base, sum(r.stats.preempted for r in out),
              model.pool.peak_used, model.pool.num_blocks)
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    beside_weights, growth, preempted, peak_blocks, blocks = map(int, res.stdout.split())
    assert preempted > 0 and peak_blocks == blocks  # the load really filled the pool
    assert growth <= beside_weights, (growth, beside_weights)


@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_one_forward_runs_lanes_at_their_own_depth(bundled_model, threshold):
    """Rows with a loop count (and threshold) per lane, their tokens done in one call (Executor.decode: the executor's
    loop iterations until each token is done): each lane's logits and loops used equal that lane run alone, and a lane at fewer loops
    never writes (so never holds) the slots of the loops it does not run."""
    import torch
    from tinyloop.engine import forward as paged
    from tinyloop.engine.executor import Executor
    from tinyloop.engine.options import EngineOptions
    from tinyloop.exits import ExitRule
    model = bundled_model  # trained: its latents settle, so a threshold stops lanes early
    net, cfg = model.net, model.cfg
    prompts, loops, thresholds = [ids(7, 1), ids(4, 2), ids(9, 3)], [2, 6, 12], [threshold, 0.0, threshold]

    def run(lanes: list[int]) -> tuple[torch.Tensor, list[int], object]:
        cache = model.new_cache(len(lanes), 64)
        with torch.inference_mode():
            for j, i in enumerate(lanes):  # prefill each lane at its own depth, then one adaptive row per lane
                p = prompts[i][:-1]
                cache.lane_view(j).reserve([0], [0], [len(p)], loops[i])  # the prompt and the row, as a step takes
                paged.forward(net, torch.tensor([p]), loops[i], net.make_step(torch.arange(len(p)).unsqueeze(0)),
                               cache.lane_view(j))
            executor = Executor(model, cache, cfg.default_loops, ExitRule(), EngineOptions.from_env())
            logits, used = executor.decode([prompts[i][-1] for i in lanes], [len(prompts[i]) - 1 for i in lanes],
                                           [loops[i] for i in lanes],
                                           [ExitRule.of(thresholds[i], cfg.exit_rule) for i in lanes])
        return logits, used, cache

    together, used, cache = run([0, 1, 2])
    if threshold:
        assert used[2] < loops[2]  # the threshold stopped a lane early: its skipped loops hold copies (below)
    for i in range(3):
        alone, used_alone, _ = run([i])
        torch.testing.assert_close(together[i], alone[0], atol=1e-5, rtol=1e-5)
        assert used[i] == used_alone[0] <= loops[i]
        assert all(cache.held[cfg.core_slot(k, j)][i] == [] for k in range(loops[i], cfg.max_loops)
                   for j in range(cfg.n_core))
        assert all(cache.held[cfg.core_slot(k, j)][i] for k in range(loops[i]) for j in range(cfg.n_core))
    cache.reset()
