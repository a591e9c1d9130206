"""The scheduler (tinyloop.Scheduler, engine/runner.py): sequences join and leave at step boundaries, long prompts are
prefilled in pieces between decode steps, lanes of different loop counts run in one batch, admission follows free
blocks; every output equals generate of that request alone."""
from __future__ import annotations

import logging
import pytest
import torch

import tinyloop
from conftest import ids
from tinyloop import GenerateConfig as G
from tinyloop.engine.runner import Runner


def drain(sched: tinyloop.Scheduler) -> None:
    while not sched.idle():
        sched.step()


@pytest.mark.parametrize("mode", ["fp16", "int8", "int4"])
def test_joins_and_leaves_keep_every_request_exact(make_artifact, mode):
    """Requests with different loops, temperatures, seeds, stops, grammars, max_tokens and early-exit thresholds join a
    running batch at different steps, one is cancelled midway; each result equals generate alone."""
    model = tinyloop.load_model(make_artifact(), 128, cache_mode=mode)
    model.prefill_chunk = 8
    cfgs = [G(max_tokens=20, loops=4), G(max_tokens=9, loops=16, temperature=0.9, seed=2),
            G(max_tokens=14, loops=2, stop_sequences=[[7, 8]]), G(max_tokens=12, loops=4, early_exit_threshold=0.2),
            G(max_tokens=16, loops=8, temperature=0.7, top_k=5, seed=11), G(max_tokens=10, grammar={"regex": "[ab ]+"}),
            G(max_tokens=30, loops=4)]
    prompts = [ids(5 + 4 * i, 100 + i) for i in range(len(cfgs))]
    sched = tinyloop.Scheduler(model, lanes=4)
    seqs, depths = [], set()
    for step in range(200):
        if step % 3 == 0 and len(seqs) < len(cfgs):  # a newcomer every third step
            seqs.append(sched.submit(prompts[len(seqs)], cfgs[len(seqs)]))
        if step == 2:  # (after its first decode step: a greedy lane alone draws up to a block of tokens a step)
            seqs[0].cancel()
        depths.add(len({s.loops for s in sched.runner.scheduler.admitted}))
        sched.step()
        if sched.idle() and len(seqs) == len(cfgs):
            break
    assert max(depths) >= 3  # lanes at three loop counts ran in one batch
    assert model.pool.used == 0  # every lane gave its blocks back
    cancelled = seqs[0].result()
    assert cancelled.stats.stop_reason == "cancelled"
    assert cancelled.tokens == tinyloop.generate(model, prompts[0], cfgs[0]).tokens[:len(cancelled.tokens)]
    for p, c, s in zip(prompts[1:], cfgs[1:], seqs[1:]):
        alone = tinyloop.generate(model, p, c)
        assert s.result().tokens == alone.tokens and s.result().stats.stop_reason == alone.stats.stop_reason


def test_a_long_prompt_is_prefilled_between_decode_steps(make_artifact):
    """A running stream gets a token or more every step while a 100-token prompt joins in 16-token pieces; the
    newcomer's prompt is cut at the same places as generate alone cuts it, so its output is the same."""
    model = tinyloop.load_model(make_artifact(eos_id=319), 256)
    model.prefill_chunk = 16
    sched = tinyloop.Scheduler(model, lanes=4)
    running = sched.submit(ids(6, 1), G(max_tokens=40))
    for _ in range(3):
        sched.step()
    newcomer = sched.submit(ids(100, 2), G(max_tokens=5))
    steps = 0
    while newcomer.count == 0:
        before = running.count
        sched.step()
        steps += 1
        assert running.count >= before + 1  # the stream was not stalled by the long prefill (once the prompt is
        # in, the greedy lane may draw several tokens in C in the same step)
    assert steps == 7  # ceil(100 / 16) pieces, one per step
    drain(sched)
    assert newcomer.result().tokens == tinyloop.generate(model, ids(100, 2), G(max_tokens=5)).tokens
    assert running.result().tokens == tinyloop.generate(model, ids(6, 1), G(max_tokens=40)).tokens
    model.prefill_chunk = 0  # the prompt in one forward: other pieces, the same tokens here
    assert newcomer.result().tokens == tinyloop.generate(model, ids(100, 2), G(max_tokens=5)).tokens


def test_admission_waits_for_free_blocks_and_preempts_exactly(make_artifact):
    """A pool with room for about three sequences and eight lanes: newcomers wait for blocks, a full pool preempts the
    youngest (recomputed exactly later, its prompt log-probabilities noted once), nothing crashes, and a request that
    can never fit is refused at submit."""
    art = make_artifact(eos_id=319)
    probe = tinyloop.load_model(art, 96)
    model = tinyloop.load_model(art, 96, memory_budget=tinyloop.plan_memory(probe, lanes=2, loops=4).total_bytes)
    model.prefill_chunk = 8  # (a prompt preempted between its pieces runs them again)
    sched = tinyloop.Scheduler(model, lanes=8)
    cfgs = [G(max_tokens=30 + i, loops=4, temperature=0.8 * (i % 2), seed=i, prompt_logprobs=i % 3 or None)
            for i in range(8)]
    seqs = [sched.submit(ids(6 + 3 * i, 40 + i), c) for i, c in enumerate(cfgs)]
    waited = 0
    while not sched.idle():
        waited += bool(sched.runner.scheduler.waiting and sched.runner.scheduler.free_lanes)
        sched.step()
        assert model.pool.used <= model.pool.num_blocks
    assert waited > 0 and sum(s.stats.preempted for s in seqs) > 0
    assert any(s.stats.preempted for s, c in zip(seqs, cfgs) if c.prompt_logprobs)
    for i, (c, s) in enumerate(zip(cfgs, seqs)):
        alone = tinyloop.generate(probe, ids(6 + 3 * i, 40 + i), c)
        assert s.result().tokens == alone.tokens
        assert s.result().prompt_logprobs == alone.prompt_logprobs  # (None where not asked)
        assert s.result().prompt_top_logprobs == alone.prompt_top_logprobs
    with pytest.raises(tinyloop.BudgetError, match="can never fit"):
        sched.submit(ids(8, 1), G(max_tokens=80, loops=16))


def test_greedy_draws_stop_at_their_block_where_the_pool_has_no_room_for_the_next(make_artifact, caplog):
    """Greedy rows draw tokens inside a C call on cells the scheduler took for them, past their block's end when the
    next block can be had; in a pool with no room for it their draws stop at the block's end instead, and every
    request still gets the tokens it gets alone."""
    art = make_artifact()
    probe = tinyloop.load_model(art, 96)
    model = tinyloop.load_model(art, 96, memory_budget=tinyloop.plan_memory(probe, lanes=1, loops=4).total_bytes)
    sched = tinyloop.Scheduler(model, lanes=2)
    cfgs = [G(max_tokens=60, loops=4, ignore_eos=True), G(max_tokens=50, loops=4, ignore_eos=True)]
    with caplog.at_level(logging.DEBUG, logger="tinyloop.scheduler"):
        seqs = [sched.submit(ids(10 + 7 * i, 40 + i), c) for i, c in enumerate(cfgs)]
        while not sched.idle():
            sched.step()
            assert model.pool.used <= model.pool.num_blocks
    assert any("no room for the blocks of greedy draws" in r.message for r in caplog.records)
    for i, (c, s) in enumerate(zip(cfgs, seqs)):
        assert s.result().tokens == tinyloop.generate(probe, ids(10 + 7 * i, 40 + i), c).tokens


def test_a_prompt_preempted_between_its_pieces_notes_its_log_probabilities_once(make_artifact):
    """A request asking for prompt log-probabilities, preempted after two of its prefill pieces, runs them again when
    it rejoins: each prompt token is scored once, as alone."""
    model = tinyloop.load_model(make_artifact(eos_id=319), 96)
    model.prefill_chunk = 8
    cfg, prompt = G(max_tokens=6, loops=4, prompt_logprobs=2), ids(30, 7)
    sched = tinyloop.Scheduler(model, lanes=2)
    seq = sched.submit(prompt, cfg)
    sched.step()
    sched.step()
    engine = sched.runner.scheduler
    assert seq.place.cached == len(seq.prompt_scores) == 16  # (row i predicts token i + 1)
    engine.preempt(seq)
    drain(sched)
    alone = tinyloop.generate(model, prompt, cfg)
    got = seq.result()
    assert got.stats.preempted == 1 and got.tokens == alone.tokens
    assert got.prompt_logprobs == alone.prompt_logprobs and got.prompt_top_logprobs == alone.prompt_top_logprobs


def test_a_thousand_prompts_hold_a_bounded_number_of_lanes(make_artifact, monkeypatch):
    model = tinyloop.load_model(make_artifact(), 64)
    made = []
    real_init = tinyloop.KVCache.__init__

    def spy(self, cfg, lanes, *a, **k):
        made.append(lanes)
        real_init(self, cfg, lanes, *a, **k)

    monkeypatch.setattr(tinyloop.KVCache, "__init__", spy)
    prompts = [ids(3, i) for i in range(1000)]
    out = tinyloop.generate_batch(model, prompts, G(max_tokens=2, loops=2))
    assert len(out) == 1000 and made == [32]  # one cache of 32 lanes, lanes reused as prompts finish
    for i in (0, 517, 999):
        assert out[i].tokens == tinyloop.generate(model, prompts[i], G(max_tokens=2, loops=2)).tokens


def test_batch_lanes_may_run_at_different_depths(make_artifact):
    model = tinyloop.load_model(make_artifact(), 128)
    cfgs = [G(max_tokens=12, loops=4), G(max_tokens=12, loops=16), G(max_tokens=12, loops=4, early_exit_threshold=0.3)]
    out = tinyloop.generate_batch(model, [ids(9, 1), ids(9, 2), ids(9, 3)], cfgs)
    for i, (c, r) in enumerate(zip(cfgs, out)):
        assert r.tokens == tinyloop.generate(model, ids(9, i + 1), c).tokens
    assert out[1].stats.loops_mean == 16 and out[0].stats.loops_mean == 4


@pytest.mark.parametrize("mode", ["fp16", "int8", "int4"])
def test_speculative_and_resume_lanes_join_a_running_batch_exactly(make_artifact, mode):
    """Greedy and seeded sampled speculative lanes, a tree, a greedy refine and a sampled resume join a batch of plain
    lanes at different steps; every request equals the same request alone, and the plain lanes stay exact too."""
    model = tinyloop.load_model(make_artifact(), 128, cache_mode=mode)
    S = tinyloop.SpeculativeConfig
    handle = tinyloop.build_resume_handle(model, ids(9, 40), 2)
    mine = tinyloop.build_resume_handle(model, ids(9, 40), 2)
    jobs = [("plain", ids(6, 1), G(max_tokens=30, loops=4), None),
            ("spec", ids(7, 2), G(max_tokens=20, loops=6), S(2, 6, 3)),
            ("plain", ids(8, 3), G(max_tokens=12, loops=6, temperature=0.8, seed=9), None),
            ("spec", ids(5, 4), G(max_tokens=16, temperature=0.9, seed=4), S(1, 4, 2)),
            ("spec", ids(6, 5), G(max_tokens=14, loops=5), S(2, 5, 2, 2)),
            ("resume", None, G(max_tokens=16, loops=6), None),
            ("resume", None, G(max_tokens=12, loops=4, temperature=0.7, seed=8), None)]
    sched, seqs = tinyloop.Scheduler(model, lanes=4), []
    for step in range(400):
        if step % 2 == 0 and len(seqs) < len(jobs):
            kind, prompt, cfg, sc = jobs[len(seqs)]
            if kind == "resume":
                if any(k == "resume" and not s.done for (k, *_), s in zip(jobs, seqs)):
                    sched.step()
                    continue  # a handle serves one call at a time
                seqs.append(sched.resume(handle, cfg))
            else:
                seqs.append(sched.submit(prompt, cfg, speculative=sc))
        sched.step()
        if sched.idle() and len(seqs) == len(jobs):
            break
    for (kind, prompt, cfg, sc), seq in zip(jobs, seqs):
        if kind == "plain":
            alone = tinyloop.generate(model, prompt, cfg)
        elif kind == "spec":
            alone = tinyloop.generate_speculative(model, prompt, sc, cfg)
        else:
            alone = tinyloop.resume_generate(mine, cfg.loops, cfg)
        assert seq.result().tokens == alone.tokens, (kind, cfg)
        assert seq.result().stats.stop_reason == alone.stats.stop_reason
    tinyloop.free_handle(handle)
    tinyloop.free_handle(mine)
    assert model.pool.used == 0  # every lane gave its blocks back, and the handles theirs


def test_schedule_takes_the_blocks_and_execute_takes_none(make_artifact, monkeypatch):
    """The step is schedule -> execute -> postprocess: every block the forwards write is taken while scheduling (a
    forward that finds one missing raises), none inside execute: prefill pieces, decode rows at several depths, early
    exit, a speculative lane's rounds, a beam request, a prompt whose prefix the prefix cache lends, a resume handle
    that lends its blocks and runs the loops it lacks, a windowed lane, and a preempted request recomputed. Prefix and
    resume handles (a windowed one too) are built by steps of the engine: no block is taken outside a step for them."""
    from tinyloop.cache import BlockPool

    art = make_artifact()
    model = tinyloop.load_model(art, 128, prefix_caching=True)
    model.prefill_chunk = 8
    takes = {"outside": 0, "schedule": 0, "execute": 0}
    phase = {"now": "outside"}
    take = BlockPool.take_many
    monkeypatch.setattr(BlockPool, "take_many",
                        lambda pool, n: (takes.__setitem__(phase["now"], takes[phase["now"]] + n), take(pool, n))[1])
    execute, step = Runner.execute, Runner.step

    def watched(self, plan):
        phase["now"] = "execute"
        try:
            return execute(self, plan)
        finally:
            phase["now"] = "schedule"

    def stepped(self):
        phase["now"] = "schedule"
        try:
            return step(self)
        finally:
            phase["now"] = "outside"

    monkeypatch.setattr(Runner, "execute", watched)
    monkeypatch.setattr(Runner, "step", stepped)
    handle = tinyloop.build_resume_handle(model, ids(19, 40), 2)  # (three pieces of the chunk)
    ringed = tinyloop.build_resume_handle(model, ids(12, 41), 3, cache_window=8)
    prefix = tinyloop.create_prefix_cache(model, ids(33, 9), 4)
    tinyloop.register_prefix(tinyloop.create_prefix_pool(2), model, ids(21, 10), 4)
    assert takes["outside"] == 0 < takes["schedule"] and prefix.span is not None, takes
    assert handle.span is not None and ringed.span is not None and handle.e is not None and ringed.s is not None
    assert tinyloop.generate_from_prefix_cache(model, prefix, ids(4, 11), G(max_tokens=6, loops=4)).tokens == \
        tinyloop.generate(model, ids(33, 9) + ids(4, 11), G(max_tokens=6, loops=4)).tokens
    sched = tinyloop.Scheduler(model, lanes=4)
    seqs = [sched.submit(ids(20, 1), G(max_tokens=40, loops=4)), sched.submit(ids(3, 2), G(max_tokens=30, loops=8)),
            sched.submit(ids(11, 3), G(max_tokens=25, early_exit_threshold=0.3))]
    drain(sched)
    seqs += [sched.submit(ids(6, 4), G(max_tokens=30, loops=6), speculative=tinyloop.SpeculativeConfig(2, 6, 3, fallback=False)),
             sched.submit(ids(5, 5), G(max_tokens=8, loops=3, beam_size=2)),
             sched.submit(ids(20, 1) + ids(5, 6), G(max_tokens=8, loops=4)),  # the first prompt's blocks, lent
             sched.resume(handle, G(max_tokens=8, loops=4)),
             sched.submit(ids(12, 7), G(max_tokens=8, loops=2, cache_window=8)),
             sched.resume(ringed, G(max_tokens=8, loops=5, cache_window=8))]
    drain(sched)
    assert seqs[3].stats.verify_steps > 0 and seqs[5].stats.prefix_hit_tokens >= 16, seqs[5].stats
    assert all(s.error is None for s in seqs), [s.error for s in seqs]
    assert seqs[6].stats.skipped_loops > 0 and all(s.result().tokens for s in seqs)
    before = takes["schedule"]
    small = tinyloop.load_model(art, 96, memory_budget=tinyloop.plan_memory(model, lanes=2, loops=4).total_bytes)
    crowded = tinyloop.Scheduler(small, lanes=8)
    many = [crowded.submit(ids(6 + 3 * i, 40 + i), G(max_tokens=30 + i, loops=4)) for i in range(8)]
    drain(crowded)
    assert sum(s.stats.preempted for s in many) > 0 and all(s.result().tokens for s in many)
    assert takes["execute"] == 0 and takes["schedule"] > before > 20, takes
    tinyloop.free_handle(handle)
    tinyloop.free_handle(ringed)
    tinyloop.free_handle(prefix)


@pytest.mark.parametrize("mode", ["fp16", "int4"])
def test_windowed_lanes_run_in_the_shared_batch(make_artifact, mode):
    """A sliding window is a KV policy of the lane: windowed requests (greedy past their window, sampled, early exit,
    a beam, a speculative chain) take lanes of the one scheduler beside plain ones, wait for a lane like them, keep
    their K/V in a ring of their own drawn from the same pool (a bounded number of blocks however long they run),
    and are preempted and recomputed like them. Every result equals generate of that request alone."""
    art = make_artifact(eos_id=319)
    probe = tinyloop.load_model(art, 128, cache_mode=mode)
    model = tinyloop.load_model(art, 128, cache_mode=mode,
                                memory_budget=tinyloop.plan_memory(probe, lanes=1, loops=4).total_bytes)
    model.prefill_chunk = 8
    spec = tinyloop.SpeculativeConfig(2, 4, 3, fallback=False)
    asks = [(ids(9, 1), G(max_tokens=70, loops=4, cache_window=8, ignore_eos=True), None),
            (ids(14, 2), G(max_tokens=40, loops=4, ignore_eos=True), None),
            (ids(6, 3), G(max_tokens=30, loops=4, cache_window=6, temperature=0.8, seed=5), None),
            (ids(11, 4), G(max_tokens=30, early_exit_threshold=0.3, cache_window=7), None),
            (ids(7, 5), G(max_tokens=12, loops=3, beam_size=2, cache_window=8), None),
            (ids(8, 6), G(max_tokens=30, cache_window=9), spec),
            (ids(12, 7), G(max_tokens=66, loops=4, ignore_eos=True), None)]
    sched = tinyloop.Scheduler(model, lanes=4)
    seqs = [sched.submit(p, c, speculative=sc) for p, c, sc in asks]
    inner = sched.runner.scheduler
    mixed, ring_blocks, waited = False, 0, False
    while not sched.idle():
        windowed = [s for s in inner.admitted if s.cfg.cache_window]
        mixed |= bool(windowed) and len(windowed) < len(inner.admitted)
        waited |= any(s.cfg.cache_window for s in inner.waiting) and len(inner.admitted) == 4
        for s in windowed:
            ring_blocks = max(ring_blocks, sched.runner.executor.lane(s.place.lane).blocks_held())
        sched.step()
    assert mixed and waited, "precondition: windowed lanes must run beside plain ones and wait for a lane"
    assert sum(s.stats.preempted for s in seqs) > 0, "precondition: the pool must run out"
    cfg = model.cfg
    assert 0 < ring_blocks <= cfg.n_slots(cfg.max_loops) * -(-(9 + 4 + 1) // 16)  # the widest ring's blocks at most
    for (prompt, c, sc), seq in zip(asks, seqs):
        alone = tinyloop.generate(probe, prompt, c) if sc is None else tinyloop.generate_speculative(probe, prompt, sc, c)
        assert seq.error is None and seq.result().tokens == alone.tokens, (asks.index((prompt, c, sc)), seq.error, seq.stats.preempted)
    assert seqs[0].result().stats.generated_tokens == 70 > 8  # (far past its window)
    assert seqs[5].stats.verify_steps > 0
    assert model.pool.used == 0


def test_a_preempted_beam_request_is_recomputed_exactly(make_artifact):
    """A pool with room for about three lanes: a beam request (3 hypotheses) beside plain lanes is preempted when
    the pool runs out, all its hypotheses at once, and rebuilt later from its prompt and each hypothesis's tokens:
    its result equals beam search alone, and so do the plain lanes'."""
    art = make_artifact(eos_id=319)
    probe = tinyloop.load_model(art, 96)
    model = tinyloop.load_model(art, 96, memory_budget=tinyloop.plan_memory(probe, lanes=3, loops=4).total_bytes)
    sched = tinyloop.Scheduler(model, lanes=8)
    plain = [G(max_tokens=78 + i, loops=4, ignore_eos=True) for i in range(3)]
    beam = G(max_tokens=60, loops=4, beam_size=3)
    seqs = [sched.submit(ids(8 + 3 * i, 70 + i), c) for i, c in enumerate(plain)]
    sched.step()  # the beam request comes a step later: the youngest (it has the most loop iterations)
    seqs.append(sched.submit(ids(10, 90), beam))
    drain(sched)
    assert seqs[-1].stats.preempted > 0, "precondition: the pool must run out while the beam request runs"
    assert seqs[-1].result().tokens == tinyloop.generate(probe, ids(10, 90), beam).tokens
    for i, (c, s) in enumerate(zip(plain, seqs)):
        assert s.result().tokens == tinyloop.generate(probe, ids(8 + 3 * i, 70 + i), c).tokens
    assert model.pool.used == 0


def test_prompts_that_come_together_are_prefilled_in_shared_calls_each_as_alone(make_artifact, caplog):
    """Short prompts admitted in one step run as rows of shared C calls (Runner.prefill_rows), those at one loop count
    together; a prompt longer than a call's rows runs its own forward. Each prompt's first logits have the bits of
    that prompt prefilled alone, and of its tokens decoded one at a time."""
    model = tinyloop.load_model(make_artifact(), 128)
    cfgs = [G(max_tokens=3, loops=4), G(max_tokens=3, loops=4), G(max_tokens=3, loops=8), G(max_tokens=3, loops=4),
            G(max_tokens=3, loops=4, temperature=0.9, seed=5), G(max_tokens=3, loops=4)]
    prompts = [ids(n, 40 + i) for i, n in enumerate((3, 20, 9, 14, 6, 40))]  # 3 + 20 + 14 + 6: two calls at 4 loops
    sched = tinyloop.Scheduler(model, lanes=len(cfgs))
    seqs = [sched.submit(p, c) for p, c in zip(prompts, cfgs)]
    runner = sched.runner
    with caplog.at_level("DEBUG", logger="tinyloop.scheduler"):
        runner.scheduler.steps += 1
        plan = runner.scheduler.schedule([])
        assert sorted(len(p.tokens) for p in plan.pieces) == sorted(map(len, prompts))  # every prompt in this step
        runner.execute(plan)
    shared = [r.getMessage() for r in caplog.records if "piece(s)" in r.getMessage()]
    assert sorted(shared) == ["step 1: 1 piece(s) at 8 loops ran as 9 rows in 1 call(s)",
                              "step 1: 4 piece(s) at 4 loops ran as 43 rows in 2 call(s)"]
    together = [s.place.logits.clone() for s in seqs]
    runner.postprocess()
    drain(sched)
    for p, c, seq, first in zip(prompts, cfgs, seqs, together):
        alone = Runner(model, model.new_cache(1, 128).reserve_all(), c.loops)  # the one-piece prefill, over a cache of its own
        assert torch.equal(alone.prefill(p, 0), first[None]), len(p)
        assert seq.result().tokens == tinyloop.generate(model, p, c).tokens
    one = Runner(model, model.new_cache(1, 128).reserve_all(), 4)
    for i, token in enumerate(prompts[0]):
        row, _ = one.decode([token], [i], loops=4)
    assert torch.equal(row[0], together[0])
