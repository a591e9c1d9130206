"""Continuous-depth batching (engine/executor.py: Executor.iterate): rows at different depths, or exiting early, advance
one loop iteration per step, so a shallow lane's tokens do not wait for the deepest lane of the step. Every lane's
output equals the same request alone, whatever its batch-mates' depths, for every exit rule and cache mode."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import tinyloop
from conftest import ARCHS, ids
from tinyloop import GenerateConfig as G
from tinyloop.engine.executor import Executor


def drain(sched: tinyloop.Scheduler) -> int:
    steps = 0
    while not sched.idle():
        sched.step()
        steps += 1
    return steps


RULES = {  # name: (the model, the request's exit fields): the families' own rules and those a request names
    "latent": ({}, dict(early_exit_threshold=0.25)),
    "gate": (dict(exit_gate=True), dict(early_exit_threshold=0.25)),
    "cdf": (dict(ARCHS["ouro"], exit_rule="cdf"), dict(early_exit_threshold=0.5)),
    "cdf-compute": (dict(ARCHS["ouro"], exit_rule="cdf", exit_kv="compute"), dict(early_exit_threshold=0.5)),
    "cdf-asked": (dict(ARCHS["ouro"]), dict(exit_rule="cdf", early_exit_threshold=0.5)),  # the model's own: latent
    "entropy": ({}, dict(exit_rule="entropy", early_exit_threshold=0.01)),
    "kl": ({}, dict(exit_rule="kl", early_exit_threshold=0.002)),
    "argmax": ({}, dict(exit_rule="argmax", early_exit_threshold=2)),
    "argmax-compute": (dict(ARCHS["ouro"], exit_kv="compute"), dict(exit_rule="argmax", early_exit_threshold=2)),
    "entropy-min4": ({}, dict(exit_rule="entropy", early_exit_threshold=0.01, min_loops=4)),  # (it fires at 2)
}


@pytest.mark.parametrize("mode", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("rule", list(RULES))
def test_every_exit_rule_beside_lanes_at_other_depths_equals_it_alone(make_artifact, mode, rule):
    arch, exits = RULES[rule]
    model = tinyloop.load_model(make_artifact(**arch), 128, cache_mode=mode)
    cfgs = [G(max_tokens=14, loops=8, **exits),
            G(max_tokens=10, loops=2), G(max_tokens=12, loops=16),
            G(max_tokens=12, loops=6, temperature=0.8, seed=3, **exits),
            G(max_tokens=9, loops=4, temperature=0.9, top_p=0.9, seed=7)]
    prompts = [ids(4 + 3 * i, 60 + i) for i in range(len(cfgs))]
    sched = tinyloop.Scheduler(model, lanes=4)
    seqs = []
    for step in range(600):
        if step % 3 == 0 and len(seqs) < len(cfgs):
            seqs.append(sched.submit(prompts[len(seqs)], cfgs[len(seqs)]))
        sched.step()
        if sched.idle() and len(seqs) == len(cfgs):
            break
    for p, c, seq in zip(prompts, cfgs, seqs):
        alone = tinyloop.generate(model, p, c)
        assert seq.result().tokens == alone.tokens, c
        assert seq.result().loops_used == alone.loops_used, c
    # the rule fired, never before min_loops (a first token comes from the prompt's chunk: every loop)
    early = [(n, c.loops) for c, s in zip(cfgs, seqs) if c.early_exit_threshold for n in s.result().loops_used[1:]]
    assert any(n < loops for n, loops in early) and min(n for n, _ in early) >= exits.get("min_loops", 1), early
    assert model.pool.used == 0


@pytest.mark.parametrize("rule", ["entropy", "kl", "argmax", "cdf-asked", "entropy-min4"])
def test_a_rule_decides_the_same_loops_by_iterations_and_by_whole_tokens(make_artifact, rule, monkeypatch):
    """The loop-iteration steps and a forward of whole tokens (TINYLOOP_DEPTH_STEPS=0: Executor.whole_tokens)
    share exits.exit_stops: the same tokens and the same loops per token."""
    arch, exits = RULES[rule]
    model = tinyloop.load_model(make_artifact(**arch), 128)
    cfg = G(max_tokens=12, loops=10, ignore_eos=True, **exits)
    by_iteration = tinyloop.generate(model, ids(13, 63), cfg)
    monkeypatch.setenv("TINYLOOP_DEPTH_STEPS", "0")
    by_token = tinyloop.generate(model, ids(13, 63), cfg)
    assert by_token.tokens == by_iteration.tokens and by_token.loops_used == by_iteration.loops_used
    assert min(by_token.loops_used) < 10


def test_exit_rules_are_checked_against_the_request_and_the_model(make_artifact):
    model = tinyloop.load_model(make_artifact(), 128)
    for fields, needle in [(dict(exit_rule="cdf", early_exit_threshold=0.5), "needs a model with an exit gate"),
                           (dict(exit_rule="entropy"), "needs early_exit_threshold > 0"),
                           (dict(exit_rule="argmax", early_exit_threshold=2.5), "a whole number"),
                           (dict(loops=4, min_loops=5, early_exit_threshold=0.1), "min_loops 5 is more than the 4"),
                           (dict(exit_rule="halting"), "exit_rule must be one of")]:  # (refused when built)
        with pytest.raises(tinyloop.ConfigError, match=needle):
            tinyloop.generate(model, ids(4, 1), G(**fields))


def test_a_shallow_request_does_not_wait_for_the_deepest_lane(make_artifact):
    """Loop iterations, not tokens: a 2-loop request beside a 16-loop one takes about 2 steps per token (here
    exactly: its own prelude-to-head path), and both equal themselves alone."""
    model = tinyloop.load_model(make_artifact(), 128)
    sched = tinyloop.Scheduler(model, lanes=2)
    deep = sched.submit(ids(6, 1), G(max_tokens=12, loops=16))
    shallow = sched.submit(ids(6, 2), G(max_tokens=12, loops=2))
    steps = 0
    while not shallow.done:
        sched.step()
        steps += 1
    assert steps <= 12 + 2  # a step per token: it ends when the shallow lane's token does
    assert deep.count <= 3  # meanwhile the 16-loop lane made a token per 16 steps
    drain(sched)
    for seq, cfg, prompt in ((deep, G(max_tokens=12, loops=16), ids(6, 1)), (shallow, G(max_tokens=12, loops=2), ids(6, 2))):
        assert seq.result().tokens == tinyloop.generate(model, prompt, cfg).tokens


def test_requests_that_come_together_start_with_the_most_loop_iterations(make_artifact):
    """Of the requests that come between the same two steps, the one with the most loop iterations (loops x
    max_tokens) takes a free lane first, so a deep request does not start last and run alone; one that came at an
    earlier step still goes before them, and every result equals its request alone."""
    model = tinyloop.load_model(make_artifact(), 128)
    sched = tinyloop.Scheduler(model, lanes=1)
    cfgs = {"early": G(max_tokens=3, loops=2, ignore_eos=True), "shallow": G(max_tokens=6, loops=2, ignore_eos=True),
            "deep": G(max_tokens=6, loops=8, ignore_eos=True), "long": G(max_tokens=12, loops=2, ignore_eos=True),
            "late": G(max_tokens=4, loops=16, ignore_eos=True)}
    prompts = {name: ids(4, i) for i, name in enumerate(cfgs)}
    seqs = {"early": sched.submit(prompts["early"], cfgs["early"])}
    sched.step()  # it came alone: it takes the lane
    for name in ("shallow", "deep", "long"):  # 12, 48 and 24 loop iterations, together
        seqs[name] = sched.submit(prompts[name], cfgs[name])
    order = sched.step()
    seqs["late"] = sched.submit(prompts["late"], cfgs["late"])  # the deepest of all, but it came later
    while not sched.idle():
        order += sched.step()
    names = {id(s): name for name, s in seqs.items()}
    assert [names[id(s)] for s in order] == ["early", "deep", "long", "shallow", "late"]
    for name, seq in seqs.items():
        assert seq.result().tokens == tinyloop.generate(model, prompts[name], cfgs[name]).tokens


def test_iteration_logits_equal_the_token_level_forward(make_artifact, monkeypatch):
    """The same lanes stepped by loop iterations and by whole tokens (TINYLOOP_DEPTH_STEPS=0) give logits within
    1e-5 (fp32) and the same tokens, lanes at 3, 5 and 8 loops side by side."""
    model = tinyloop.load_model(make_artifact(), 128)
    cfgs = [G(max_tokens=8, loops=3), G(max_tokens=8, loops=5), G(max_tokens=8, loops=8)]
    prompts = [ids(5, 11), ids(9, 12), ids(3, 13)]
    seen: dict[bool, list] = {True: [], False: []}
    sample_all = tinyloop.engine.sequence.Sequence.sample_all

    for iterative in (True, False):
        def recording(seqs, logits, iterative=iterative):
            seen[iterative] += [(tuple(s.prompt), s.count, row.clone()) for s, row in zip(seqs, logits)]
            return sample_all(seqs, logits)
        monkeypatch.setattr(tinyloop.engine.sequence.Sequence, "sample_all", staticmethod(recording))
        sched = tinyloop.Scheduler(model, lanes=3)
        sched.runner.executor.iterative = iterative
        # every lane's logits reach the sampler (test_greedy_draws_in_c_... below)
        sched.runner.executor.options = dataclasses.replace(sched.runner.executor.options, run_ahead=False)
        for p, c in zip(prompts, cfgs):
            sched.submit(p, c)
        drain(sched)
    a, b = sorted(seen[True], key=lambda x: x[:2]), sorted(seen[False], key=lambda x: x[:2])
    assert [x[:2] for x in a] == [x[:2] for x in b] and len(a) == 24
    assert max(float((x[2] - y[2]).abs().max()) for x, y in zip(a, b)) <= 1e-5


def test_the_runner_steps_loop_iterations_for_mixed_depths(make_artifact, monkeypatch):
    """Mixed depths go through Executor.iterate (passes of every row until a token is done: a step per token of the
    shallower lane while both run); lanes all at one fixed depth keep the one forward of every loop per step."""
    model = tinyloop.load_model(make_artifact(), 128)
    monkeypatch.setenv("TINYLOOP_RUN_AHEAD", "0")  # (greedy draws in C would make a step of several tokens)
    calls = {"iterate": 0}
    iterate = Executor.iterate
    monkeypatch.setattr(Executor, "iterate", lambda *a: (calls.__setitem__("iterate", calls["iterate"] + 1),
                                                         iterate(*a))[1])
    tinyloop.generate_batch(model, [ids(4, 1), ids(4, 2)], G(max_tokens=6, loops=4))
    assert calls["iterate"] == 0
    tinyloop.generate_batch(model, [ids(4, 1), ids(4, 2)], [G(max_tokens=6, loops=4), G(max_tokens=6, loops=8)])
    assert calls["iterate"] >= 5  # while both ran: a step per fed token of the 4-loop lane (5 of them)
    assert torch.is_grad_enabled()  # (the step ran under inference_mode and left it)


@pytest.mark.parametrize("rule", ["latent", "gate", "schedule"])
def test_a_token_s_loops_and_exit_decisions_run_as_one_c_call(make_artifact, rule, monkeypatch):
    """Where C decides the exit rule (the latent change, the exit gate, a forced depth), a batch-1 token's passes and
    exit decisions are one C call (Executor.iterate_in_c), no pass returns to Python, and the tokens and loops equal
    the token steps' (TINYLOOP_DEPTH_STEPS=0: Executor.whole_tokens)."""
    from tinyloop.kernels import cpu_block
    arch, exits = {"latent": ({}, dict(early_exit_threshold=0.25)),
                   "gate": (dict(exit_gate=True), dict(early_exit_threshold=0.25)),
                   "schedule": ({}, dict(exit_schedule=(2, 5, 3, 8)))}[rule]
    model = tinyloop.load_model(make_artifact(**arch), 128)
    cfg = G(max_tokens=12, loops=8, ignore_eos=True, **exits)
    calls = {"c": 0, "python": 0}
    monkeypatch.setattr(cpu_block, "RUN_AHEAD_S", 60.0)  # (a call that draws for longer returns: not on a slow day)
    until, one_pass = cpu_block.DecodeStep.iterate_until, Executor.one_pass
    monkeypatch.setattr(cpu_block.DecodeStep, "iterate_until",
                        lambda *a, **k: (calls.__setitem__("c", calls["c"] + 1), until(*a, **k))[1])
    monkeypatch.setattr(Executor, "one_pass", lambda *a: (calls.__setitem__("python", calls["python"] + 1),
                                                          one_pass(*a))[1])
    got = tinyloop.generate(model, ids(6, 5), cfg)
    # greedy draws run ahead in C, past the end of the cell's block (the scheduler took the next one): the call at
    # cell 6 draws the tokens fed at cells 7..16 and returns the logits of cell 16's, the request's last (the first
    # token comes from the prompt's chunk)
    assert calls == {"c": 1, "python": 0}
    monkeypatch.setenv("TINYLOOP_RUN_AHEAD", "0")
    one_each = tinyloop.generate(model, ids(6, 5), cfg)
    assert calls == {"c": 1 + 11, "python": 0}  # without: a call per fed token
    monkeypatch.setenv("TINYLOOP_DEPTH_STEPS", "0")
    by_tokens = tinyloop.generate(model, ids(6, 5), cfg)
    assert got.tokens == one_each.tokens == by_tokens.tokens
    assert got.loops_used == one_each.loops_used == by_tokens.loops_used
    assert min(got.loops_used[1:]) < 8  # it exited early
    if rule == "schedule":
        assert got.loops_used[1:] == [(2, 5, 3, 8)[i % 4] for i in range(1, 12)]  # token i: its depth


@pytest.mark.parametrize("rule", ["latent", "gate", "cdf", "cdf-compute"])
def test_c_decides_every_exit_as_exits_exit_stops_does(make_artifact, rule, monkeypatch):
    """C's exit decision (tl_exit_t) is a mirror of the torch one (exits.exit_stops): lanes whose rule C decides, run
    with the C step and with the C step turned off (every pass and decision in torch), give the same tokens and
    the same loops per token, at batch 1 and beside each other."""
    from tinyloop.kernels import cpu_block

    arch, exits = RULES[rule]
    model = tinyloop.load_model(make_artifact(**arch), 128)
    cfgs = [G(max_tokens=10, loops=10, ignore_eos=True, **exits), G(max_tokens=8, loops=6, ignore_eos=True, **exits)]
    prompts = [ids(7, 21), ids(4, 22)]

    def run():
        alone = tinyloop.generate(model, prompts[0], cfgs[0])
        return [(r.tokens, r.loops_used) for r in [alone, *tinyloop.generate_batch(model, prompts, cfgs)]]

    calls, until = [], cpu_block.DecodeStep.iterate_until
    monkeypatch.setattr(cpu_block.DecodeStep, "iterate_until", lambda *a, **k: (calls.append(1), until(*a, **k))[1])
    in_c = run()
    monkeypatch.setattr(cpu_block, "supported", lambda *a, **k: False)
    c_calls = len(calls)
    assert run() == in_c
    assert c_calls and len(calls) == c_calls  # C decided the first run's exits, torch the second's
    assert any(n < 10 for n in in_c[0][1][1:])  # the rule fired


@pytest.mark.parametrize("case", ["latent-copy", "cdf-compute"])
def test_tokens_in_flight_move_between_the_c_passes_and_the_python_passes(make_artifact, case, monkeypatch):
    """A lane whose rule C decides (latent, cdf) runs its passes in C (Executor.iterate_in_c) until a batch-mate whose
    rule reads logits (entropy, argmax) joins mid-token: then every row's passes run through Python (one_pass), its
    state, exit bookkeeping and Track carried over, and back in C once that batch-mate is gone. Every lane's tokens
    and loops equal the same request alone."""
    arch, c_rule, py_rule = {
        "latent-copy": ({}, dict(early_exit_threshold=0.25), dict(exit_rule="entropy", early_exit_threshold=0.01)),
        "cdf-compute": (dict(ARCHS["ouro"], exit_rule="cdf", exit_kv="compute"), dict(early_exit_threshold=0.97),
                        dict(exit_rule="argmax", early_exit_threshold=2)),
    }[case]
    model = tinyloop.load_model(make_artifact(**arch), 128)
    cfgs = [G(max_tokens=20, loops=12, ignore_eos=True, **c_rule),
            G(max_tokens=18, loops=7, temperature=0.8, seed=5, ignore_eos=True, **c_rule),
            G(max_tokens=4, loops=9, ignore_eos=True, **py_rule), G(max_tokens=3, loops=5, ignore_eos=True, **py_rule)]
    prompts = [ids(5 + 2 * i, 80 + i) for i in range(len(cfgs))]
    calls = {"c": 0, "python": 0}
    in_c, one_pass = Executor.iterate_in_c, Executor.one_pass
    monkeypatch.setattr(Executor, "iterate_in_c", lambda *a: (calls.__setitem__("c", calls["c"] + 1), in_c(*a))[1])
    monkeypatch.setattr(Executor, "one_pass", lambda *a: (calls.__setitem__("python", calls["python"] + 1),
                                                          one_pass(*a))[1])
    sched = tinyloop.Scheduler(model, lanes=4)
    seqs = [sched.submit(prompts[0], cfgs[0]), sched.submit(prompts[1], cfgs[1])]
    for step in range(400):
        if step in (5, 17):  # mid-token for the C lanes (their tokens run 2+ passes a step)
            seqs.append(sched.submit(prompts[len(seqs)], cfgs[len(seqs)]))
        sched.step()
        if sched.idle() and len(seqs) == len(cfgs):
            break
    assert calls["python"] and calls["c"] > calls["python"] / 20, calls  # both paths ran
    for p, c, seq in zip(prompts, cfgs, seqs):
        alone = tinyloop.generate(model, p, c)
        assert seq.result().tokens == alone.tokens and seq.result().loops_used == alone.loops_used, c
    assert any(n < c.loops for c, s in zip(cfgs[:2], seqs) for n in s.result().loops_used[1:])  # the C rule fired


@pytest.mark.parametrize("rule", ["latent", "cdf-compute", "schedule"])
def test_greedy_draws_in_c_equal_the_draws_one_token_a_call(make_artifact, rule, monkeypatch):
    """Greedy rows draw their next tokens inside the C passes (Row.draws): far fewer calls, and every lane's tokens,
    loops per token (and their mean, the stop token's included) and stop reason equal the run where each token returns to the sampler (TINYLOOP_RUN_AHEAD=0) and
    the token steps (TINYLOOP_DEPTH_STEPS=0), beside batch-mates at other depths, a sampled one, one that stops at
    EOS and one whose client stops reading in the middle of a run of C draws (the draws after it are dropped)."""
    from tinyloop.kernels import cpu_block
    arch, exits = {"latent": ({}, dict(early_exit_threshold=0.25)),
                   "cdf-compute": (dict(ARCHS["ouro"], exit_rule="cdf", exit_kv="compute"),
                                   dict(early_exit_threshold=0.6)),
                   "schedule": ({}, dict(exit_schedule=(2, 5, 3, 4)))}[rule]
    model = tinyloop.load_model(make_artifact(**arch), 128)
    prompts = [ids(3 + 2 * i, 90 + i) for i in range(5)]
    cfgs = [G(max_tokens=40, loops=8, ignore_eos=True, **exits), G(max_tokens=30, loops=4, ignore_eos=True),
            G(max_tokens=6, loops=6, temperature=0.9, seed=3, ignore_eos=True, **exits),
            G(max_tokens=40, loops=5, **exits), G(max_tokens=40, loops=7, ignore_eos=True, **exits)]
    alone = tinyloop.generate(model, prompts[4], cfgs[4])
    drawn = {"c": 0}  # tokens drawn inside the C calls
    until = cpu_block.DecodeStep.iterate_until

    def counting(*a, **k):
        got = until(*a, **k)
        drawn["c"] += sum(map(len, got.drawn))
        return got
    monkeypatch.setattr(cpu_block.DecodeStep, "iterate_until", counting)

    def run() -> list[tuple]:
        sched = tinyloop.Scheduler(model, lanes=5)
        # lane 4's client stops reading at its 12th token, one it draws in C in the middle of a run (its 6th and
        # 22nd tokens end their cells' blocks: they return to the sampler)
        seqs = [sched.submit(p, c, on_token=(lambda t, i: i < 11) if n == 4 else None)
                for n, (p, c) in enumerate(zip(prompts, cfgs))]
        drain(sched)
        return [(r.tokens, r.loops_used, r.stats.loops_mean, r.stats.stop_reason) for r in (s.result() for s in seqs)]

    ahead = run()
    in_c, drawn["c"] = drawn["c"], 0
    monkeypatch.setenv("TINYLOOP_RUN_AHEAD", "0")
    one_each = run()
    assert in_c > 60 and drawn["c"] == 0  # most of the greedy lanes' ~120 tokens were drawn in C
    monkeypatch.setenv("TINYLOOP_DEPTH_STEPS", "0")
    by_tokens = run()
    assert ahead == one_each == by_tokens
    assert ahead[4][3] == "cancelled" and ahead[4][0] == alone.tokens[:12]
    assert ahead[3][3] == "eos" or len(ahead[3][0]) == 40


@pytest.mark.parametrize("rule", ["latent", "cdf-compute", "schedule"])
def test_greedy_rows_waiting_to_share_a_head_change_no_token(make_artifact, rule, monkeypatch):
    """A greedy row whose token ended may sit out a pass or two (no K/V, its state kept) so that its head and its
    next token's prelude run in one product with batch-mates' (cpu_block.c's keep_waiting): far fewer head products,
    and every lane's tokens, loops per token and stop reason equal TINYLOOP_COALESCE=0 (every head in the pass its
    token ends) and each request alone, beside batch-mates at other depths and exiting early, a sampled one and one
    that may stop at EOS. A waiting row is left out of the passes: one that ran them anyway would overwrite the K/V
    its early exit copied into the slots of the loops it skipped, which a later, deeper token reads (certain with
    the forced depths, `schedule`). Rows wait only in calls of cpu_block.COALESCE_FROM_ROWS rows or more: with these
    6 rows none does, and the heads are those of TINYLOOP_COALESCE=0."""
    from tinyloop.kernels import cpu_block
    arch, exits = {"latent": ({}, dict(early_exit_threshold=0.25)),
                   "cdf-compute": (dict(ARCHS["ouro"], exit_rule="cdf", exit_kv="compute"),
                                   dict(early_exit_threshold=0.6)),
                   "schedule": ({}, dict(exit_schedule=(2, 5, 3, 4)))}[rule]
    model = tinyloop.load_model(make_artifact(**arch), 128)
    cfgs = [G(max_tokens=40, loops=8, ignore_eos=True, **exits), G(max_tokens=30, loops=3, ignore_eos=True),
            G(max_tokens=36, loops=7, ignore_eos=True, **exits), G(max_tokens=40, loops=5, **exits),
            G(max_tokens=8, loops=6, temperature=0.9, seed=3, ignore_eos=True, **exits),
            G(max_tokens=34, loops=6, ignore_eos=True, **exits)]
    prompts = [ids(3 + 2 * i, 70 + i) for i in range(len(cfgs))]
    heads = {"products": 0}
    until = cpu_block.DecodeStep.iterate_until

    def counting(*a, **k):
        got = until(*a, **k)
        heads["products"] += got.heads
        return got
    monkeypatch.setattr(cpu_block.DecodeStep, "iterate_until", counting)
    monkeypatch.setattr(cpu_block, "RUN_AHEAD_S", 60.0)  # (a stall of a busy machine would end calls early)

    def run() -> tuple[list[tuple], int]:
        heads["products"] = 0
        sched = tinyloop.Scheduler(model, lanes=len(cfgs))
        seqs = [sched.submit(p, c) for p, c in zip(prompts, cfgs)]
        drain(sched)
        return ([(r.tokens, r.loops_used, r.stats.loops_mean, r.stats.stop_reason) for r in (s.result() for s in seqs)],
                heads["products"])

    few, unshared = run()  # 6 rows: fewer than cpu_block.COALESCE_FROM_ROWS, so no row waits
    monkeypatch.setattr(cpu_block, "COALESCE_FROM_ROWS", 2)
    waiting, shared = run()
    monkeypatch.setenv("TINYLOOP_COALESCE", "0")
    each, alone = run()
    assert waiting == each == few
    assert unshared == alone and shared < 0.8 * alone, (unshared, shared, alone)  # the rows did wait for each other
    monkeypatch.delenv("TINYLOOP_COALESCE")
    monkeypatch.setattr(cpu_block, "RUN_AHEAD_S", 0.0)  # every call ends at its first head, and cuts no wait short
    timed, shared_in_time = run()
    assert timed == few and shared_in_time < 0.8 * alone, (shared_in_time, alone)
    for p, c, got in zip(prompts, cfgs, waiting):
        by_itself = tinyloop.generate(model, p, c)
        assert (got[0], got[1]) == (by_itself.tokens, by_itself.loops_used), c
    assert any(n < c.loops for c, got in zip(cfgs, waiting) if c.loops > 3 for n in got[1][1:])  # exits fired
