"""`tinyloop bench --section elastic` (opt-in): elastic depth under load, and early exit against its right ceiling.

1. Elastic depth: scripts/load/elastic.py's side-by-side run (1- and 2-worker services, open-loop Poisson load at
   0.5x-2x the fixed-depth capacity, loops 16 with a floor of 4 against fixed depth), on the bundled model, then on
   the ~50M random config in int8 (scripts/bench/depth.py's FORCED, the memory-bound regime; --quick: its ~2M
   QUICK_FORCED), whose random weights carry no loss-by-loops table (its loss increase reads 0).
2. Early exit against fixed depth at its own mean depth: the bundled model's latent rule (threshold 0.07) at up to 16
   loops, at batch 1 and 16, one-line prompts (at batch 16 twice: 4 prompts in 4 copies each, whose lanes end their
   tokens together, and 16 distinct prompts); then fixed depth at the two whole loop counts around that run's mean
   depth, the same prompts and tokens, interpolated to the mean (a token's time is affine in its loops); decode tokens
   per second of each (after the prompts are in), best of the rounds, the runs alternating. The ratio compares like with like: a token's prelude, coda and head cost the same
   at every depth, which the loops ratio (16 / mean) ignores.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from scripts.bench.depth import FORCED, QUICK_FORCED, SHORT_PROMPTS, depths_around, interpolate, run
from scripts.bench.peers import Report, random_artifact
from tinyloop.loader import free_model, load_model
from tinyloop.request import GenerateConfig

THRESHOLD = 0.07  # the bundled model's latent rule (as the depth section runs it)
# 16 prompts that differ (SHORT_PROMPTS are 4: a batch of 16 holds 4 copies of each, whose lanes end every token
# together): each a short prompt and a word of its own
DISTINCT_PROMPTS = [f"{SHORT_PROMPTS[i % len(SHORT_PROMPTS)]} The {word}" for i, word in enumerate(
    ("river", "castle", "engine", "garden", "winter", "market", "doctor", "forest", "silver", "window", "letter",
     "mountain", "kitchen", "island", "teacher", "battle"))]


def early_exit_at_mean_depth(model_path: str | None, quick: bool) -> tuple[list[str], dict]:
    model = load_model(model_path, 512)
    tokens, rounds = (32, 2) if quick else (96, 3)
    lines = [f"early exit (latent rule, threshold {THRESHOLD}, up to 16 loops) against fixed depth at its own mean "
             f"depth, {tokens} tokens a request, decode tok/s, best of {rounds}; fixed depth at a fractional mean is "
             f"interpolated between the whole depths around it (a token's time is affine in its loops)"]
    data: dict = {}
    try:
        for batch, prompts, name in ((1, SHORT_PROMPTS, "batch1"), (16, SHORT_PROMPTS, "batch16"),
                                     (16, DISTINCT_PROMPTS, "batch16_distinct")):
            def per_token(cfg: GenerateConfig) -> tuple[float, float]:  # decode seconds a token, mean loops
                x = run(model, [cfg] * batch, batch, prompts)
                return x["decode_s"] / (x["tokens"] - batch), sum(x["loops"]) / len(x["loops"])

            early = GenerateConfig(max_tokens=tokens, loops=16, early_exit_threshold=THRESHOLD, ignore_eos=True)
            best, fixed = (float("inf"), 0.0), {}
            for _ in range(rounds):  # early exit, then fixed depth at the whole depths around its mean, in turns
                best = min(best, per_token(early))
                for depth in depths_around(best[1]):
                    fixed[depth] = min(fixed.get(depth, float("inf")),
                                       per_token(GenerateConfig(max_tokens=tokens, loops=depth, ignore_eos=True))[0])
            seconds, mean = best
            around = {d: fixed[d] for d in depths_around(mean)}
            ratio = interpolate(around, mean) / seconds
            what = f"batch {batch:>2}" + (", 16 distinct prompts" if prompts is DISTINCT_PROMPTS else "")
            lines.append(f"  {what}: early exit {1 / seconds:7.1f} tok/s at mean depth {mean:.2f}; fixed depth "
                         + " / ".join(f"{d} loops {1 / t:7.1f}" for d, t in around.items())
                         + f" tok/s, {1 / interpolate(around, mean):7.1f} at {mean:.2f}; ratio {ratio:.3f}")
            data[name] = {"early_tok_s": 1 / seconds, "mean_loops": mean, "ratio": ratio,
                                     "fixed_tok_s": {d: 1 / t for d, t in around.items()}}
    finally:
        free_model(model)
    return lines, data


def bench_elastic(model_path: str | None, quick: bool) -> Report:
    from scripts.load.elastic import elastic_side_by_side

    lines = ["elastic depth: open-loop Poisson load against fixed depth, requests loops 16 (floor 4 when elastic); "
             "goodput = requests meeting both targets per second"]
    size = {"n_requests": 24 if quick else 160, "max_tokens": 12 if quick else 16}
    served = elastic_side_by_side(model_path=model_path, echo=lines.append, **size)
    forced = QUICK_FORCED if quick else FORCED
    lines.append(f"the same on a random config in int8 (d {forced.d_model}, {forced.n_prelude} + {forced.n_core} + "
                 f"{forced.n_coda} layers, {forced.vocab_size} words; no loss table)")
    before = os.environ.get("TINYLOOP_WEIGHTS")
    os.environ["TINYLOOP_WEIGHTS"] = "int8"  # (the services' workers load it so)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = random_artifact(forced, Path(tmp) / "forced.tinyloop")
            served_forced = elastic_side_by_side(model_path=str(path), echo=lines.append, **size)
    finally:
        if before is None:
            del os.environ["TINYLOOP_WEIGHTS"]
        else:
            os.environ["TINYLOOP_WEIGHTS"] = before
    early_lines, early = early_exit_at_mean_depth(model_path, quick)
    return Report(lines + [""] + early_lines, {"elastic": served, "elastic_forced": served_forced, "early_exit": early})
