"""`tinyloop loadtest --elastic` (and `tinyloop bench --section elastic`): elastic depth under open-loop load.

For a 1-worker and a 2-worker service (broker + workers on loopback ipc, the bundled model, or --model), started with
latency targets (--tpot-slo, --ttft-slo: elastic depth's controller, docs/engine.md):
  1. the fixed-depth capacity: closed loop at the service's lanes, requests at `loops` (16) with no floor;
  2. open-loop Poisson arrivals at 0.5x, 1x, 1.5x and 2x that capacity, the same arrivals and prompts twice, side by
     side: fixed depth (no floor: the controller never touches them) and elastic (min_loops `floor`, 4);
each printing TTFT and TPOT p50 / p99, goodput (requests meeting both targets per second), the mean loops of the
generated tokens, the estimated loss increase (the model's loss-by-loops table), and at 0.5x whether the elastic
run's tokens are identical to fixed depth's (no depth given up when it is not needed).

The targets default to what fixed depth meets at half its capacity, with a margin (TPOT: 1.25x its p99; TTFT: 2x its
p99, at least 4x an unloaded request's latency; the worse of two runs, one with the measured loads' arrivals), measured on a service without targets before
the runs, so the
figure means the same on a fast and a slow machine. Request loops are bounded (`loops`, `floor`),
every service listens on loopback (ipc) only.
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Callable

from broker.client import AsyncClient, ServiceError
from broker.launcher import LocalService
from scripts.load.loadtest import DEFAULT_PROMPTS, summarize

LOADS = (0.5, 1.0, 1.5, 2.0)
ARRIVALS_SEED = 7  # the Poisson arrivals of every measured load (the same for fixed and elastic)


async def elastic_request(client: AsyncClient, prompt: str, params: dict, timeout: float, index: int) -> dict:
    """One streamed request: TTFT, TPOT, its tokens and depth stats."""
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"index": index, "ok": False, "ttft": None, "tpot": None, "tokens": [], "stats": {}}
    try:
        final: list = []
        first = None
        async for _ in client.stream(prompt, timeout=timeout, result=final, **params):
            if first is None:
                first = time.perf_counter()
        rec["ok"], rec["tokens"] = bool(final), list(final[0].tokens) if final else []
        rec["stats"] = final[0].stats if final else {}
        end = time.perf_counter()
        rec["ttft"] = (first or end) - t0
        if len(rec["tokens"]) > 1:
            rec["tpot"] = (end - t0 - rec["ttft"]) / (len(rec["tokens"]) - 1)
    except ServiceError as err:
        rec["code"] = err.code
    return rec


async def open_loop(frontend: str, rate: float, n: int, params: dict, seed: int, timeout: float,
                    closed: int = 0) -> tuple[list[dict], float]:
    """n requests: Poisson arrivals at `rate` per second (seeded: the same arrivals for both runs of a load), or, with
    `closed`, that many clients back to back."""
    async with AsyncClient(frontend, timeout=timeout) as client:
        t0 = time.perf_counter()
        if closed:
            todo = iter(range(n))

            async def user() -> list[dict]:
                return [await elastic_request(client, DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)], params, timeout, i)
                        for i in todo]

            records = [r for rs in await asyncio.gather(*(user() for _ in range(closed))) for r in rs]
        else:
            rng, tasks, at = random.Random(seed), [], 0.0
            for i in range(n):
                at += rng.expovariate(rate)
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(
                    elastic_request(client, DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)], params, timeout, i)))
            records = list(await asyncio.gather(*tasks))
        return records, time.perf_counter() - t0


def figures(records: list[dict], seconds: float, tpot_slo: float, ttft_slo: float) -> dict:
    ok = [r for r in records if r["ok"]]
    good = [r for r in ok if r["ttft"] <= ttft_slo and (r["tpot"] is None or r["tpot"] <= tpot_slo)]
    tokens = sum(len(r["tokens"]) for r in ok)
    loops = sum((r["stats"].get("loops_mean") or 0) * len(r["tokens"]) for r in ok)
    loss = sum((r["stats"].get("loss_increase") or 0) * len(r["tokens"]) for r in ok)
    below = sum(r["stats"].get("tokens_below_loops") or 0 for r in ok)
    errors: dict[str, int] = {}  # the final answers that were errors, by code (the broker's "busy": its queue full)
    for r in records:
        if not r["ok"]:
            errors[str(r.get("code"))] = errors.get(str(r.get("code")), 0) + 1
    return {"requests": len(records), "ok": len(ok), "errors": errors, "seconds": seconds,
            "goodput": len(good) / seconds,
            "ttft_ms": summarize([r["ttft"] * 1000 for r in ok]),
            "tpot_ms": summarize([r["tpot"] * 1000 for r in ok if r["tpot"] is not None]),
            "loops_mean": loops / tokens if tokens else 0.0, "loss_increase": loss / tokens if tokens else 0.0,
            "below": below / tokens if tokens else 0.0, "tokens": {r["index"]: r["tokens"] for r in ok}}


def line(name: str, f: dict) -> str:
    t, p = f["ttft_ms"], f["tpot_ms"]
    ms = lambda s, k: f"{s[k]:7.1f}" if s.get(k) is not None else "      -"  # noqa: E731
    return (f"    {name:<8} TTFT p50 {ms(t, 'p50')} p99 {ms(t, 'p99')} ms  TPOT p50 {ms(p, 'p50')} p99 {ms(p, 'p99')} ms"
            f"  goodput {f['goodput']:5.2f} req/s  loops {f['loops_mean']:5.2f}  below {f['below']:4.0%}"
            f"  loss +{f['loss_increase']:.4f}  ({f['ok']}/{f['requests']} ok"
            + "".join(f", {n} {code}" for code, n in f["errors"].items()) + ")")


def elastic_side_by_side(*, model_path: str | None = None, workers: tuple[int, ...] = (1, 2), loads=LOADS,
                         n_requests: int = 160, max_tokens: int = 16, loops: int = 16, floor: int = 4,
                         lanes: int = 16, threads: int | None = None, tpot_slo: float | None = None,
                         ttft_slo: float | None = None, echo: Callable[[str], None] = print) -> dict:
    """The side-by-side figures above; returns them (without the tokens) by worker count and load. lanes: each
    worker's --max-lanes, by default a worker's default (16): a worker at fewer loops per token runs more lanes' steps
    a second, and its lanes are what it can batch."""
    out: dict = {"loops": loops, "floor": floor, "max_tokens": max_tokens, "requests": n_requests, "runs": {}}
    fixed_p = {"max_tokens": max_tokens, "loops": loops, "temperature": 0.0}
    elastic_p = {**fixed_p, "min_loops": floor}
    for n_workers in workers:
        base = ["--max-seq-len", "256", "--max-lanes", str(lanes), "--threads", str(threads or 1)]
        base += ["--model", model_path] if model_path else []
        # calibrate on a service without targets: an unloaded request, then the fixed-depth capacity
        with LocalService(n_workers=n_workers, worker_args=base) as svc:
            asyncio.run(open_loop(svc.frontend, 0, 2, fixed_p, 0, 600, closed=1))  # warm up
            alone, _ = asyncio.run(open_loop(svc.frontend, 0, 3, fixed_p, 0, 600, closed=1))
            records, seconds = asyncio.run(open_loop(svc.frontend, 0, n_requests, fixed_p, 0, 600,
                                                     closed=lanes * n_workers))
            capacity = len(records) / seconds
            # the targets: what fixed depth meets at half its capacity, with a margin (so at 0.5x no depth is needed),
            # in the worse of two runs (one run's p99 swings by tens of percent on a shared machine), one of them with
            # the arrivals the measured loads use (ARRIVALS_SEED: a burst of them is what the 0.5x run meets)
            halves = [asyncio.run(open_loop(svc.frontend, capacity / 2, n_requests, fixed_p, seed, 600))[0]
                      for seed in (ARRIVALS_SEED, 3)]
        unloaded = min(r["ttft"] + (r["tpot"] or 0) * (len(r["tokens"]) - 1) for r in alone)
        tpot = tpot_slo or 1.25 * max(summarize([r["tpot"] for r in h if r["tpot"]])["p99"] for h in halves)
        ttft = ttft_slo or max(4 * unloaded, 2 * max(summarize([r["ttft"] for r in h])["p99"] for h in halves))
        echo(f"  {n_workers} worker(s), {lanes} lanes each, threads {threads or 1}: fixed-depth capacity "
             f"{capacity:.2f} req/s ({loops} loops, {max_tokens} tokens); targets TPOT {tpot * 1000:.1f} ms, "
             f"TTFT {ttft * 1000:.0f} ms")
        run_out: dict = {"capacity": capacity, "tpot_slo": tpot, "ttft_slo": ttft, "loads": {}}
        args = base + ["--tpot-slo", f"{tpot}", "--ttft-slo", f"{ttft}"]
        with LocalService(n_workers=n_workers, worker_args=args) as svc:
            asyncio.run(open_loop(svc.frontend, 0, 2, fixed_p, 0, 600, closed=1))  # warm up
            for x in loads:
                rate = x * capacity
                echo(f"   load {x:.1f}x ({rate:.2f} req/s, {n_requests} requests, Poisson):")
                pair = {}
                for name, params in (("fixed", fixed_p), ("elastic", elastic_p)):
                    records, seconds = asyncio.run(open_loop(svc.frontend, rate, n_requests, params, ARRIVALS_SEED,
                                                             600))
                    pair[name] = figures(records, seconds, tpot, ttft)
                    echo(line(name, pair[name]))
                same = pair["fixed"]["tokens"] == pair["elastic"]["tokens"]
                ratio = pair["elastic"]["goodput"] / pair["fixed"]["goodput"] if pair["fixed"]["goodput"] else None
                echo(f"    elastic/fixed goodput {f'{ratio:.2f}x' if ratio is not None else '-'}"
                     + (f"; tokens identical to fixed depth: {'yes' if same else 'NO'}" if x == 0.5 else ""))
                run_out["loads"][str(x)] = {k: {kk: vv for kk, vv in v.items() if kk != "tokens"}
                                            for k, v in pair.items()} | {"identical": same, "goodput_ratio": ratio}
        out["runs"][str(n_workers)] = run_out
    return out
