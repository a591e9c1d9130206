"""Elastic depth (issue 56; docs/engine.md, "Elastic depth"): a request's depth range, the load controller that steers
it, what each result reports, and the service carrying all of it. Real components only: the bundled model (its
loss-by-loops table), the engine's runner and scheduler, a real broker and worker behind the gateway."""
from __future__ import annotations

import httpx
import pytest
import torch

import tinyloop
from tinyloop import ConfigError, GenerateConfig, ModeError, generate
from tinyloop.engine.elastic import NOTCHES, DepthController, Targets, notch_cap, parse_seconds
from tinyloop.engine.options import EngineOptions
from tinyloop.engine.runner import Runner
from tinyloop.engine.sequence import Sequence
from tinyloop.modes import DEPTH_RANGE_ROWS, depth_range_table
from tinyloop.speculative import SpeculativeConfig, generate_speculative

PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n"]
OVER, CALM = Targets(tpot_s=1e-9), Targets(tpot_s=1e6)  # always over target; never near it


def test_floor_held_and_an_untouched_lane_is_exact(bundled_model):
    m = bundled_model
    fixed = GenerateConfig(max_tokens=40, loops=8)
    ranged = GenerateConfig(max_tokens=40, loops=8, min_loops=3)
    lossy = GenerateConfig(max_tokens=40, loops=8, max_loss_increase=0.02)  # the table: 2 loops are within 0.02
    windowed = GenerateConfig(max_tokens=40, loops=8, min_loops=3, cache_window=6)  # its lane's K/V in a ring
    assert (fixed.depth_floor(m), ranged.depth_floor(m), lossy.depth_floor(m)) == (None, 3, 2)
    ctl = DepthController(OVER)
    runner = Runner(m, m.new_cache(4, 256), depth_control=ctl)  # (greedy run-ahead on: C draws under the caps too)
    seqs = [Sequence(m, m.encode_prompt(p), c) for p, c in zip(PROMPTS + PROMPTS[1:2], [fixed, ranged, lossy, windowed])]
    for seq in seqs[1:]:
        ctl.move(seq, NOTCHES)  # the controller's deepest notch from the start: each lane's floor
    res = runner.run(seqs)
    # the lane without a range, batched beside lanes at their floors: the tokens of a fixed-depth run, every loop
    alone = generate(m, PROMPTS[0], fixed)
    assert res[0].tokens == alone.tokens and set(res[0].loops_used) == {8}
    assert res[0].stats.tokens_below_loops == 0 and res[0].stats.loops_histogram == {"8": 40}
    for prompt, r, floor, window in ((PROMPTS[1], res[1], 3, 0), (PROMPTS[2], res[2], 2, 0), (PROMPTS[1], res[3], 3, 6)):
        st = r.stats
        # capped from the start, its prompt too: every token at the floor, never below it
        assert set(r.loops_used) == {floor} == {st.loops_min}
        assert st.tokens_below_loops == 40 and st.loops_histogram == {str(floor): 40}
        assert st.loops_mean == floor and st.loss_increase > 0
        # a token at the floor reads only the floor's loops of the tokens before it: the tokens of a run at that depth
        assert r.tokens == generate(m, prompt, GenerateConfig(max_tokens=40, loops=floor, cache_window=window)).tokens
    assert not seqs[1].cacheable and seqs[0].cacheable  # a capped lane's K/V stay out of the prefix cache


def test_a_capped_prompt_leaves_every_loops_keys_for_depth_given_back(bundled_model):
    """A prompt prefilled under a cap fills the K/V slots of the loops above it with its last loop's (as an early-
    exited token's), so a token at more loops, once depth comes back, finds keys at every depth: the same cache as a
    prefill at the cap whose skipped loops are copied one position at a time."""
    m = bundled_model
    cfg = GenerateConfig(max_tokens=2, loops=8, min_loops=2)
    ctl = DepthController(CALM)
    runner = Runner(m, m.new_cache(1, 128), depth_control=ctl)
    ids = m.encode_prompt(PROMPTS[0] * 4)
    seq = Sequence(m, ids, cfg)
    ctl.move(seq, NOTCHES // 2)  # cap 5
    caches = []
    seq.on_prefilled = lambda lane, logits: caches.append(lane.dense("k")[:, 0, :len(ids)].clone())
    runner.run([seq])
    (k,) = caches
    c = m.cfg
    assert seq.prompt_loops == 5 and seq.result().loops_used[0] == 5
    for loop in range(5, 8):
        for j in range(c.n_core):
            assert torch.equal(k[c.core_slot(loop, j)], k[c.core_slot(4, j)])
    assert not torch.equal(k[c.core_slot(4, 0)], k[c.core_slot(3, 0)])  # (the loops it ran are its own)


def test_the_controller_lowers_under_load_and_raises_when_it_falls(bundled_model):
    m = bundled_model
    ctl = DepthController(OVER)
    # (no greedy run-ahead: a step is one token, so the controller acts often; run-ahead draws under the cap too)
    runner = Runner(m, m.new_cache(2, 256), options=EngineOptions(run_ahead=False), depth_control=ctl)
    seq = Sequence(m, m.encode_prompt(PROMPTS[1]), GenerateConfig(max_tokens=48, loops=6, min_loops=2))
    runner.add(seq)
    lowest, caps = None, []
    while not runner.idle:
        runner.step()
        caps.append(seq.depth_cap or 6)
        if ctl.targets is OVER and seq.depth_cap == 2:  # at the floor: the load goes away
            ctl.targets, lowest = CALM, len(caps)
    res = seq.result()
    assert lowest is not None and lowest + 24 < len(caps) and min(caps) == 2 and ctl.raised > 0
    assert min(res.loops_used) == 2
    assert caps[-1] > 2 and max(res.loops_used[lowest + 24:]) > 2  # depth came back
    # hysteresis: after the load went, the cap only climbs, a notch at a time, never sooner than 24 calm steps
    after = caps[lowest - 1:]
    assert after == sorted(after) and all(b - a <= 1 for a, b in zip(after, after[1:]))
    assert after.index(after[-1]) >= 24


def test_a_lane_over_its_own_tpot_is_lowered_to_fit_while_the_batch_mean_is_within(bundled_model):
    """Under continuous-depth batching a token takes as many steps as its loops: a ranged lane at full depth beside one
    at its floor waits four steps a token, its own TPOT over the target while the batch's mean TPOT is within it. The
    controller measures each ranged lane's own TPOT and lowers that lane straight to a cap that meets the target,
    never below its floor; a request first seen then starts no deeper than the lanes' TPOT allows."""
    m = bundled_model
    now = [0.0]
    ctl = DepthController(Targets(tpot_s=2.5), clock=lambda: now[0])  # (a step: one tick of this clock)
    runner = Runner(m, m.new_cache(2, 256), options=EngineOptions(run_ahead=False), depth_control=ctl)
    cfg = GenerateConfig(max_tokens=64, loops=8, min_loops=2)
    shallow, deep, late = (Sequence(m, m.encode_prompt(p), cfg) for p in PROMPTS)
    ctl.move(shallow, NOTCHES)  # at its floor, 2 loops: a step (its token's passes) per token; the deep lane's 8: 4
    runner.add(shallow)
    runner.add(deep)
    while deep.depth_cap is None and not runner.idle:
        now[0] += 1
        runner.step()
        mean = ctl.tpot
    assert deep.depth_cap is not None and 2 <= deep.depth_cap <= 5  # its own TPOT 4 ticks: 8 loops x 2.5 / 4
    assert 0 < mean < 2.5  # the batch's mean TPOT was within the target: it alone would not have lowered anything
    runner.add(late)  # waits for a lane: its prompt will run at the depth it starts at
    now[0] += 1
    runner.step()
    assert late.depth_cap is not None and late.depth_cap <= 5


def test_the_least_important_lanes_give_up_depth_first(bundled_model):
    """Under load the least important half of the ranged lanes (highest priority value, vLLM's convention) gives up
    more depth than the rest; and a worker admits waiting requests by priority."""
    m = bundled_model
    ctl = DepthController(OVER)
    runner = Runner(m, m.new_cache(4, 256), options=EngineOptions(run_ahead=False), depth_control=ctl)
    seqs = [Sequence(m, m.encode_prompt(PROMPTS[0]), GenerateConfig(max_tokens=24, loops=8, min_loops=2, priority=p))
            for p in (0, 5, -3, 5)]
    for seq in seqs:
        runner.add(seq)
    while not any(s.depth_cap for s in seqs) and not runner.idle:
        runner.step()
    # (far over target: the tolerant half 4 notches, the rest 2)
    assert seqs[1].depth_notch == seqs[3].depth_notch > seqs[0].depth_notch == seqs[2].depth_notch > 0

    one_lane = Runner(m, m.new_cache(1, 256))
    order: list[int] = []
    seqs = [Sequence(m, m.encode_prompt(p), GenerateConfig(max_tokens=2, priority=prio))
            for p, prio in zip(PROMPTS, (0, 5, -1))]
    for seq in seqs:
        one_lane.add(seq)
    while not one_lane.idle:
        order += [seqs.index(s) for s in one_lane.step()]
    assert order == [2, 0, 1]


def test_the_brokers_backlog_counts_as_load(bundled_model):
    """A service's queue lives in its broker: each dispatch says how long its oldest waiting request has waited
    (backlog_s), and the controller counts that against the queue target until the note is older than BACKLOG_TTL."""
    from tinyloop.engine.elastic import BACKLOG_TTL

    now = [100.0]
    ctl = DepthController(Targets(ttft_s=0.5), clock=lambda: now[0])
    assert ctl.measure([], []) == 0.0
    ctl.note_backlog(1.0)
    now[0] += 0.1
    assert ctl.measure([], []) == pytest.approx(2.2)  # (1.0 + 0.1) / 0.5
    now[0] += BACKLOG_TTL
    assert ctl.measure([], []) == 0.0  # no dispatch since: the broker's queue is taken as gone
    ctl.note_backlog(1.0)
    ctl.note_backlog(0.0)  # a later dispatch found the broker's queue empty
    assert ctl.measure([], []) == 0.0

    # over target with a backlog in the broker, a ranged request starts at its floor (the service is full); without
    # one, at the controller's level (0 here: full depth)
    m = bundled_model
    for backlog, notch in ((0.0, 0), (1.0, NOTCHES)):
        ctl = DepthController(Targets(ttft_s=0.5), clock=lambda: now[0])
        ctl.note_backlog(backlog)
        seq = Sequence(m, m.encode_prompt(PROMPTS[0]), GenerateConfig(max_tokens=4, loops=8, min_loops=2))
        ctl.steer([], [seq])
        assert seq.depth_notch == notch and seq.prompt_depth() == (2 if notch else 8)


def test_notches_and_targets():
    class Lane:  # notch_cap reads only a lane's floor and loops
        floor, loops = 4, 16

    assert [notch_cap(Lane, k) for k in range(NOTCHES + 1)] == [None, 14, 13, 12, 10, 8, 7, 6, 4]
    assert parse_seconds("40ms") == pytest.approx(0.04) and parse_seconds("0.04s") == 0.04
    assert parse_seconds("0.25") == 0.25 and parse_seconds(None) is None
    for bad in ("fast", "-3ms", "0s"):
        with pytest.raises(ValueError, match="latency target"):
            parse_seconds(bad)
    assert not Targets() and Targets(ttft_s=1.0)


def test_bad_input_is_refused_clearly(bundled_model, make_artifact):
    m = bundled_model
    with pytest.raises(ConfigError, match="min_loops 9 is more than the 8 loops"):
        GenerateConfig(loops=8, min_loops=9).validate(m)
    with pytest.raises(ConfigError, match=r"max_loss_increase must be in \[0.0, 100.0\], got -0.1"):
        GenerateConfig(max_loss_increase=-0.1)
    tiny = tinyloop.load_model(make_artifact(), 64)  # a model without a loss-by-loops table
    with pytest.raises(ConfigError, match="no loss-by-loops table.*give min_loops instead"):
        GenerateConfig(loops=4, max_loss_increase=0.1).validate(tiny)
    GenerateConfig(loops=4, min_loops=2).validate(tiny)  # a plain floor needs no table
    ranged = dict(loops=8, min_loops=2, max_tokens=4)
    conflicts = [("beam", lambda: generate(m, "x", GenerateConfig(**ranged, beam_size=2))),
                 ("early_exit", lambda: GenerateConfig(loops=8, max_loss_increase=0.1,
                                                       early_exit_threshold=0.1).validate(m)),
                 ("exit_schedule", lambda: GenerateConfig(**ranged, exit_schedule=[2]).validate(m)),
                 ("speculative", lambda: generate_speculative(m, "x", SpeculativeConfig(draft_loops=2),
                                                              GenerateConfig(**ranged))),
                 ("exit_kv_compute", lambda: GenerateConfig(**ranged).validate(
                     tinyloop.load_model(make_artifact(exit_kv="compute"), 64)))]
    for name, call in conflicts:
        with pytest.raises(ModeError, match="depth range") as err:  # noqa: PT012
            call()
        assert DEPTH_RANGE_ROWS[name][0] in str(err.value), name
    # under early exit min_loops stays the exit rule's floor, as before: no range, no refusal
    assert GenerateConfig(loops=8, min_loops=2, early_exit_threshold=0.1).validate(m).depth_floor(m) is None
    assert depth_range_table() in open("docs/modes.md").read()


def test_served_through_the_gateway_with_stats_usage_and_metrics(bundled_model):
    """`tinyloop serve --tpot-slo 1us` (always over target) behind the gateway: a request with a floor gives up depth
    down to it and says so in its usage and the metrics; one without a range is the fixed-depth answer."""
    from test_gateway import free_port
    from test_service_model_facts import Served

    metrics = free_port()
    with Served(["--tpot-slo", "1us", "--ttft-slo", "30s", "--metrics-port", str(metrics)],
                env={"TINYLOOP_RUN_AHEAD": "0"}) as svc:  # (a step a token: the controller acts while it runs)
        body = {"prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0, "loops": 8}
        ranged = svc.post("/v1/completions", {**body, "min_loops": 3, "priority": 2})  # (vLLM's field)
        fixed = svc.post("/v1/completions", body)
        bad = httpx.post(svc.url + "/v1/completions", json={**body, "min_loops": 9}, timeout=60)
        bad_priority = httpx.post(svc.url + "/v1/completions", json={**body, "priority": "high"}, timeout=60)
        text = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text
    loops = ranged["usage"]["loops"]
    assert loops["min"] == 3 and 3 < loops["mean"] < 8 and loops["below_asked"] > 0  # the floor held
    assert sum(loops["histogram"].values()) == 32 and loops["loss_increase"] >= 0
    assert fixed["usage"]["loops"] == {"mean": 8, "min": 8, "below_asked": 0, "histogram": {"8": 32},
                                       "loss_increase": 0}
    assert fixed["choices"][0]["text"] == generate(bundled_model, PROMPTS[0], GenerateConfig(max_tokens=32,
                                                                                               loops=8)).text
    assert bad.status_code == 400 and "9 is more than the 8 loops" in bad.text and "min_loops" in bad.text
    assert bad_priority.status_code == 400 and "priority" in bad_priority.text
    below = next(line for line in text.splitlines() if line.startswith("tinyloop_tokens_below_asked_loops_total"))
    assert float(below.split()[-1]) == loops["below_asked"]
    assert 'tinyloop_token_loops_bucket{le="3.0"} ' in text and "tinyloop_token_loops_count 64.0" in text
    assert "tinyloop_recent_loops_mean" in text and "tinyloop_recent_below_asked_loops_ratio" in text
