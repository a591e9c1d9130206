"""`tinyloop bench --section elastic` (opt-in): elastic depth under load, and early exit against its right ceiling.

1. Elastic depth: scripts/load/elastic.py's side-by-side run (1- and 2-worker services, open-loop Poisson load at
   0.5x-2x the fixed-depth capacity, loops 16 with a floor of 4 against fixed depth).
2. Early exit against fixed depth at its own mean depth: the bundled model's latent rule (threshold 0.07) at up to 16
   loops, at batch 1 and 16, one-line prompts; then fixed depth at that run's mean depth (rounded to a whole loop
   count), the same prompts and tokens; decode tokens per second of each (after the prompts are in), best of the
   rounds, the runs alternating. The ratio compares like with like: a token's prelude, coda and head cost the same
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
             f"depth (rounded), {tokens} tokens a request, decode tok/s, best of {rounds}"]
    data: dict = {}
    try:
        for batch in (1, 16):
            early = [GenerateConfig(max_tokens=tokens, loops=16, early_exit_threshold=THRESHOLD, ignore_eos=True)] * batch
            best: dict[str, dict] = {}
            mean = None
            for _ in range(rounds):
                r = run(model, early, batch, SHORT_PROMPTS)
                mean = sum(r["loops"]) / len(r["loops"])
                fixed = [GenerateConfig(max_tokens=tokens, loops=max(1, round(mean)), ignore_eos=True)] * batch
                f = run(model, fixed, batch, SHORT_PROMPTS)
                for name, x in (("early", r), ("fixed", f)):
                    rate = (x["tokens"] - batch) / x["decode_s"]
                    if name not in best or rate > best[name]["tok_s"]:
                        best[name] = {"tok_s": rate, "loops": sum(x["loops"]) / len(x["loops"])}
            ratio = best["early"]["tok_s"] / best["fixed"]["tok_s"]
            lines.append(f"  batch {batch:>2}: early exit {best['early']['tok_s']:7.1f} tok/s at mean depth "
                         f"{best['early']['loops']:.2f}; fixed depth {round(mean)} loops {best['fixed']['tok_s']:7.1f} "
                         f"tok/s; ratio {ratio:.3f}")
            data[f"batch{batch}"] = {**{k: v for k, v in best.items()}, "ratio": ratio}
    finally:
        free_model(model)
    return lines, data


def bench_elastic(model_path: str | None, quick: bool) -> Report:
    from scripts.load.elastic import elastic_side_by_side

    lines = ["elastic depth: open-loop Poisson load against fixed depth, requests loops 16 (floor 4 when elastic); "
             "goodput = requests meeting both targets per second"]
    served = elastic_side_by_side(model_path=model_path, n_requests=16 if quick else 32,
                                  max_tokens=12 if quick else 16, echo=lines.append)
    early_lines, early = early_exit_at_mean_depth(model_path, quick)
    return Report(lines + [""] + early_lines, {"elastic": served, "early_exit": early})
