"""`tinyloop bench --section depth`: what continuous-depth batching buys, side by side in one run.

Every figure runs the same requests with the runner stepping loop iterations (this tree) and stepping whole tokens
(TINYLOOP_DEPTH_STEPS=0: the engine before continuous-depth batching), alternating, best of the rounds:
  early exit    threshold 0.07 at up to 16 loops against fixed 16 loops, at batch 1 and 16: the achieved speedup
                over its ideal (16 / the mean loops a token ran)
  mixed depth   half the requests at 4 loops, half at 16, through 16 lanes, against the same requests in
                depth-homogeneous groups one after the other
  lane-iterations per second (a lane's core pass is one) of the mixed and early-exit workloads over a uniform
                16-lane batch at 16 loops
  shallow       a 2-loop request submitted beside 16-loop ones (one scheduler: a worker's batch) against alone
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

from scripts.bench.peers import Report
from scripts.bench.prompts import LONG_CODE_PROMPTS
from tinyloop.batch import Scheduler
from tinyloop.runtime import Model, load_model
from tinyloop.types import GenerateConfig


@contextmanager
def token_steps(on: bool):
    """Runners created inside step whole tokens (the engine before) when on."""
    old = os.environ.get("TINYLOOP_DEPTH_STEPS")
    os.environ["TINYLOOP_DEPTH_STEPS"] = "0" if on else "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TINYLOOP_DEPTH_STEPS"]
        else:
            os.environ["TINYLOOP_DEPTH_STEPS"] = old


def run(model: Model, cfgs: list[GenerateConfig], lanes: int) -> dict:
    """The requests through one scheduler of `lanes` lanes: wall seconds of the decode, tokens, lane-iterations (core
    passes of every lane), the tokens themselves and each request's finish time."""
    sched = Scheduler(model, lanes)
    seqs = [sched.submit(LONG_CODE_PROMPTS[i % len(LONG_CODE_PROMPTS)], c) for i, c in enumerate(cfgs)]
    t0, ends = time.perf_counter(), {}
    while not sched.idle():
        for seq in sched.step():
            ends[id(seq)] = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    passes = sum(sum(s.loop_counts) for s in seqs)
    return {"s": wall, "tokens": sum(s.count for s in seqs), "passes": passes, "out": [s.result().tokens for s in seqs],
            "ends": [ends[id(s)] for s in seqs], "loops": [s.result().stats.loops_mean for s in seqs]}


def best(model: Model, cfgs: list[GenerateConfig], lanes: int, rounds: int) -> dict[bool, dict]:
    """run() with loop-iteration steps and with token steps, alternating; the faster of each."""
    out: dict[bool, dict] = {}
    for _ in range(rounds):
        for tokens in (False, True):
            with token_steps(tokens):
                r = run(model, cfgs, lanes)
            if tokens not in out or r["s"] < out[tokens]["s"]:
                out[tokens] = r
    return out


def bench_depth(model_path: str | None, quick: bool) -> Report:
    model = load_model(model_path, 1024)
    n, rounds = (16, 1) if quick else (48, 3)
    L, thr = 16, 0.07
    fixed, early = GenerateConfig(max_tokens=n, loops=L), GenerateConfig(max_tokens=n, loops=L, early_exit_threshold=thr)
    run(model, [early, fixed], 2)  # warm-up
    lines = [f"continuous-depth batching, bundled model, {n} tokens per request, best of {rounds}; 'now' steps loop "
             f"iterations, 'before' whole tokens (TINYLOOP_DEPTH_STEPS=0), alternating"]
    data: dict = {}
    for batch in (1, 16):
        f, e = best(model, [fixed] * batch, batch, rounds), best(model, [early] * batch, batch, rounds)
        mean = sum(e[False]["loops"]) / batch
        ideal = L / mean
        for tokens, name in ((False, "now"), (True, "before")):
            got = f[tokens]["s"] / e[tokens]["s"]
            lines.append(f"  early exit {thr} vs fixed {L}, batch {batch:>2}, {name:<6}: {got:.2f}x faster (ideal "
                         f"{ideal:.2f}x: {mean:.1f} loops per token) = {got / ideal:.0%} of ideal; tokens equal: "
                         f"{'yes' if e[tokens]['out'] == e[not tokens]['out'] else 'NO'}")
            data[f"early_exit_b{batch}_{name}"] = {"speedup": got, "ideal": ideal, "fraction": got / ideal}
    k = 2 if quick else 4  # requests per lane
    shallow, deep = GenerateConfig(max_tokens=n, loops=4), GenerateConfig(max_tokens=n, loops=L)
    mixed = [shallow, deep] * (8 * k)
    together = best(model, mixed, 16, rounds)
    apart = {t: {"s": best(model, [shallow] * 8 * k, 16, rounds)[t]["s"] + best(model, [deep] * 8 * k, 16, rounds)[t]["s"]}
             for t in (False, True)}
    uniform = best(model, [deep] * 16 * k, 16, rounds)
    for tokens, name in ((False, "now"), (True, "before")):
        ratio = apart[tokens]["s"] / together[tokens]["s"]
        rate = together[tokens]["passes"] / together[tokens]["s"]
        urate = uniform[tokens]["passes"] / uniform[tokens]["s"]
        lines.append(f"  mixed depth (4 and 16 loops, {16 * k} requests through 16 lanes), {name:<6}: {ratio:.2f}x the "
                     f"depth-homogeneous groups; lane-iterations/s {rate:.0f} = {rate / urate:.2f} of a uniform "
                     f"16-lane batch at {L} ({urate:.0f})")
        data[f"mixed_{name}"] = {"vs_homogeneous": ratio, "lane_iterations_vs_uniform": rate / urate}
    early16 = best(model, [early] * 16 * k, 16, rounds)
    for tokens, name in ((False, "now"), (True, "before")):
        rate = early16[tokens]["passes"] / early16[tokens]["s"]
        urate = uniform[tokens]["passes"] / uniform[tokens]["s"]
        lines.append(f"  early exit, {16 * k} requests through 16 lanes, {name:<6}: lane-iterations/s {rate:.0f} = "
                     f"{rate / urate:.2f} of the uniform batch")
        data[f"early_lane_iterations_{name}"] = rate / urate
    two = GenerateConfig(max_tokens=n, loops=2)
    for tokens, name in ((False, "now"), (True, "before")):
        with token_steps(tokens):
            solo = min(run(model, [two], 4)["ends"][0] for _ in range(rounds))
            beside = min(run(model, [two, GenerateConfig(max_tokens=n, loops=8), deep], 4)["ends"][0]
                         for _ in range(rounds))
        lines.append(f"  a 2-loop request beside 8- and 16-loop ones, {name:<6}: {beside * 1000:.0f} ms against "
                     f"{solo * 1000:.0f} ms alone = {beside / solo:.2f}x")
        data[f"shallow_{name}"] = beside / solo
    return Report(lines, data)
