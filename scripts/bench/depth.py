"""`tinyloop bench --section depth`: what continuous-depth batching buys, side by side in one run.

Every figure runs the same requests with the runner stepping loop iterations (this tree) and stepping whole tokens
(TINYLOOP_DEPTH_STEPS=0: the engine before continuous-depth batching), alternating, best of the rounds, on two
models: the bundled one (early exit by its latent rule, threshold 0.07) and a ~50M random config in int8 (the
memory-bound regime: a loop streams 26 MB of core weights), whose early exit is a forced pattern
(GenerateConfig.exit_schedule: token i stops after SCHEDULE[i % 8] loops, random weights having no rule worth
firing):
  early exit    up to 16 loops against fixed 16 loops, at batch 1 and 16, one-line prompts: the achieved speedup of
                decode (after the prompts are in) over its ideal (16 / the mean loops a decoded token ran), beside
                what a fixed-depth batch at that mean depth (interpolated between the two whole loop counts around it)
                reaches against the same ideal: a token's prelude, coda and head cost the same at every depth, so
                this reference is the ceiling of early exit's figure, what it reaches if its tokens cost what fixed
                depth's do
  mixed depth   half of 64 requests at 4 loops, half at 16, through 16 lanes, against the same requests (each with
                its own prompt) in depth-homogeneous groups one after the other (one-line prompts)
  lane-iterations per second (a decoded token's core pass is one; the seconds of the run's steps less its
                prompts' forwards) of the mixed and early-exit workloads over a uniform 16-lane batch at 16 loops,
                beside a uniform 16-lane batch's at early exit's mean depth: tokens of fewer loops run fewer passes a
                second even in a uniform batch, so this reference is again the early-exit figure's ceiling, and
                early exit's rate over it is what running lanes at different depths in one batch costs
  shallow       a 2-loop request submitted beside 8- and 16-loop ones (200 tokens each), in one scheduler (a worker's
                batch) and through a 1-worker service (`tinyloop serve`'s processes, the bundled model), against alone
--quick (a smoke run: every figure and every tokens-equal check, none of them worth quoting) runs 16 tokens, one
round of everything, 48-token shallow requests and, in place of the ~50M config, a ~2M one (QUICK_FORCED) of the
same layers, int8 and forced exit pattern.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from contextlib import contextmanager

from broker.launcher import LocalService
from broker.client import Client
from scripts.bench.peers import Report, random_artifact
from scripts.bench.prompts import LONG_CODE_PROMPTS
from tinyloop.batch import Scheduler
from tinyloop.config import ModelConfig
from tinyloop.model import LoopedLM, shapes_only
from tinyloop.loader import Model, free_model, load_model
from tinyloop.request import GenerateConfig


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


SHORT_PROMPTS = [p.splitlines()[0] for p in LONG_CODE_PROMPTS]  # a line each: the run is its decode, not its prefill


def run(model: Model, cfgs: list[GenerateConfig], lanes: int, prompts: list[str] = LONG_CODE_PROMPTS) -> dict:
    """The requests through one scheduler of `lanes` lanes: wall seconds of the run, of its decode after the last
    prompt is in and of its steps less the prompts' forwards (what its lane-iterations ran in), tokens,
    lane-iterations (core passes of every lane's decoded tokens), the tokens themselves, each request's finish time
    and the mean loops of its decoded tokens (the first comes from the prompt's chunk, at every loop)."""
    sched = Scheduler(model, lanes)
    seqs = [sched.submit(prompts[i % len(prompts)], c) for i, c in enumerate(cfgs)]
    t0, ends = time.perf_counter(), {}
    while not sched.idle():
        for seq in sched.step():
            ends[id(seq)] = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    passes = sum(sum(s.loop_counts[1:]) for s in seqs)  # decode's (a prompt's chunk runs every loop of each token)
    decode = wall - (max(s.t_prefilled for s in seqs) - t0)  # after the last prompt is in: decode alone
    prefill = sum(s.stats.prefill_ms for s in seqs) / 1000  # its prompts' forwards, within the run's steps
    return {"s": wall, "decode_s": decode, "passes_s": wall - prefill, "tokens": sum(s.count for s in seqs),
            "passes": passes, "decoded": sum(len(s.loop_counts) - 1 for s in seqs),
            "out": [s.result().tokens for s in seqs],
            "ends": [ends[id(s)] for s in seqs],
            "loops": [sum(s.loop_counts[1:]) / max(1, len(s.loop_counts) - 1) for s in seqs]}


def best_of(workloads: dict, rounds: int, key: str = "s") -> dict[str, dict[bool, dict]]:
    """Each workload() (a run's figures) with loop-iteration steps and with token steps; the faster of each by `key`.
    A round runs every workload in both modes one after the other, so the workloads a figure compares are measured
    side by side: this VM's speed drifts by 10-30 % over a minute, which would otherwise land on one side of a ratio."""
    out: dict[str, dict[bool, dict]] = {name: {} for name in workloads}
    for _ in range(rounds):
        for name, workload in workloads.items():
            for tokens in (False, True):
                with token_steps(tokens):
                    r = workload()
                if tokens not in out[name] or r[key] < out[name][tokens][key]:
                    out[name][tokens] = r
    return out


def runs(model: Model, cfgs: list[GenerateConfig], lanes: int, prompts: list[str] = LONG_CODE_PROMPTS):
    """A workload for best_of: run() of the requests."""
    return lambda: run(model, cfgs, lanes, prompts)


def groups_run(model: Model, cfgs: list[GenerateConfig], lanes: int, prompts: list[str]):
    """A workload for best_of: the requests of run(model, cfgs, lanes, prompts), each with its own prompt, in groups of
    one loop count run one after the other, its seconds the sum of theirs (in one round: the best of each group's
    rounds summed would pick every group's luckiest round, a bias of several percent on this noisy a machine against
    the one workload it is compared with)."""
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(cfgs):
        groups.setdefault(c.loops, []).append(i)

    def workload() -> dict:
        seconds, out = 0.0, [None] * len(cfgs)
        for g in groups.values():
            r = run(model, [cfgs[i] for i in g], lanes, [prompts[i % len(prompts)] for i in g])
            seconds += r["s"]
            for i, tokens in zip(g, r["out"]):
                out[i] = tokens
        return {"s": seconds, "out": out}
    return workload


L = 16  # the deepest loop count of every figure
SHALLOW_TOKENS = 200  # each request of the shallow figures, as issue 31 measured them (a long prompt's prefill at 8
# and 16 loops, which the shallow request shares the machine with, weighs less against 200 tokens than against 16)
SCHEDULE = (2, 4, 16, 3, 6, 12, 5, 8)  # the forced exit pattern's loops per token (mean 7: ideal 2.29x)
# ~50M parameters: 8192 x 768 tied embedding, 1 + 3 + 1 layers of d 768 (12 heads, 4 KV heads, SwiGLU 3072)
FORCED = ModelConfig(vocab_size=8192, d_model=768, n_heads=12, n_kv_heads=4, ffn_hidden=3072, n_prelude=1, n_core=3,
                     n_coda=1, max_loops=L, default_loops=L, injection="adapter", bos_id=1, eos_id=2)
# --quick's: the same layers at d 128 (4 heads, 2 KV heads, SwiGLU 512), ~2M parameters
QUICK_FORCED = replace(FORCED, d_model=128, n_heads=4, n_kv_heads=2, ffn_hidden=512)
QUICK_SHALLOW_TOKENS = 48


def depths_around(mean: float) -> list[int]:
    """The whole loop counts around a mean depth, for fixed-depth runs to interpolate between."""
    return sorted({int(mean), min(int(mean) + 1, L)})


def interpolate(at: dict[int, float], x: float) -> float:
    """A figure at x loops, linear between the loop counts it was measured at (a token's prelude, coda and head cost
    the same at every depth, its passes one each)."""
    (a, ya), (b, yb) = min(at.items()), max(at.items())
    return ya + (yb - ya) * (x - a) / (b - a) if b > a else ya


def figures(model: Model, label: str, early: GenerateConfig, n: int, rounds: int, k: int,
            exit_rounds: int | None = None, shallow_tokens: int = SHALLOW_TOKENS) -> tuple[list[str], dict]:
    """The early-exit, mixed-depth, lane-iteration and in-scheduler shallow figures of one model, `early` its early
    exit request (n tokens, as every request here but the shallow figure's, of shallow_tokens each); k requests per
    lane in the 16-lane workloads; the early-exit lines best of exit_rounds (short runs: 2 * rounds + 1 unless
    given)."""
    exit_rounds = 2 * rounds + 1 if exit_rounds is None else exit_rounds
    fixed, early = GenerateConfig(max_tokens=n, loops=L, ignore_eos=True), replace(early, max_tokens=n)
    run(model, [early, fixed], 2)  # warm-up
    lines, data = [f"  {label} (best of {rounds} rounds, the early-exit lines of {exit_rounds}):"], {}
    for batch in (1, 16):
        # decode's time, after the prompts are in (a prompt's chunks run every loop under every rule), and that of
        # fixed-depth batches at the two whole loop counts around early exit's mean depth (its tokens are the same in
        # every round and mode)
        probe = run(model, [early] * batch, batch, SHORT_PROMPTS)
        around = depths_around(sum(probe["loops"]) / batch)
        got = best_of({"fixed": runs(model, [fixed] * batch, batch, SHORT_PROMPTS),
                       "early": runs(model, [early] * batch, batch, SHORT_PROMPTS),
                       **{loops: runs(model, [replace(fixed, loops=loops)] * batch, batch, SHORT_PROMPTS)
                          for loops in around}}, exit_rounds, "decode_s")
        f, e = got["fixed"], got["early"]
        mean = sum(e[False]["loops"]) / batch
        ideal = L / mean
        for tokens, name in ((False, "now"), (True, "before")):
            speedup = f[tokens]["decode_s"] / e[tokens]["decode_s"]
            at_mean = interpolate({loops: got[loops][tokens]["decode_s"] for loops in around}, mean)
            reference = f[tokens]["decode_s"] / at_mean / ideal
            ms = e[tokens]["decode_s"] * 1000, f[tokens]["decode_s"] * 1000
            lines.append(f"    early exit vs fixed {L}, batch {batch:>2}, {name:<6}: {speedup:.2f}x faster ({ms[0]:.0f} "
                         f"against {ms[1]:.0f} ms; ideal {ideal:.2f}x: {mean:.1f} loops per token) = {speedup / ideal:.0%} "
                         f"of ideal, where fixed depth at {mean:.1f} loops reaches {reference:.0%}; tokens equal: "
                         f"{'yes' if e[tokens]['out'] == e[not tokens]['out'] else 'NO'}")
            data[f"early_exit_b{batch}_{name}"] = {"speedup": speedup, "ideal": ideal, "fraction": speedup / ideal,
                                                   "fixed_at_mean_fraction": reference}
    # one-line prompts here too: the figures are decode's loop iterations (long prompts' prefill, the same work in
    # every arm, would outweigh them at these token counts)
    shallow, deep, short = GenerateConfig(max_tokens=n, loops=4, ignore_eos=True), fixed, SHORT_PROMPTS
    # early exit's mean depth, for the uniform batches around it (its tokens are the same in every round and mode)
    probe = run(model, [early] * 16 * k, 16, short)
    mean = probe["passes"] / probe["decoded"]
    around = depths_around(mean)
    mixed = [shallow, deep] * (8 * k)
    got = best_of({"together": runs(model, mixed, 16, short), "apart": groups_run(model, mixed, 16, short),
                   "uniform": runs(model, [deep] * 16 * k, 16, short),
                   "early16": runs(model, [early] * 16 * k, 16, short),
                   **{loops: runs(model, [replace(fixed, loops=loops)] * 16 * k, 16, short) for loops in around}},
                  rounds)
    together, apart, uniform, early16 = got["together"], got["apart"], got["uniform"], got["early16"]
    for tokens, name in ((False, "now"), (True, "before")):
        ratio = apart[tokens]["s"] / together[tokens]["s"]
        urate = uniform[tokens]["passes"] / uniform[tokens]["passes_s"]
        rate = together[tokens]["passes"] / together[tokens]["passes_s"]
        erate = early16[tokens]["passes"] / early16[tokens]["passes_s"]
        # a uniform batch at the mean depth: its decoded token's seconds, linear in its loops between the runs around
        mrate = mean / interpolate({loops: got[loops][tokens]["passes_s"] / got[loops][tokens]["decoded"]
                                    for loops in around}, mean)
        same = "yes" if together[tokens]["out"] == apart[tokens]["out"] else "NO"
        lines.append(f"    mixed depth (4 and 16 loops, {16 * k} requests through 16 lanes), {name:<6}: {ratio:.2f}x the "
                     f"same requests in depth-homogeneous groups (tokens equal: {same}); lane-iterations/s {rate:.0f} = "
                     f"{rate / urate:.2f} of a uniform 16-lane batch at {L} ({urate:.0f}); early exit's {erate:.0f} = "
                     f"{erate / urate:.2f}, where a uniform 16-lane batch at its mean depth, {mean:.1f} loops, reaches "
                     f"{mrate / urate:.2f} ({mrate:.0f}): {erate / mrate:.2f} of it")
        data[f"mixed_{name}"] = {"vs_homogeneous": ratio, "lane_iterations_vs_uniform": rate / urate}
        data[f"early_lane_iterations_{name}"] = erate / urate
        data[f"uniform_at_mean_lane_iterations_{name}"] = mrate / urate
        data[f"early_lane_iterations_same_depth_{name}"] = erate / mrate
    two, m = GenerateConfig(max_tokens=shallow_tokens, loops=2, ignore_eos=True), shallow_tokens
    mates = [GenerateConfig(max_tokens=m, loops=8, ignore_eos=True), GenerateConfig(max_tokens=m, loops=L, ignore_eos=True)]
    got = best_of({"solo": lambda: {"s": run(model, [two], 4)["ends"][0]},
                   "beside": lambda: {"s": run(model, [two, *mates], 4)["ends"][0]}}, rounds)
    for tokens, name in ((False, "now"), (True, "before")):
        solo, beside = got["solo"][tokens]["s"], got["beside"][tokens]["s"]
        lines.append(f"    a 2-loop request beside 8- and 16-loop ones in one scheduler ({m} tokens each), {name:<6}: "
                     f"{beside * 1000:.0f} ms against {solo * 1000:.0f} ms alone = {beside / solo:.2f}x")
        data[f"shallow_{name}"] = beside / solo
    return lines, data


def served_shallow(rounds: int, before: bool, tokens: int = SHALLOW_TOKENS) -> float:
    """A 2-loop request sent right after an 8- and a 16-loop one (`tokens` each) to a 1-worker service of the
    bundled model: its time to the final answer over its time alone (best of the rounds each)."""
    env = os.environ.get("TINYLOOP_DEPTH_STEPS")
    os.environ["TINYLOOP_DEPTH_STEPS"] = "0" if before else "1"  # the worker inherits it
    try:
        with LocalService(1, ["--max-seq-len", "1024", "--max-handles", "0"]) as svc, \
                Client(svc.frontend, timeout=600) as client:
            def shallow_time(beside: bool) -> float:
                deep = [client.submit("generate", {"prompt": LONG_CODE_PROMPTS[i], "max_tokens": tokens,
                                                   "loops": loops, "ignore_eos": True})
                        for i, loops in enumerate((8, 16))] if beside else []
                t0 = time.perf_counter()
                client.submit("generate", {"prompt": LONG_CODE_PROMPTS[2], "max_tokens": tokens, "loops": 2,
                                           "ignore_eos": True}).result()
                took = time.perf_counter() - t0
                for p in deep:
                    p.result()
                return took

            shallow_time(True)  # warm-up
            solo, beside = zip(*((shallow_time(False), shallow_time(True)) for _ in range(rounds)))  # side by side
            solo, beside = min(solo), min(beside)
    finally:
        if env is None:
            del os.environ["TINYLOOP_DEPTH_STEPS"]
        else:
            os.environ["TINYLOOP_DEPTH_STEPS"] = env
    return beside / solo


def bench_depth(model_path: str | None, quick: bool) -> Report:
    n, rounds, k = (16, 1, 1) if quick else (48, 3, 4)
    exit_rounds, shallow_tokens, forced = (1, QUICK_SHALLOW_TOKENS, QUICK_FORCED) if quick else \
        (2 * rounds + 1, SHALLOW_TOKENS, FORCED)
    lines = [f"continuous-depth batching, {n} tokens per request; 'now' steps loop iterations, "
             f"'before' whole tokens (TINYLOOP_DEPTH_STEPS=0), alternating"]
    data: dict = {}
    model = load_model(model_path, 1024)
    got, data["bundled"] = figures(model, "bundled model, early exit by its latent rule at 0.07",
                                   GenerateConfig(max_tokens=n, loops=L, early_exit_threshold=0.07, ignore_eos=True),
                                   n, rounds, k, exit_rounds, shallow_tokens)
    lines += got
    free_model(model)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(str(random_artifact(forced, Path(tmp) / "forced.tinyloop")), 1024, weights="int8")
        with shapes_only():
            params = LoopedLM(forced, max_seq_len=1).num_params()
        got, data["forced"] = figures(model, f"random {params / 1e6:.0f}M config, int8, forced exit pattern {SCHEDULE}",
                                      GenerateConfig(max_tokens=n, loops=L, exit_schedule=SCHEDULE, ignore_eos=True),
                                      max(8, n // 3), 1 if quick else 2, k, exit_rounds, shallow_tokens)
        lines += got
        free_model(model)
    for before in ((False,) if quick else (False, True)):
        ratio = served_shallow(rounds, before, shallow_tokens)
        name = "before" if before else "now"
        lines.append(f"  a 2-loop request sent after an 8- and a 16-loop one to a 1-worker service "
                     f"({shallow_tokens} tokens each, best of {rounds}), {name:<6}: {ratio:.2f}x its time alone")
        data[f"served_shallow_{name}"] = ratio
    return Report(lines, data)
