"""`tinyloop loadtest`: drive a running service and report latency and throughput.

* closed loop: `concurrency` clients, each sending its next request when the last one ends;
* open loop: requests arrive as a Poisson process at `rate` per second, whether or not
  earlier ones have finished (this is what shows queueing and "busy" replies).

Requests are streamed, so time to first token (TTFT) is measured at the client. Time per
output token (TPOT) is (latency - TTFT) / (tokens - 1). `side_by_side` starts services
itself and puts the numbers that matter for the design next to each other in one run:
broker overhead for a one-token request versus a direct in-process generate, 2 workers
versus 1, and the broker's routing rate when the work is trivial ("ping").
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from typing import Any, Callable

from broker.client import AsyncClient, Client, ServiceError

DEFAULT_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n",
    "    return self.",
    "# Read the configuration file\n",
]


def summarize(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None, "n": 0}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]  # noqa: E731
    return {"mean": statistics.fmean(ordered), "p50": pick(0.5), "p99": pick(0.99), "n": len(ordered)}


async def one_request(client: AsyncClient, op: str, prompt: str, max_tokens: int, timeout: float, index: int = 0) -> dict:
    t0 = time.perf_counter()
    record: dict[str, Any] = {"ok": False, "code": None, "ttft": None, "tpot": None, "latency": None, "tokens": 0,
                              "hit": 0, "prompt_tokens": 0, "worker": None,
                              "index": index}  # records arrive in completion order; index: the request's
    try:
        if op == "ping":
            await client.call("ping", timeout=timeout, payload=prompt)
        else:
            final: list = []
            first = None
            async for _event in client.stream(prompt, op=op, timeout=timeout, max_tokens=max_tokens, result=final):
                if first is None:
                    first = time.perf_counter()
            record["tokens"] = len(final[0].tokens) if final else 0
            if final:  # what the worker's prefix cache saved
                record["hit"] = final[0].stats.get("prefix_hit_tokens") or 0
                record["prompt_tokens"] = final[0].stats.get("prompt_tokens") or 0
                record["worker"] = final[0].worker
            if first is not None:
                record["ttft"] = first - t0
        record["ok"] = True
    except ServiceError as err:
        record["code"] = err.code
    end = time.perf_counter()
    record["latency"] = end - t0
    if record["ok"] and record["ttft"] is not None and record["tokens"] > 1:
        record["tpot"] = (end - t0 - record["ttft"]) / (record["tokens"] - 1)
    return record


async def _load(endpoint: str, *, mode: str, concurrency: int, rate: float, n_requests: int, prompts: list[str],
                max_tokens: int, op: str, timeout: float, seed: int, progress: bool,
                curve_dir: str | None = None) -> tuple[list[dict], float]:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n_requests, unit="req", desc=f"loadtest {mode}", leave=False)
    records: list[dict] = []

    def done(record: dict) -> None:
        records.append(record)
        if bar is not None:
            bar.update(1)

    async with AsyncClient(endpoint, timeout=timeout, curve_dir=curve_dir) as client:
        t0 = time.perf_counter()
        if mode == "closed":
            next_index = iter(range(n_requests))

            async def user() -> None:
                for i in next_index:
                    done(await one_request(client, op, prompts[i % len(prompts)], max_tokens, timeout))

            await asyncio.gather(*(user() for _ in range(min(concurrency, n_requests))))
        elif mode == "open":
            rng = random.Random(seed)
            tasks = []
            start = time.perf_counter()
            arrival = 0.0
            for i in range(n_requests):
                arrival += rng.expovariate(rate)
                delay = start + arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.ensure_future(one_request(client, op, prompts[i % len(prompts)], max_tokens, timeout, i))
                task.add_done_callback(lambda t: done(t.result()))
                tasks.append(task)
            await asyncio.gather(*tasks)
        else:
            raise ValueError(f"mode must be 'closed' or 'open', got {mode!r}")
        elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return records, elapsed


def run_load(endpoint: str, *, mode: str = "closed", concurrency: int = 4, rate: float = 2.0, n_requests: int = 32,
             prompts: list[str] | None = None, max_tokens: int = 16, op: str = "generate", timeout: float = 120.0,
             seed: int = 0, progress: bool = False, curve_dir: str | None = None) -> dict:
    """Run one load and return its summary (all times in milliseconds)."""
    records, elapsed = asyncio.run(_load(endpoint, mode=mode, concurrency=concurrency, rate=rate, n_requests=n_requests,
                                         prompts=prompts or DEFAULT_PROMPTS, max_tokens=max_tokens, op=op,
                                         timeout=timeout, seed=seed, progress=progress, curve_dir=curve_dir))
    ok = [r for r in records if r["ok"]]
    errors: dict[str, int] = {}
    for r in records:
        if not r["ok"]:
            errors[r["code"]] = errors.get(r["code"], 0) + 1
    ms = lambda key: summarize([r[key] * 1000 for r in ok if r[key] is not None])  # noqa: E731
    tokens = sum(r["tokens"] for r in ok)
    return {
        "mode": mode, "op": op, "concurrency": concurrency if mode == "closed" else None,
        "rate": rate if mode == "open" else None, "requests": len(records), "ok": len(ok), "errors": errors,
        "max_tokens": max_tokens, "duration_s": elapsed, "request_throughput": len(ok) / elapsed if elapsed else 0.0,
        "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed if elapsed else 0.0,
        "ttft_ms": ms("ttft"), "tpot_ms": ms("tpot"), "latency_ms": ms("latency"),
        "requests_hit": sum(1 for r in ok if r["hit"]) / len(ok) if ok else 0.0,
        "prompt_tokens_hit": sum(r["hit"] for r in ok) / max(1, sum(r["prompt_tokens"] for r in ok)),
    }


def _fmt(stat: dict) -> str:
    if not stat.get("n"):
        return "-"
    return f"mean {stat['mean']:.1f}  p50 {stat['p50']:.1f}  p99 {stat['p99']:.1f}"


def format_summary(r: dict) -> str:
    head = f"{r['mode']} loop" + (f", concurrency {r['concurrency']}" if r["mode"] == "closed" else f", {r['rate']} req/s")
    return "\n".join([
        f"{head}, op {r['op']}: {r['ok']}/{r['requests']} ok in {r['duration_s']:.2f}s"
        + (f", errors {r['errors']}" if r["errors"] else ""),
        f"  request throughput   {r['request_throughput']:.2f} req/s",
        f"  output tokens        {r['output_tokens_per_s']:.1f} tok/s",
        f"  time to first token  {_fmt(r['ttft_ms'])} ms",
        f"  time per out token   {_fmt(r['tpot_ms'])} ms",
        f"  end-to-end latency   {_fmt(r['latency_ms'])} ms",
    ])


# ------------------------------------------------------------------------------ side by side


def interleaved(model_path: str | None, frontend: str, prompt: str, reps: int, threads: int, max_tokens: int = 1,
                loops: int | None = None) -> tuple[list, list]:
    """(wall s, decode ms) of each request: in-process generate versus through the broker, interleaved
    (direct, broker, direct, ...) so that both see the same machine load."""
    import torch

    import tinyloop

    torch.set_num_threads(threads)
    model = tinyloop.load_model(model_path, 512)
    cfg = tinyloop.GenerateConfig(max_tokens=max_tokens, loops=loops)
    params = {"max_tokens": max_tokens, **({"loops": loops} if loops else {})}
    direct, brokered = [], []
    try:
        with Client(frontend, timeout=120) as client:
            for i in range(reps + 3):  # the first 3 rounds warm both paths up
                t0 = time.perf_counter()
                result = tinyloop.generate(model, prompt, cfg)
                t1 = time.perf_counter()
                reply = client.generate(prompt, **params)
                t2 = time.perf_counter()
                if i >= 3:
                    direct.append((t1 - t0, result.stats.decode_ms))
                    brokered.append((t2 - t1, reply.stats["decode_ms"]))
    finally:
        tinyloop.free_model(model)
    return direct, brokered


def decode_side_by_side(*, model_path: str | None = None, reps: int = 10, max_tokens: int = 64, loops: int = 8,
                        threads: int | None = None, root: str | None = None,
                        echo: Callable[[str], None] = print) -> dict:
    """Batch-1 decode of one request through a 1-worker service against the same generate in process, with the
    same torch threads (default: all cores), interleaved. The ratio of the medians of the engines' decode_ms is the
    worker's own cost (threads, I/O), without the broker's round trip. root: the tree whose service runs."""
    from broker.launcher import REPO_ROOT, LocalService, physical_cores

    threads = threads or physical_cores()
    args = ["--max-seq-len", "512", "--max-handles", "0", "--threads", str(threads)]
    args += ["--model", model_path] if model_path else []
    load_before = os.getloadavg()
    with LocalService(1, args, root=root or REPO_ROOT) as svc:
        direct, brokered = interleaved(model_path, svc.frontend, DEFAULT_PROMPTS[0], reps, threads, max_tokens, loops)
    d = summarize([ms for _, ms in direct])
    b = summarize([ms for _, ms in brokered])
    ratio = b["p50"] / d["p50"]
    echo(f"      {max_tokens} tokens at {loops} loops, {threads} threads: decode p50 in process {d['p50']:.0f} ms, "
         f"worker {b['p50']:.0f} ms ({ratio:.2f}x); load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    return {"threads": threads, "max_tokens": max_tokens, "loops": loops, "direct_decode_ms": d,
            "worker_decode_ms": b, "ratio_p50": ratio, "load_average": [load_before, os.getloadavg()]}


def side_by_side(*, model_path: str | None = None, n_requests: int = 32, max_tokens: int = 16, concurrency: int = 4,
                 threads: int | None = None, echo: Callable[[str], None] = print) -> dict:
    """threads: torch threads per model (default: all cores for one model, cores / 2 for each of two)."""
    from broker.launcher import LocalService

    from broker.launcher import physical_cores

    cores = physical_cores()
    base_args = ["--max-seq-len", "512", "--max-handles", "0"] + (["--model", model_path] if model_path else [])
    prompt = DEFAULT_PROMPTS[0]
    reps = max(10, n_requests)
    results: dict[str, Any] = {"cores": cores, "threads": threads, "load_average": os.getloadavg()}
    per_model = lambda n: threads or max(1, cores // n)  # noqa: E731

    echo(f"[1/4] one-token request: direct generate vs through the broker ({reps} sequential requests each)")
    with LocalService(1, base_args + ["--threads", str(per_model(1))]) as svc:
        direct, brokered = interleaved(model_path, svc.frontend, prompt, reps, per_model(1))
    d, b = summarize([t * 1000 for t, _ in direct]), summarize([t * 1000 for t, _ in brokered])
    results["one_token"] = {"direct_ms": d, "broker_ms": b, "overhead_ms_p50": b["p50"] - d["p50"],
                            "ratio_p50": b["p50"] / d["p50"]}
    echo(f"      direct  p50 {d['p50']:.2f} ms   broker p50 {b['p50']:.2f} ms   "
         f"overhead {b['p50'] - d['p50']:.2f} ms ({b['p50'] / d['p50']:.2f}x)")

    echo("[2/4] batch-1 decode: in-process generate vs the same request through a 1-worker service")
    results["decode"] = decode_side_by_side(model_path=model_path, reps=max(5, n_requests // 4),
                                            threads=per_model(1), echo=echo)

    echo(f"[3/4] throughput, closed loop, concurrency {concurrency}, {n_requests} requests x {max_tokens} tokens: 1 vs 2 workers")
    throughput = {}
    for n in (1, 2):
        with LocalService(n, base_args + ["--threads", str(per_model(n))]) as svc:
            run_load(svc.frontend, mode="closed", concurrency=n, n_requests=2 * n, max_tokens=2)  # warm up
            throughput[n] = run_load(svc.frontend, mode="closed", concurrency=concurrency, n_requests=n_requests,
                                     max_tokens=max_tokens)
        echo(f"      {n} worker(s): {throughput[n]['request_throughput']:.2f} req/s, "
             f"{throughput[n]['output_tokens_per_s']:.1f} tok/s, latency p50 {throughput[n]['latency_ms']['p50']:.0f} ms")
    results["throughput"] = {"1_worker": throughput[1], "2_workers": throughput[2],
                             "ratio_2_vs_1": throughput[2]["output_tokens_per_s"] / max(throughput[1]["output_tokens_per_s"], 1e-9)}
    echo(f"      2 workers / 1 worker: {results['throughput']['ratio_2_vs_1']:.2f}x tokens/s on {cores} cores")

    pings = max(2000, n_requests)
    echo(f"[4/4] routing rate: {pings} 'ping' requests (no model work), closed loop, concurrency 32, 2 workers")
    with LocalService(2, base_args + ["--threads", "1"]) as svc:
        run_load(svc.frontend, mode="closed", concurrency=8, n_requests=100, op="ping")  # warm up
        routing = run_load(svc.frontend, mode="closed", concurrency=32, n_requests=pings, op="ping")
    results["routing"] = routing
    echo(f"      {routing['request_throughput']:.0f} req/s routed, latency p50 {routing['latency_ms']['p50']:.2f} ms, "
         f"p99 {routing['latency_ms']['p99']:.2f} ms")
    return results


def prefix_routing_side_by_side(*, model_path: str | None = None, n_suffixes: int = 16, max_tokens: int = 8,
                                concurrency: int = 4, threads: int = 1, echo: Callable[[str], None] = print) -> dict:
    """2 workers, 4 scaffolds x n_suffixes prompts (scripts.bench.reuse.prefix_workload, shuffled), closed loop: the
    broker with cache-aware routing versus without, one service after the other on the same requests. Each worker's
    block pool (--max-seq-len 512, no handles) holds about two scaffolds at 8 loops, so where the scaffolds go
    decides how often a prompt finds its prefix cached."""
    from broker.launcher import LocalService
    from scripts.bench.reuse import prefix_workload

    _, workload = prefix_workload(n_suffixes)
    prompts = [p for _, p in workload]
    args = ["--max-seq-len", "512", "--max-handles", "0", "--threads", str(threads)]
    args += ["--model", model_path] if model_path else []
    results: dict[str, Any] = {"load_average": os.getloadavg(), "requests": len(prompts), "concurrency": concurrency}
    echo(f"prefix routing: 2 workers, 4 scaffolds x {n_suffixes} suffixes, closed loop, concurrency {concurrency}, "
         f"{max_tokens} tokens each")
    for name, broker_args in (("affinity", []), ("no_affinity", ["--no-affinity"])):
        with LocalService(2, args, broker_args=broker_args) as svc:
            run_load(svc.frontend, mode="closed", concurrency=2, n_requests=2, max_tokens=2)  # warm up
            r = results[name] = run_load(svc.frontend, mode="closed", concurrency=concurrency, n_requests=len(prompts),
                                         prompts=prompts, max_tokens=max_tokens)
        echo(f"  {name:<12} requests hit {r['requests_hit']:>4.0%}, prompt tokens hit {r['prompt_tokens_hit']:>4.0%}, "
             f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms p99 {r['ttft_ms']['p99']:.0f} ms, "
             f"{r['request_throughput']:.2f} req/s, errors {sum(r['errors'].values())}")
    a, b = results["affinity"], results["no_affinity"]
    results["ttft_p50_ratio"] = b["ttft_ms"]["p50"] / a["ttft_ms"]["p50"]
    results["throughput_ratio"] = a["request_throughput"] / b["request_throughput"]
    echo(f"  affinity / without: {results['throughput_ratio']:.2f}x req/s, TTFT p50 {results['ttft_p50_ratio']:.2f}x lower")
    return results


# ------------------------------------------------------------------------------ soak


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def slope_per_1000(points: list[tuple[int, int]]) -> float:
    """Least-squares growth of bytes per 1,000 requests over (requests done, bytes) points."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def soak(*, n_requests: int = 10_000, every: int = 1000, max_tokens: int = 4, concurrency: int = 4, workers: int = 2,
         model_path: str | None = None, threads: int | None = None, echo: Callable[[str], None] = print) -> dict:
    """Memory of the broker and each worker over n_requests (closed loop), sampled every `every` requests.

    Growth is the least-squares slope over the samples after the first batch (which includes warm-up:
    allocator pools, compiled kernels, the broker's bounded reply cache filling), in MiB per 1,000 requests."""
    from broker.launcher import LocalService

    from broker.launcher import threads_per_worker

    args = ["--max-seq-len", "256", "--threads", str(threads or threads_per_worker(workers))]
    args += ["--model", model_path] if model_path else []
    samples: list[dict] = []
    with LocalService(workers, args) as svc:
        pids = {"broker": svc.broker.pid, **{name: proc.pid for name, proc in svc.workers.items()}}
        done, errors = 0, 0
        echo(f"soak: {n_requests} requests x {max_tokens} tokens, concurrency {concurrency}, {workers} workers; "
             f"memory (RSS, MiB) every {every} requests")
        echo("  requests  " + "  ".join(f"{name:>8}" for name in pids))
        while done < n_requests:
            batch = min(every, n_requests - done)
            result = run_load(svc.frontend, mode="closed", concurrency=concurrency, n_requests=batch,
                              max_tokens=max_tokens, seed=done)
            done += batch
            errors += batch - result["ok"]
            sample = {"requests": done, **{name: rss_bytes(pid) for name, pid in pids.items()}}
            samples.append(sample)
            echo(f"  {done:>8}  " + "  ".join(f"{sample[name] / 2**20:>8.1f}" for name in pids))
    steady = samples[1:] if len(samples) > 2 else samples
    late = samples[len(samples) // 2:]  # a leak keeps growing here; warm-up has levelled off
    growth = {name: slope_per_1000([(s["requests"], s[name]) for s in steady]) / 2**20 for name in pids}
    late_growth = {name: slope_per_1000([(s["requests"], s[name]) for s in late]) / 2**20 for name in pids}
    echo("growth per 1,000 requests (after the first batch): "
         + ", ".join(f"{name} {mib:+.3f} MiB" for name, mib in growth.items()) + f"; errors {errors}")
    echo(f"growth per 1,000 requests (second half, from {late[0]['requests']}): "
         + ", ".join(f"{name} {mib:+.3f} MiB" for name, mib in late_growth.items()))
    return {"requests": n_requests, "every": every, "max_tokens": max_tokens, "concurrency": concurrency,
            "samples": samples, "growth_mib_per_1000": growth, "late_growth_mib_per_1000": late_growth,
            "errors": errors}
