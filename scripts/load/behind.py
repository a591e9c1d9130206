"""`tinyloop loadtest --behind-long`: short requests behind a long one, now against an older revision, in one run.

For each kind of long request (beam search, speculative decoding, a grammar), a 1-worker service receives the long
request and, right after it, 4 short greedy ones. A request that runs in the worker's batch lets the short ones run
beside it; one that runs alone holds them back until it ends. Reported per kind and tree: how many short requests
finished before the long one, and their latency (median and worst). The trees take turns; both services are
started first (`--before REV` is run from `git archive REV`).
"""
from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from broker.client import AsyncClient
from broker.launcher import LocalService
from scripts.bench.prompts import CODE_PROMPTS, LONG_CODE_PROMPTS

LONG: dict[str, tuple[str, dict]] = {  # kind -> (op, params) of the long request
    "beam": ("generate", {"beam_size": 3, "max_tokens": 160}),
    "speculative": ("speculative", {"draft_loops": 2, "verify_loops": 8, "draft_ahead": 4, "max_tokens": 160,
                                    "loops": 8}),
    "grammar": ("generate", {"grammar": {"regex": "[a-z ]{150,200}"}, "max_tokens": 200}),
}
SHORT = {"max_tokens": 16, "temperature": 0.0}


async def behind_one(frontend: str, op: str, params: dict, prompt: str) -> dict:
    """The long request, then 4 short ones 50 ms later: end times (relative to the long one's start) and latencies."""
    async with AsyncClient(frontend, timeout=600) as client:
        t0 = time.perf_counter()

        async def timed(coro) -> float:
            await coro
            return time.perf_counter() - t0

        long = asyncio.ensure_future(timed(client.submit(op, {"prompt": prompt, **params})))
        await asyncio.sleep(0.05)
        t_short = time.perf_counter() - t0
        shorts = await asyncio.gather(*(timed(client.generate(p, **SHORT)) for p in CODE_PROMPTS[:4]))
        long_end = await long
    return {"long_s": long_end, "short_latency_s": [end - t_short for end in shorts],
            "short_before_long": sum(end < long_end for end in shorts)}


def behind_long_side_by_side(*, before: str = "96e85e7", rounds: int = 2, echo: Callable[[str], None] = print) -> dict:
    from scripts.load.batching import old_tree

    trees = {"now": None, f"before ({before})": old_tree(before)}
    args = ["--max-seq-len", "512", "--max-lanes", "8"]
    results: dict[str, Any] = {"kinds": list(LONG), "trees": list(trees), "runs": {}}
    with LocalService(1, args) as now, LocalService(1, args, root=Path(trees[f"before ({before})"])) as old:
        services = {"now": now, f"before ({before})": old}
        for kind, (op, params) in LONG.items():
            for i in range(rounds):
                # a long prompt neither tree has cached (the older tree's beam search failed on cached prompts)
                prompt = f"# {kind} {i}\n" + LONG_CODE_PROMPTS[i % len(LONG_CODE_PROMPTS)]
                for tree, svc in services.items():
                    run = asyncio.run(behind_one(svc.frontend, op, params, prompt))
                    results["runs"].setdefault(kind, {}).setdefault(tree, []).append(run)
    echo(f"4 short greedy requests ({SHORT['max_tokens']} tokens) sent right after one long request, 1 worker, "
         f"{rounds} rounds each")
    echo(f"  {'long request':<13} {'tree':<20} {'short before long':>18} {'short p50 s':>12} {'short max s':>12} "
         f"{'long s':>8}")
    for kind, by_tree in results["runs"].items():
        for tree, runs in by_tree.items():
            lat = [x for r in runs for x in r["short_latency_s"]]
            echo(f"  {kind:<13} {tree:<20} {sum(r['short_before_long'] for r in runs):>12} of {4 * len(runs):<3} "
                 f"{statistics.median(lat):>12.2f} {max(lat):>12.2f} {statistics.median(r['long_s'] for r in runs):>8.2f}")
    return results
