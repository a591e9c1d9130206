"""Continuous-depth batching (engine/runner.py: Runner.iterate): rows at different depths, or exiting early, advance
one loop iteration per step, so a shallow lane's tokens do not wait for the deepest lane of the step. Every lane's
output equals the same request alone, whatever its batch-mates' depths, for every exit rule and cache mode."""
from __future__ import annotations

import pytest
import torch

import tinyloop
from conftest import ARCHS, ids
from tinyloop import GenerateConfig as G
from tinyloop.engine.runner import Runner


def drain(sched: tinyloop.Scheduler) -> int:
    steps = 0
    while not sched.idle():
        sched.step()
        steps += 1
    return steps


RULES = {  # the exit rules as the families define them: latent change (and an exit gate), Ouro's cdf gate
    "latent": {},
    "gate": dict(exit_gate=True),
    "cdf": dict(ARCHS["ouro"], exit_rule="cdf"),
    "cdf-compute": dict(ARCHS["ouro"], exit_rule="cdf", exit_kv="compute"),
}


@pytest.mark.parametrize("mode", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("rule", list(RULES))
def test_every_exit_rule_beside_lanes_at_other_depths_equals_it_alone(make_artifact, mode, rule):
    model = tinyloop.load_model(make_artifact(**RULES[rule]), 128, cache_mode=mode)
    threshold = 0.5 if rule.startswith("cdf") else 0.25
    cfgs = [G(max_tokens=14, loops=8, early_exit_threshold=threshold),
            G(max_tokens=10, loops=2), G(max_tokens=12, loops=16),
            G(max_tokens=12, loops=6, early_exit_threshold=threshold, temperature=0.8, seed=3),
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
    assert model.pool.used == 0


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
            seen[iterative] += [(s.place.arrival, s.count, row.clone()) for s, row in zip(seqs, logits)]
            return sample_all(seqs, logits)
        monkeypatch.setattr(tinyloop.engine.sequence.Sequence, "sample_all", staticmethod(recording))
        sched = tinyloop.Scheduler(model, lanes=3)
        sched.runner.iterative = iterative
        for p, c in zip(prompts, cfgs):
            sched.submit(p, c)
        drain(sched)
    a, b = sorted(seen[True], key=lambda x: x[:2]), sorted(seen[False], key=lambda x: x[:2])
    assert [x[:2] for x in a] == [x[:2] for x in b] and len(a) == 24
    assert max(float((x[2] - y[2]).abs().max()) for x, y in zip(a, b)) <= 1e-5


def test_the_runner_steps_loop_iterations_for_mixed_depths(make_artifact, monkeypatch):
    """Mixed depths go through Runner.iterate (a pass of every row at a time); lanes all at one fixed depth keep the
    one forward of every loop per step."""
    model = tinyloop.load_model(make_artifact(), 128)
    calls = {"iterate": 0}
    one_pass = Runner.one_pass
    monkeypatch.setattr(Runner, "one_pass", lambda self, rows: (calls.__setitem__("iterate", calls["iterate"] + 1),
                                                                one_pass(self, rows))[1])
    tinyloop.generate_batch(model, [ids(4, 1), ids(4, 2)], G(max_tokens=6, loops=4))
    assert calls["iterate"] == 0
    tinyloop.generate_batch(model, [ids(4, 1), ids(4, 2)], [G(max_tokens=6, loops=4), G(max_tokens=6, loops=8)])
    assert calls["iterate"] >= 5 * 4  # while both ran: a pass per step (the 4-loop lane's 5 fed tokens, 4 each)
    assert torch.is_grad_enabled()  # (the step ran under inference_mode and left it)
