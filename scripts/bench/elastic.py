"""`tinyloop bench --section elastic` (opt-in): elastic depth under load, and early exit against its right ceiling.

1. Elastic depth: scripts/load/elastic.py's side-by-side run (1- and 2-worker services, open-loop Poisson load at
   0.5x-2x the fixed-depth capacity, loops 16 with a floor of 4 against fixed depth).
2. Early exit against fixed depth at its own mean depth: the bundled model's latent rule (threshold 0.07) at up to 16
   loops, at batch 1 and 16, one-line prompts; then fixed depth at the two whole loop counts around that run's mean
   depth, the same prompts and tokens, interpolated to the mean (a token's time is affine in its loops); decode tokens
   per second of each (after the prompts are in), best of the rounds, the runs alternating. The ratio compares like with like: a token's prelude, coda and head cost the same
   at every depth, which the loops ratio (16 / mean) ignores.
"""
from __future__ import annotations

from scripts.bench.depth import SHORT_PROMPTS, run
from scripts.bench.peers import Report
from tinyloop.loader import free_model, load_model
from tinyloop.request import GenerateConfig

THRESHOLD = 0.07  # the bundled model's latent rule (as the depth section runs it)


def early_exit_at_mean_depth(model_path: str | None, quick: bool, echo=None) -> tuple[list[str], dict]:
    model = load_model(model_path, 512)
    tokens, rounds = (32, 2) if quick else (96, 3)
    lines = [f"early exit (latent rule, threshold {THRESHOLD}, up to 16 loops) against fixed depth at its own mean "
             f"depth, {tokens} tokens a request, decode tok/s, best of {rounds}; fixed depth at a fractional mean is "
             f"the interpolation of the two whole depths around it (a token's time is affine in its loops)"]
    data: dict = {}

    def rate(x: dict) -> float:
        return (x["tokens"] - batch) / x["decode_s"]

    try:
        for batch in (1, 16):
            early = [GenerateConfig(max_tokens=tokens, loops=16, early_exit_threshold=THRESHOLD, ignore_eos=True)] * batch
            best: dict = {}
            for _ in range(rounds):  # early exit, then fixed depth at the whole depths around its mean, in turns
                r = run(model, early, batch, SHORT_PROMPTS)
                mean = sum(r["loops"]) / len(r["loops"])
                if "early" not in best or rate(r) > best["early"][0]:
                    best["early"] = (rate(r), mean)
                for depth in sorted({max(1, int(mean)), max(1, int(mean)) + 1}):
                    fixed = [GenerateConfig(max_tokens=tokens, loops=depth, ignore_eos=True)] * batch
                    best[depth] = max(best.get(depth, 0.0), rate(run(model, fixed, batch, SHORT_PROMPTS)))
            tok_s, mean = best["early"]
            lo = max(1, int(mean))
            if lo + 1 not in best:  # (a later round's mean fell in another interval: measure its upper depth too)
                fixed = [GenerateConfig(max_tokens=tokens, loops=lo + 1, ignore_eos=True)] * batch
                best[lo + 1] = rate(run(model, fixed, batch, SHORT_PROMPTS))
            if lo not in best:
                fixed = [GenerateConfig(max_tokens=tokens, loops=lo, ignore_eos=True)] * batch
                best[lo] = rate(run(model, fixed, batch, SHORT_PROMPTS))
            frac = mean - lo
            at_mean = 1 / ((1 - frac) / best[lo] + frac / best[lo + 1])  # seconds per token, interpolated
            ratio = tok_s / at_mean
            lines.append(f"  batch {batch:>2}: early exit {tok_s:7.1f} tok/s at mean depth {mean:.2f}; fixed depth "
                         f"{lo} / {lo + 1} loops {best[lo]:7.1f} / {best[lo + 1]:7.1f} tok/s, {at_mean:7.1f} at "
                         f"{mean:.2f}; ratio {ratio:.3f}")
            data[f"batch{batch}"] = {"early_tok_s": tok_s, "mean_loops": mean, "fixed_at_mean_tok_s": at_mean,
                                     "fixed": {lo: best[lo], lo + 1: best[lo + 1]}, "ratio": ratio}
    finally:
        free_model(model)
    return lines, data


def bench_elastic(model_path: str | None, quick: bool) -> Report:
    from scripts.load.elastic import elastic_side_by_side

    lines = ["elastic depth: open-loop Poisson load against fixed depth, requests loops 16 (floor 4 when elastic); "
             "goodput = requests meeting both targets per second"]
    served = elastic_side_by_side(model_path=model_path, n_requests=24 if quick else 160,
                                  max_tokens=12 if quick else 16, echo=lines.append)
    early_lines, early = early_exit_at_mean_depth(model_path, quick)
    return Report(lines + [""] + early_lines, {"elastic": served, "early_exit": early})
