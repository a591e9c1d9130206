"""tinyloop bench batch: continuous batching against sequential calls."""
from __future__ import annotations

import time

import torch

from scripts.bench.prompts import CODE_PROMPTS
from tinyloop.batch import generate_batch
from tinyloop.generation import generate
from tinyloop.loader import load_model
from tinyloop.request import GenerateConfig, GenerateResult


def bench_batch(model_path: str | None, quick: bool) -> list[str]:
    """generate_batch over 16 lanes vs 16 sequential generate calls, and the cost of one lane running 8x longer.

    The runs alternate in rounds and each keeps its best time, so a load change on the machine hits all alike.
    """
    n, rounds = (16, 2) if quick else (48, 3)
    model = load_model(model_path, 1024)
    prompts = CODE_PROMPTS
    cfg = GenerateConfig(max_tokens=n)
    long_cfgs = [GenerateConfig(max_tokens=8 * n)] + [cfg] * (len(prompts) - 1)  # lane 0 runs 8x longer
    generate_batch(model, prompts[:2], GenerateConfig(max_tokens=2))  # warm up allocator and kernels
    # Both sides run as the product does: torch's threads, with the decode step's thread policy (one thread
    # for a batch-1 step, all for a 16-lane step). On a busy machine, pass TINYLOOP_DECODE_THREADS=1 and run
    # with torch.set_num_threads(1) to measure batching rather than the load.
    threads = torch.get_num_threads()
    runs = {
        "seq": lambda: [generate(model, p, cfg) for p in prompts],
        "b4": lambda: [r for i in range(0, len(prompts), 4) for r in generate_batch(model, prompts[i:i + 4], cfg)],
        "b16": lambda: generate_batch(model, prompts, cfg),
        "div_seq": lambda: [generate(model, p, c) for p, c in zip(prompts, long_cfgs)],
        "div": lambda: generate_batch(model, prompts, long_cfgs),
    }
    best = {k: float("inf") for k in runs}
    out: dict[str, list[GenerateResult]] = {}
    for _ in range(rounds):
        for k, fn in runs.items():
            t = time.perf_counter()
            out[k] = fn()
            best[k] = min(best[k], time.perf_counter() - t)
    tps = {k: sum(r.stats.generated_tokens for r in out[k]) / best[k] for k in runs}
    lines = [f"static batching, {len(prompts)} prompts, greedy, up to {n} tokens each (cache {model.cache_mode}, "
             f"loops {cfg.resolved_loops(model)}), {threads} torch threads, best of {rounds} alternating rounds",
             f"  {'lanes':>5} {'tok/s':>9} {'vs sequential':>14}"]
    for key, label in (("seq", "seq"), ("b4", "4"), ("b16", "16")):
        same = [r.tokens for r in out[key]] == [r.tokens for r in out["seq"]]
        lines.append(f"  {label:>5} {tps[key]:>9.1f} {tps[key] / tps['seq']:>13.2f}x"
                     f"{'' if same else '  (outputs differ from sequential!)'}")
    steps = max(r.stats.generated_tokens for r in out["div"])
    useful = sum(r.stats.generated_tokens for r in out["div"]) / (steps * len(prompts))
    lines.append(f"  divergence (lane 0 runs {8 * n} tokens, the other 15 lanes {n}): batch {tps['div']:.1f} useful tok/s "
                 f"= {best['div_seq'] / best['div']:.2f}x its sequential calls; {best['div'] / best['b16']:.2f}x the time "
                 f"of the uniform batch; {useful:.0%} of lane-steps useful")
    return lines
