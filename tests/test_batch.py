"""generate_batch: lockstep output equals generate per prompt, per-lane settings, and the seed table's guards."""
from __future__ import annotations

import pytest
import torch

import tinyloop
from tinyloop import BusyError, ConfigError, GenerateConfig, ModeError, generate, generate_batch, generate_stream


pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = {
    "huginn": dict(),  # prelude/core/coda, adapter injection, zero init
    "ouro": dict(n_prelude=0, n_coda=0, injection="none", state_init="embed", exit_gate=True),
    "sandwich": dict(injection="add", state_init="normal", sandwich_norm=True, tie_embeddings=False, n_kv_heads=4),
}


def prompts_of_very_different_lengths(model) -> list:
    text = "def add(a, b):\n    return a + b\n"
    return [[7], model.codec.encode(text * 6), "import os", list(range(1, 40)) * 2, model.codec.encode(text)[:3]]


@pytest.mark.parametrize("cache_mode", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_batch_equals_generate_alone(make_artifact, arch, cache_mode):
    model = tinyloop.load_model(make_artifact(**ARCHS[arch]), 256, cache_mode=cache_mode)
    prompts = prompts_of_very_different_lengths(model)
    assert max(map(len, map(model.encode_prompt, prompts))) >= 50 * min(map(len, map(model.encode_prompt, prompts)))
    cfg = GenerateConfig(max_tokens=24, loops=3)
    alone = [generate(model, p, cfg) for p in prompts]
    batched = generate_batch(model, prompts, cfg)
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    assert [r.text for r in batched] == [r.text for r in alone]
    for r, p in zip(batched, prompts):
        assert r.stats.prompt_tokens == len(model.encode_prompt(p))
        assert r.stats.cache_mode == cache_mode and r.stats.stop_reason == "max_tokens"


@pytest.mark.parametrize("cache_mode", ["fp16", "int4"])
def test_early_exit_batch_equals_generate_alone(make_artifact, cache_mode):
    """Per-lane exit masks: lanes leave the loop at different depths and still match single decode."""
    model = tinyloop.load_model(make_artifact(), 256, cache_mode=cache_mode)
    prompts = prompts_of_very_different_lengths(model)
    cfg = GenerateConfig(max_tokens=16, loops=8, early_exit_threshold=0.7)
    alone = [generate(model, p, cfg) for p in prompts]
    batched = generate_batch(model, prompts, cfg)
    assert [r.tokens for r in batched] == [r.tokens for r in alone]
    assert [r.stats.loops_mean for r in batched] == [r.stats.loops_mean for r in alone]
    assert min(r.stats.loops_mean for r in batched) < 8  # exits really happened


def test_stopped_lanes_stay_in_shape_and_per_lane_settings(tiny_model):
    """Lanes stop at different steps (token stop, string stop, max_tokens); the others are unaffected."""
    model = tiny_model
    prompts = ["def add(a, b):", "import os\n", [3, 4, 5], "class Point:\n"]
    base = GenerateConfig(max_tokens=20, loops=2)
    free = [generate(model, p, base).tokens for p in prompts]
    cfgs = [GenerateConfig(max_tokens=20, loops=2, stop_sequences=[[free[0][4]]]),  # token stop, early
            GenerateConfig(max_tokens=5, loops=2),
            GenerateConfig(max_tokens=20, loops=2, stop_sequences=[model.codec.decode(free[2][6:8])]),
            GenerateConfig(max_tokens=20, loops=2)]
    alone = [generate(model, p, c) for p, c in zip(prompts, cfgs)]
    batched = generate_batch(model, prompts, cfgs)
    assert [(r.tokens, r.text, r.stats.stop_reason) for r in batched] == [(r.tokens, r.text, r.stats.stop_reason) for r in alone]
    assert batched[0].stats.stop_reason == "stop_sequence" and len(batched[0].tokens) <= 4
    assert batched[1].stats.generated_tokens == 5 and batched[3].tokens == free[3]


def test_seeded_sampling_per_lane_is_reproducible(tiny_model):
    prompts = ["def", "import os", [9, 8, 7, 6]]
    cfgs = [GenerateConfig(max_tokens=16, temperature=0.9, top_k=50, top_p=0.95, seed=s) for s in (1, 2, 3)]
    a = generate_batch(tiny_model, prompts, cfgs)
    b = generate_batch(tiny_model, prompts, cfgs)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.tokens for r in a] == [generate(tiny_model, p, c).tokens for p, c in zip(prompts, cfgs)]
    same_prompt = generate_batch(tiny_model, ["def"] * 3, cfgs)
    assert len({tuple(r.tokens) for r in same_prompt}) > 1  # different seeds, different samples


def test_repetition_penalty_lanes_equal_generate(tiny_model):
    prompts = ["def add(a, b):\n    return a + b\n", "x"]
    cfg = GenerateConfig(max_tokens=20, repetition_penalty=1.3)
    assert [r.tokens for r in generate_batch(tiny_model, prompts, cfg)] == [generate(tiny_model, p, cfg).tokens for p in prompts]


def test_streaming_and_per_lane_cancel(tiny_model):
    cfg = GenerateConfig(max_tokens=12)
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def on_token(lane, token, index):
        assert index == len(seen[lane])
        seen[lane].append(token)
        return not (lane == 1 and index == 2)

    out = generate_batch(tiny_model, ["def", "import", "class"], cfg, on_token)
    assert [seen[i] for i in range(3)] == [r.tokens for r in out]
    assert out[1].stats.stop_reason == "cancelled" and len(out[1].tokens) == 3
    assert out[0].stats.stop_reason == out[2].stats.stop_reason == "max_tokens" and len(out[2].tokens) == 12
    single = generate_stream(tiny_model, "import", cfg, lambda t, i: i != 2)
    assert single.tokens == out[1].tokens


def test_call_entry_constraints_name_the_rule(tiny_model):
    m = tiny_model  # max_seq_len 256
    with pytest.raises(ConfigError, match=r"generate_batch prompt 1: prompt length.*max_seq_len"):
        generate_batch(m, ["a", [5] * 250], GenerateConfig(max_tokens=10))
    with pytest.raises(ConfigError, match="beam search is deterministic"):
        generate_batch(m, ["a", "b"], GenerateConfig(beam_size=2, temperature=0.7))
    with pytest.raises(ConfigError, match="one per prompt"):
        generate_batch(m, ["a", "b"], [GenerateConfig()])
    with pytest.raises(ConfigError, match="non-empty list"):
        generate_batch(m, "a string", GenerateConfig())
    with pytest.raises(ConfigError, match="non-empty list"):
        generate_batch(m, [], GenerateConfig())
    # per-lane loops, early exit, max_tokens, stop sequences, seeds and grammar are allowed (no error)
    ok = generate_batch(m, ["a", "b"], [GenerateConfig(max_tokens=2, seed=1, stop_sequences=["x"]),
                                        GenerateConfig(max_tokens=3, grammar={"regex": "[ab]+"})])
    assert [r.stats.generated_tokens <= n for r, n in zip(ok, (2, 3))] == [True, True]


def test_batch_is_one_call_on_a_busy_model(tiny_model):
    with tiny_model.busy():
        with pytest.raises(BusyError):
            generate_batch(tiny_model, ["a"], GenerateConfig(max_tokens=2))
    tinyloop.free_model(tiny_model)
    with pytest.raises(tinyloop.HandleError):
        generate_batch(tiny_model, ["a"], GenerateConfig(max_tokens=2))


def test_every_call_runs_in_the_models_one_engine(tiny_model, monkeypatch):
    """generate, generate_batch, beam search and a Scheduler run through the model's one engine: once the first call
    built it, no call makes a cache or a Runner of its own, and each runs at most its own lanes at once (a batch of
    3 prompts: 3, a beam of 3: 3, a Scheduler of 2 lanes: 2)."""
    from tinyloop.engine.runner import Runner

    generate(tiny_model, "warm", GenerateConfig(max_tokens=2))
    engine, made, held = tiny_model.engine, [], []
    for cls in (tinyloop.KVCache, Runner):
        monkeypatch.setattr(cls, "__init__", lambda *a, **k: made.append(a[0]))
    step = Runner.step

    def counting(self):
        held.append(len(self.scheduler.admitted))
        return step(self)

    monkeypatch.setattr(Runner, "step", counting)
    got = generate_batch(tiny_model, [[1] * 10, [2] * 30, [3], [4] * 5, [5] * 7], GenerateConfig(max_tokens=5))
    assert max(held) == 5 and [r.tokens for r in got[:1]] == [generate(tiny_model, [1] * 10, GenerateConfig(max_tokens=5)).tokens]
    held.clear()
    generate(tiny_model, "a beam", GenerateConfig(max_tokens=4, beam_size=3))
    assert max(held) == 3
    held.clear()
    sched = tinyloop.Scheduler(tiny_model, lanes=2)
    seqs = [sched.submit([7] * (3 + i), GenerateConfig(max_tokens=4)) for i in range(5)]
    finished = []
    while not sched.idle():
        finished += sched.step()
    assert max(held) == 2 and sorted(map(id, finished)) == sorted(map(id, seqs))
    assert made == [] and tiny_model.engine is engine and sched.runner is engine


def test_a_call_between_scheduler_steps_steps_the_batch_with_it(tiny_model):
    """A generate made between two of a Scheduler's steps runs in the same engine: the scheduler's request advances
    with it and comes back from the scheduler's next step, both with their tokens alone; a Scheduler dropped with a
    request still running gives it up at the engine's next step (its blocks back to the pool)."""
    import gc

    cfg = GenerateConfig(max_tokens=6)
    alone = generate(tiny_model, [3] * 6, cfg).tokens
    sched = tinyloop.Scheduler(tiny_model, lanes=2)
    seq = sched.submit([3] * 6, cfg)
    assert sched.step() == [] and seq.count == 1
    assert generate(tiny_model, [4] * 5, GenerateConfig(max_tokens=8)).tokens == \
        generate(tiny_model, [4] * 5, GenerateConfig(max_tokens=8)).tokens
    assert seq.done and sched.step() == [seq] and seq.result().tokens == alone and sched.idle()
    gone = tinyloop.Scheduler(tiny_model, lanes=2)
    left = gone.submit([5] * 9, GenerateConfig(max_tokens=40))
    gone.step()
    assert tiny_model.pool.used > 0
    del gone
    gc.collect()
    generate(tiny_model, "x", GenerateConfig(max_tokens=1))
    assert left.done and tiny_model.engine.idle and tiny_model.pool.used == 0


def test_a_call_between_steps_of_a_full_scheduler_does_not_wait_for_its_lanes(tiny_model):
    """A Scheduler leaves the engine a lane beyond its own: with all of its lanes running and more of its requests
    waiting, a call made between two of its steps (a handle's build in a worker) runs at once, beside the running
    requests, and the waiting ones stay waiting."""
    from tinyloop.engine.calls import BATCH_LANES

    sched = tinyloop.Scheduler(tiny_model, lanes=BATCH_LANES)
    seqs = [sched.submit([3 + i % 50] * 5, GenerateConfig(max_tokens=40)) for i in range(BATCH_LANES + 2)]
    sched.step()
    assert tiny_model.engine.cache.lanes > BATCH_LANES and [s.count for s in seqs[-2:]] == [0, 0]
    assert generate(tiny_model, [9] * 4, GenerateConfig(max_tokens=3)).tokens == \
        generate(tiny_model, [9] * 4, GenerateConfig(max_tokens=3)).tokens
    assert not any(s.done for s in seqs) and [s.count for s in seqs[-2:]] == [0, 0]
    sched.close()
    assert tiny_model.pool.used == 0


def test_lanes_sample_with_their_own_settings(tiny_model):
    """Each lane's Sequence samples on its own: temperatures, top-k/p and penalties may differ per lane, and each
    lane's tokens equal generate of that prompt with that config alone."""
    cfgs = [GenerateConfig(max_tokens=12, temperature=0.0), GenerateConfig(max_tokens=12, temperature=0.9, seed=3),
            GenerateConfig(max_tokens=12, temperature=0.7, top_k=5, seed=4),
            GenerateConfig(max_tokens=12, temperature=1.0, top_p=0.8, repetition_penalty=1.3, seed=5)]
    prompts = ["def", "import os", "class A:", "x = 1"]
    batch = generate_batch(tiny_model, prompts, cfgs)
    for p, c, r in zip(prompts, cfgs, batch):
        assert r.tokens == generate(tiny_model, p, c).tokens


def test_beam_requests_run_beside_plain_lanes_and_equal_beam_search_alone(tiny_model):
    """A batch that mixes beam widths with greedy and seeded lanes: every lane's output (and a beam's n-best list)
    equals the same request run alone."""
    prompts = ["def add(a, b):\n    return", "import os\n", "class Point:\n", [11, 12, 13]]
    cfgs = [GenerateConfig(max_tokens=12, beam_size=3), GenerateConfig(max_tokens=20),
            GenerateConfig(max_tokens=10, beam_size=2, loops=6), GenerateConfig(max_tokens=16, temperature=0.8, seed=5)]
    together = generate_batch(tiny_model, prompts, cfgs)
    for prompt, cfg, res in zip(prompts, cfgs, together):
        alone = generate(tiny_model, prompt, cfg)
        assert (res.tokens, res.text, res.stats.stop_reason) == (alone.tokens, alone.text, alone.stats.stop_reason)
        if cfg.beam_size > 1:
            assert [(h.tokens, h.logprob) for h in res.n_best] == [(h.tokens, h.logprob) for h in alone.n_best]


def test_windowed_prompts_run_beside_plain_ones_each_in_its_ring(tiny_model):
    """A batch may mix sliding windows (each lane its own, a beam's too) with plain lanes; a windowed prompt may run
    past max_seq_len (its ring holds only its window). Every lane equals the same request alone."""
    prompts = ["def add(a, b):\n    return", "import os\n", "class Point:\n", [11, 12, 13]]
    cfgs = [GenerateConfig(max_tokens=300, cache_window=16, ignore_eos=True), GenerateConfig(max_tokens=20),
            GenerateConfig(max_tokens=10, beam_size=2, cache_window=8),
            GenerateConfig(max_tokens=16, temperature=0.8, seed=5, cache_window=5)]
    together = generate_batch(tiny_model, prompts, cfgs)
    assert len(together[0].tokens) == 300 > tiny_model.max_seq_len
    for prompt, cfg, res in zip(prompts, cfgs, together):
        assert res.tokens == generate(tiny_model, prompt, cfg).tokens, cfg


def test_logprobs_come_from_the_logits_each_token_was_chosen_from(bundled_model):
    """GenerateConfig.logprobs: each token's log-probability and its most likely alternatives come from the step that
    chose it (no second forward). They equal scoring prompt + output afterwards, for greedy, sampled, early-exit and
    speculative lanes batched beside a lane that asks none, and for a beam search's best hypothesis; asking changes no
    token."""
    from tinyloop.scoring import token_logprobs

    model, G = bundled_model, GenerateConfig
    prompts = ["def fibonacci(n):\n", "import os\n", "class Stack:\n", "    for i in range(n):\n"]
    cfgs = [G(max_tokens=12, loops=4, logprobs=3), G(max_tokens=12, loops=6, temperature=0.8, seed=3, logprobs=0),
            G(max_tokens=12, loops=8, early_exit_threshold=0.05, logprobs=2), G(max_tokens=12, loops=5)]
    plain = generate_batch(model, prompts, [G(**{**c.__dict__, "logprobs": None}) for c in cfgs])
    asked = generate_batch(model, prompts, cfgs)
    for p, c, a, b in zip(prompts, cfgs, asked, plain):
        assert a.tokens == b.tokens and a.loops_used == b.loops_used
        if c.logprobs is None:
            assert a.logprobs is None and a.top_logprobs is None
            continue
        assert len(a.logprobs) == len(a.tokens) == len(a.top_logprobs) and all(len(t) == c.logprobs for t in a.top_logprobs)
        if not c.early_exit_threshold:  # (an early-exit token's logits are at the depth it stopped at)
            ref = token_logprobs(model, model.encode_prompt(p), a.tokens, c.loops, c.logprobs)
            assert a.logprobs == pytest.approx(ref["logprobs"], abs=1e-4)
            assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, *_ in top] for top in ref["top"]]
        if c.temperature == 0:  # the chosen token is the most likely one
            assert [top[0] for top in a.top_logprobs] == [pytest.approx((t, lp)) for t, lp in zip(a.tokens, a.logprobs)]
    sc = tinyloop.SpeculativeConfig(2, 6, 3, fallback=False)
    spec = tinyloop.generate_speculative(model, prompts[0], sc, G(max_tokens=12, loops=6, logprobs=1))
    assert spec.stats.verify_steps > 0
    ref = token_logprobs(model, model.encode_prompt(prompts[0]), spec.tokens, 6, 1)
    assert spec.logprobs == pytest.approx(ref["logprobs"], abs=1e-4)
    beam = generate(model, prompts[0], G(max_tokens=8, loops=4, beam_size=2, logprobs=1))  # (the best hypothesis's)
    ref = token_logprobs(model, model.encode_prompt(prompts[0]), beam.tokens, 4, 1)
    assert beam.logprobs == pytest.approx(ref["logprobs"], abs=1e-4) and len(beam.top_logprobs) == len(beam.tokens)
    with pytest.raises(ConfigError, match="GenerateConfig.logprobs"):
        generate(model, "x", G(logprobs=21))


def test_prompt_logprobs_come_from_the_prefill_rows(bundled_model, monkeypatch):
    """GenerateConfig.prompt_logprobs: each prompt token's log-probability and its most likely alternatives come from
    the rows of the prefill the request ran (no second forward), for a prompt in C rows and one through the torch
    chunk forward, whole or cut into chunks, in a batch beside a request that asks none (whose output is unchanged),
    and with a cached prefix it does not reuse. At a fixed depth they equal scoring the prompt (tinyloop.score)."""
    model, G = bundled_model, GenerateConfig
    short = "def fibonacci(n):\n"  # (C rows)
    long = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2
    assert len(model.encode_prompt(long)) > 32  # (a piece of it runs the torch chunk forward)

    def check(prompt, res, k: int) -> None:
        ids = model.encode_prompt(prompt)
        ref = torch.log_softmax(tinyloop.score(model, ids, 4), dim=-1)  # row i predicts ids[i + 1]
        assert res.prompt_logprobs[0] is None and res.prompt_top_logprobs[0] == []
        assert len(res.prompt_logprobs) == len(res.prompt_top_logprobs) == len(ids)
        assert res.prompt_logprobs[1:] == pytest.approx([float(ref[i, t]) for i, t in enumerate(ids[1:])], abs=1e-4)
        for i, top in enumerate(res.prompt_top_logprobs[1:]):
            assert len(top) == k and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
            if k:  # the most likely token first (one within rounding of it, were two tied)
                assert int(ref[i].argmax()) in [t for t, _ in top]
                assert top[0][1] == pytest.approx(float(ref[i].max()), abs=1e-4)

    asked = G(max_tokens=6, loops=4, prompt_logprobs=3)
    alone = {p: generate(model, p, asked) for p in (short, long)}
    for p, res in alone.items():
        check(p, res, 3)
        assert res.logprobs is None and res.tokens == generate(model, p, G(max_tokens=6, loops=4)).tokens
    monkeypatch.setattr(model, "prefill_chunk", 8)  # pieces of 8 tokens, every one in C rows
    chunked = generate(model, long, asked)
    check(long, chunked, 3)
    monkeypatch.undo()
    both = generate_batch(model, [long, short], [G(max_tokens=6, loops=4, prompt_logprobs=1), G(max_tokens=6, loops=4)])
    check(long, both[0], 1)
    assert both[1].prompt_logprobs is None and both[1].prompt_top_logprobs is None
    assert both[1].tokens == alone[short].tokens
    # a prefix cached by an earlier request is not reused by one that asks (its rows would be skipped)
    monkeypatch.setattr(model, "prefix_caching", True)
    try:
        generate(model, long, G(max_tokens=2, loops=4))
        assert generate(model, long + "x", G(max_tokens=2, loops=4)).stats.prefix_hit_tokens > 0
        res = generate(model, long + "x", G(max_tokens=2, loops=4, prompt_logprobs=0))
        assert res.stats.prefix_hit_tokens == 0
        check(long + "x", res, 0)
    finally:
        model.prefixes.clear()
    for bad in (-1, 21, 2.0):
        with pytest.raises(ConfigError, match="GenerateConfig.prompt_logprobs"):
            G(prompt_logprobs=bad)
    with pytest.raises(ModeError, match="prompt_logprobs"):  # (a pool's scaffold runs no forward of the call)
        tinyloop.generate_with_pool(model, tinyloop.create_prefix_pool(1), short, G(prompt_logprobs=0))


def test_logprobs_of_tokens_drawn_in_c_equal_those_returned_to_the_sampler(bundled_model, monkeypatch):
    """A greedy request asking for log-probabilities draws its tokens inside the C passes like a plain one (Row.draws,
    Row.keep_logits), C bringing back the logits each was drawn from: its tokens, loops, logprobs and top_logprobs
    are those of TINYLOOP_RUN_AHEAD=0, where every token returns to the sampler, at batch 1 and in a batch beside
    lanes at other depths, exiting early, sampled, asking none, and one whose client stops reading in the middle of
    a run of draws (the scores of the draws after it go with them). Bit-equal, not approximately: a drawn token's
    logits are the bits of the token step's (the C head is batch-invariant), and Sequence.score_all's log-softmax
    and top-k work row by row, so the same row scores the same whichever rows it is stacked with."""
    from tinyloop.kernels import cpu_block

    model, G = bundled_model, GenerateConfig
    prompts = ["def fibonacci(n):\n", "import os\n", "class Stack:\n", "    for i in range(n):\n", "x = [",
               "def add(a, b):\n"]
    cfgs = [G(max_tokens=40, loops=8, logprobs=5), G(max_tokens=40, loops=4, logprobs=0),
            G(max_tokens=40, loops=8, early_exit_threshold=0.05, logprobs=2), G(max_tokens=24, loops=6),
            G(max_tokens=16, loops=5, temperature=0.8, seed=3, logprobs=3), G(max_tokens=40, loops=6, logprobs=1)]
    kept = {"draws": 0}  # tokens drawn in C with their logits brought back
    until = cpu_block.DecodeStep.iterate_until

    def counting(*a, **k):
        got = until(*a, **k)
        kept["draws"] += sum(len(d) for d, rows in zip(got.drawn, got.kept) if rows is not None)
        return got
    monkeypatch.setattr(cpu_block.DecodeStep, "iterate_until", counting)
    monkeypatch.setattr(cpu_block, "RUN_AHEAD_S", 60.0)  # (a stall of a busy machine would end the runs of draws early)

    def run() -> tuple[list, tuple[int, int]]:
        kept["draws"] = 0
        alone = generate(model, prompts[0], cfgs[0])
        at_batch_1, kept["draws"] = kept["draws"], 0
        sched = tinyloop.Scheduler(model, lanes=len(prompts))
        # lane 5's client stops reading at its 14th token, one it draws in C in the middle of a run (no score is
        # left of the draws after it: Sequence.scores)
        seqs = [sched.submit(p, c, on_token=(lambda t, i: i < 13) if n == 5 else None)
                for n, (p, c) in enumerate(zip(prompts, cfgs))]
        while not sched.idle():
            sched.step()
        results = [alone, *(s.result() for s in seqs)]
        return [(r.tokens, r.loops_used, r.logprobs, r.top_logprobs, r.stats.stop_reason) for r in results] \
            + [len(s.scores) for s in seqs], (at_batch_1, kept["draws"])

    ahead, in_c = run()
    monkeypatch.setenv("TINYLOOP_RUN_AHEAD", "0")
    one_each, none = run()
    # most of the greedy askers' tokens were drawn in C (at batch 1 all but those ending a block and the last)
    assert in_c[0] >= 30 and in_c[1] > 80 and none == (0, 0), (in_c, none)
    assert ahead == one_each
    assert ahead[6][4] == "cancelled" and len(ahead[6][2]) == len(ahead[6][0]) == 14 and ahead[-1] == 14
    for (tokens, _, logprobs, top, _), c in zip(ahead, [cfgs[0], *cfgs]):
        assert (logprobs is None) == (c.logprobs is None)
        if logprobs is not None:
            assert len(logprobs) == len(tokens) == len(top) and all(len(t) == c.logprobs for t in top)


def test_a_batch_answers_each_prompt_with_its_result_or_its_error(tiny_model):
    """generate_batch(return_exceptions=True): a prompt refused (its config against the mode matrix, its length) has
    its error in its place, naming it, and the others run as they would alone; by default the first error raises."""
    model, G = tiny_model, GenerateConfig
    prompts = ["import os", "class A:", list(range(1, 250)), "def f(x):", "x = 1"]
    cfgs = [G(max_tokens=6), G(max_tokens=6, loops=3), G(max_tokens=20), G(max_tokens=6, beam_size=2, temperature=0.5),
            G(max_tokens=5, temperature=0.7, seed=2)]
    out = generate_batch(model, prompts, cfgs, return_exceptions=True)
    assert isinstance(out[2], ConfigError) and "generate_batch prompt 2: prompt length 249" in str(out[2])
    assert isinstance(out[3], (ConfigError, ModeError)) and str(out[3]).startswith("generate_batch prompt 3:")
    for i in (0, 1, 4):
        assert out[i].tokens == generate(model, prompts[i], cfgs[i]).tokens
    with pytest.raises(ConfigError, match="generate_batch prompt 2"):
        generate_batch(model, prompts, cfgs)
