"""`tinyloop loadtest --batching`: what continuous batching in the workers buys, side by side in one run.

1. Throughput, closed loop at concurrency 16 with 2 workers, against one in-process `generate_batch` of 16 lanes on
   the same prompts (without prefix caching, the in-process default, and with it, as every worker runs) and against
   the service of an older revision (`--before REV`, default 517ca22: one request at a time per worker), run from
   `git archive REV` in a temporary directory. The runs take turns, best of 2 rounds each.
2. TTFT and TPOT p50/p99 under open-loop (Poisson) load at 50 % and 90 % of the measured capacity, prompts of 16 and
   1024 tokens mixed (3 : 1), with prompts prefilled in chunks (the default 256 tokens) and without (`--prefill-chunk 0`).
3. Mixed depth, in process: 8 prompts at 4 loops and 8 at 16 loops in one `generate_batch` against the two groups one
   after the other (alternating rounds, best of 3).

Every service here starts itself (broker + workers, real model, ipc endpoints). torch is imported only by the
in-process parts.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any, Callable

from broker.launcher import REPO_ROOT, LocalService
from scripts.bench.prompts import CODE_PROMPTS
from scripts.load.loadtest import _load, run_load, summarize


def old_tree(rev: str) -> Path:
    """The repository at `rev`, extracted to a temporary directory (its services run from there)."""
    out = Path(tempfile.mkdtemp(prefix=f"tl-{rev}-"))
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", rev], capture_output=True, check=True).stdout
    tarfile.open(fileobj=BytesIO(archive)).extractall(out)
    return out


def in_process_batches(model, prompts: list, max_tokens: int, lanes: int, threads: int) -> dict:
    """Output tokens per second of generate_batch over the prompts, `lanes` at a time, with `threads` torch threads;
    `tokens`: how many it generated (the services must generate as many)."""
    import torch

    import tinyloop

    torch.set_num_threads(threads)
    cfg = tinyloop.GenerateConfig(max_tokens=max_tokens)
    t, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), lanes):
        tokens += sum(r.stats.generated_tokens for r in tinyloop.generate_batch(model, prompts[i:i + lanes], cfg))
    return {"tok_s": tokens / (time.perf_counter() - t), "tokens": tokens}


def token_prompts(lengths: list[int]) -> list[list[int]]:
    """Token-id prompts of exactly these lengths, cut from the standard library's source (different windows)."""
    from tinyloop.artifact import DEFAULT_ARTIFACT, read_artifact

    codec = read_artifact(DEFAULT_ARTIFACT)[0].codec
    text = Path(os.__file__).read_text() + Path(asyncio.__file__).read_text()
    ids = codec.encode(text)
    out, at = [], 0
    for n in lengths:
        out.append(ids[at:at + n])
        at = (at + 997) % (len(ids) - n)
    return out


def latency_by_class(frontend: str, prompts: list, rate: float, max_tokens: int) -> dict:
    records, elapsed = asyncio.run(_load(frontend, mode="open", concurrency=0, rate=rate, n_requests=len(prompts),
                                         prompts=prompts, max_tokens=max_tokens, op="generate", timeout=600, seed=1,
                                         progress=False))
    out: dict[str, Any] = {"errors": sum(not r["ok"] for r in records), "duration_s": elapsed}
    for name, length in (("short", 16), ("long", 1024)):
        picked = [r for r in records if len(prompts[r["index"]]) == length and r["ok"]]
        for key in ("ttft", "tpot"):
            out[f"{name}_{key}_ms"] = summarize([r[key] * 1000 for r in picked if r[key] is not None])
    return out


def mixed_depth(max_tokens: int, threads: int) -> dict:
    import torch

    import tinyloop

    torch.set_num_threads(threads)
    model = tinyloop.load_model(None, 512)
    G = tinyloop.GenerateConfig
    prompts = CODE_PROMPTS
    cfgs = [G(max_tokens=max_tokens, loops=4 if i % 2 == 0 else 16) for i in range(len(prompts))]
    by_depth = {d: [(p, c) for p, c in zip(prompts, cfgs) if c.loops == d] for d in (4, 16)}
    runs = {
        "mixed": lambda: tinyloop.generate_batch(model, prompts, cfgs),
        "grouped": lambda: [r for group in by_depth.values()
                            for r in tinyloop.generate_batch(model, [p for p, _ in group], [c for _, c in group])],
    }
    tinyloop.generate_batch(model, prompts[:2], G(max_tokens=2))
    best = {k: float("inf") for k in runs}
    tokens = {}
    for _ in range(3):
        for k, fn in runs.items():
            t = time.perf_counter()
            tokens[k] = sum(r.stats.generated_tokens for r in fn())
            best[k] = min(best[k], time.perf_counter() - t)
    tinyloop.free_model(model)
    return {k: {"seconds": best[k], "tokens": tokens[k], "tok_per_s": tokens[k] / best[k]} for k in runs}


def batching_side_by_side(*, before: str = "517ca22", n_requests: int = 64, max_tokens: int = 32, concurrency: int = 16,
                          open_requests: int = 40, parts: str = "123", echo: Callable[[str], None] = print) -> dict:
    """parts: which of the three measurements to run (all by default)."""
    cores = os.cpu_count() or 1
    per_worker = max(1, cores // 2)
    args = ["--max-seq-len", "512", "--threads", str(per_worker)]
    results: dict[str, Any] = {"cores": cores, "load_average": os.getloadavg()}
    if "1" in parts:
        throughput_part(results, before, args, n_requests, max_tokens, concurrency, cores, echo)
    if "2" in parts:
        latency_part(results, per_worker, open_requests, max_tokens, concurrency, echo)
    if "3" in parts:
        echo(f"[3/3] mixed depth, in process: 8 prompts at 4 loops + 8 at 16 loops, {max_tokens} tokens, 1 thread")
        depth = results["mixed_depth"] = mixed_depth(max_tokens, 1)
        echo(f"      one batch: {depth['mixed']['tok_per_s']:.1f} tok/s   two groups one after the other: "
             f"{depth['grouped']['tok_per_s']:.1f} tok/s   ratio {depth['grouped']['seconds'] / depth['mixed']['seconds']:.2f}x")
    return results


def throughput_part(results: dict, before: str, args: list[str], n_requests: int, max_tokens: int, concurrency: int,
                    cores: int, echo: Callable[[str], None], rounds: int = 2) -> None:
    """The services (before and now, both started first) and the in-process batches (2 and 1 threads, without and with
    prefix caching, which every worker runs with) take turns, `rounds` times, and each keeps its best: a load change on
    the machine hits all alike."""
    import torch

    import tinyloop

    echo(f"[1/3] throughput: closed loop, concurrency {concurrency}, 2 workers x {args[-1]} thread(s), "
         f"{n_requests} requests x {max_tokens} tokens; in-process generate_batch of 16 lanes, {cores} and 1 threads, "
         f"best of {rounds} alternating rounds")
    prompts = [CODE_PROMPTS[i % len(CODE_PROMPTS)] for i in range(n_requests)]
    threads = torch.get_num_threads()
    models = {"": tinyloop.load_model(None, 512), " + prefix cache": tinyloop.load_model(None, 512, prefix_caching=True)}
    for model in models.values():  # warm up
        tinyloop.generate_batch(model, prompts[:2], tinyloop.GenerateConfig(max_tokens=2))
    best: dict[str, dict] = {}

    def keep(name: str, r: dict) -> None:
        if name not in best or r["tok_s"] > best[name]["tok_s"]:
            best[name] = r

    with LocalService(2, args, root=old_tree(before)) as old, LocalService(2, args + ["--max-lanes", "16"]) as new:
        for svc in (old, new):
            run_load(svc.frontend, mode="closed", concurrency=2, n_requests=4, max_tokens=2)  # warm up
        for _ in range(rounds):
            for name, svc in ((f"service before ({before})", old), ("service now", new)):
                r = run_load(svc.frontend, mode="closed", concurrency=concurrency, n_requests=n_requests,
                             prompts=CODE_PROMPTS, max_tokens=max_tokens)
                keep(name, {"tok_s": r["output_tokens_per_s"], "tokens": r["output_tokens"]})
            # torch's threads (all cores) and one: on a busy machine spinning threads can cost 10x, so the better counts
            for n in dict.fromkeys((cores, 1)):
                for label, model in models.items():
                    keep(f"generate_batch {n} thread(s){label}", in_process_batches(model, prompts, max_tokens, 16, n))
    torch.set_num_threads(threads)
    for model in models.values():
        tinyloop.free_model(model)
    service, old_tok_s = best["service now"]["tok_s"], best[f"service before ({before})"]["tok_s"]
    plain = {n: best[f"generate_batch {n} thread(s)"]["tok_s"] for n in dict.fromkeys((cores, 1))}
    cached = {n: best[f"generate_batch {n} thread(s) + prefix cache"]["tok_s"] for n in dict.fromkeys((cores, 1))}
    inproc = max(plain.values())
    results["throughput"] = {"before_tok_s": old_tok_s, "service_tok_s": service, "generate_batch_tok_s": inproc,
                             "generate_batch_by_threads": plain, "generate_batch_prefix_cache_by_threads": cached,
                             "runs": best}
    for name, r in best.items():
        echo(f"      {name:<42} {r['tok_s']:>7.1f} tok/s   ({r['tokens']} tokens)")
    # the same work on every side: the same prompts, max_tokens and loops (the model's default) give as many tokens
    if len({r["tokens"] for r in best.values()}) > 1:
        echo("      the sides generated different numbers of tokens: they did not do the same work")
    echo(f"      service now / generate_batch = {service / inproc:.2f}x   "
         f"(/ generate_batch with prefix caching: {service / max(cached.values()):.2f}x)   "
         f"service now / before = {service / old_tok_s:.2f}x")


def latency_part(results: dict, per_worker: int, open_requests: int, max_tokens: int, concurrency: int,
                 echo: Callable[[str], None]) -> None:
    echo(f"[2/3] open loop: prompts of 16 and 1024 tokens (3 : 1), {max_tokens} tokens each, 2 workers, "
         f"{open_requests} requests per run, with and without chunked prefill")
    lengths = [1024 if i % 4 == 3 else 16 for i in range(open_requests)]
    mixed = token_prompts(lengths)
    long_args = ["--max-seq-len", "1152", "--threads", str(per_worker)]
    latency: dict[str, Any] = {}
    for label, chunk in (("chunked 256", "256"), ("whole prompt", "0")):
        with LocalService(2, long_args + ["--prefill-chunk", chunk], startup_timeout=300) as svc:
            if "capacity_req_s" not in results:
                cap = run_load(svc.frontend, mode="closed", concurrency=concurrency, n_requests=open_requests,
                               prompts=mixed, max_tokens=max_tokens)
                results["capacity_req_s"] = cap["request_throughput"]
                echo(f"      capacity (closed loop, concurrency {concurrency}, chunked): {cap['request_throughput']:.2f} req/s")
            for share in (0.5, 0.9):
                r = latency_by_class(svc.frontend, mixed, share * results["capacity_req_s"], max_tokens)
                latency[f"{label} @ {share:.0%}"] = r
                echo(f"      {label:<13} at {share:.0%}: " + "   ".join(
                    f"{cls} TTFT p50/p99 {r[f'{cls}_ttft_ms']['p50']:.0f}/{r[f'{cls}_ttft_ms']['p99']:.0f} ms, "
                    f"TPOT {r[f'{cls}_tpot_ms']['p50']:.1f}/{r[f'{cls}_tpot_ms']['p99']:.1f} ms"
                    for cls in ("short", "long")) + (f"   errors {r['errors']}" if r["errors"] else ""))
    results["latency"] = latency
