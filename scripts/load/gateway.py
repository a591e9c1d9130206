"""The same workload through the HTTP gateway and through the msgpack client, side by side in one run.

`tinyloop gateway-loadtest` starts one service (broker + workers, broker/launcher.py) and one
gateway in front of it, then alternates rounds of the same closed-loop load (streamed
completions, greedy, same prompts) between the two paths, so both see the same machine load.
It reports req/s, tok/s and p50/p99 of TTFT and latency for each, and their ratio.
Imports no torch.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable

import httpx

from broker import launcher
from broker.client import AsyncClient, ServiceError
from scripts.load.loadtest import DEFAULT_PROMPTS, summarize


async def msgpack_request(client: AsyncClient, prompt: str, max_tokens: int) -> dict:
    t0, first, final = time.perf_counter(), None, []
    try:
        async for _event in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, result=final, timeout=120):
            first = first or time.perf_counter()
    except ServiceError as err:
        return {"ok": False, "code": err.code}
    end = time.perf_counter()
    return {"ok": True, "ttft": (first or end) - t0, "latency": end - t0, "tokens": len(final[0].tokens)}


async def http_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return {"ok": False, "code": resp.status_code}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                first = first or time.perf_counter()
    end = time.perf_counter()
    return {"ok": True, "ttft": (first or end) - t0, "latency": end - t0, "tokens": tokens}


async def closed_loop(send: Callable[[str], Any], n_requests: int, concurrency: int) -> tuple[list[dict], float]:
    work = iter(range(n_requests))
    records: list[dict] = []

    async def user() -> None:
        for i in work:
            records.append(await send(DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]))

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    return records, time.perf_counter() - t0


def summary(records: list[dict], elapsed: float) -> dict:
    ok = [r for r in records if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(records), "ok": len(ok), "duration_s": elapsed, "req_per_s": len(ok) / elapsed,
            "tok_per_s": tokens / elapsed, "ttft_ms": summarize([r["ttft"] * 1000 for r in ok]),
            "latency_ms": summarize([r["latency"] * 1000 for r in ok])}


async def compare(frontend: str, url: str, *, rounds: int, n_requests: int, concurrency: int,
                  max_tokens: int) -> dict:
    paths: dict[str, list] = {"msgpack": [], "http": []}
    times = {"msgpack": 0.0, "http": 0.0}
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with AsyncClient(frontend, timeout=120) as mp, httpx.AsyncClient(timeout=120, limits=limits) as hc:
        senders = {"msgpack": lambda p: msgpack_request(mp, p, max_tokens),
                   "http": lambda p: http_request(hc, url, p, max_tokens)}
        for name in senders:  # warm both paths up
            await closed_loop(senders[name], concurrency, concurrency)
        for r in range(rounds):  # alternate, so both paths see the same load over the run
            for name in (("msgpack", "http") if r % 2 == 0 else ("http", "msgpack")):
                records, elapsed = await closed_loop(senders[name], n_requests, concurrency)
                paths[name] += records
                times[name] += elapsed
    return {name: summary(paths[name], times[name]) for name in paths}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gateway_side_by_side(*, workers: int = 2, threads: int | None = None, rounds: int = 4, n_requests: int = 16,
                         concurrency: int = 4, max_tokens: int = 16, model_path: str | None = None,
                         echo: Callable[[str], None] = print) -> dict:
    threads = threads or max(1, (os.cpu_count() or 1) // workers)
    args = ["--max-seq-len", "512", "--max-handles", "0", "--threads", str(threads)]
    args += ["--model", model_path] if model_path else []
    with launcher.LocalService(workers, args) as svc:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        gateway = subprocess.Popen([sys.executable, "-m", "scripts.gateway_cli", "--connect", svc.frontend,
                                    "--port", str(port), "--log-level", "warning"], env=launcher.child_env(),
                                   cwd=str(launcher.REPO_ROOT), start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("the gateway did not become healthy within 60 s")
                time.sleep(0.2)
            echo(f"{workers} workers x {threads} thread(s); {rounds} alternating rounds per path of {n_requests} "
                 f"streamed greedy requests x {max_tokens} tokens, closed loop, concurrency {concurrency}")
            results = asyncio.run(compare(svc.frontend, url, rounds=rounds, n_requests=n_requests,
                                          concurrency=concurrency, max_tokens=max_tokens))
        finally:
            gateway.send_signal(signal.SIGTERM)
            gateway.wait(30)
    for name, r in results.items():
        echo(f"  {name:<8} {r['ok']}/{r['requests']} ok  {r['req_per_s']:.2f} req/s  {r['tok_per_s']:.1f} tok/s  "
             f"TTFT p50 {r['ttft_ms']['p50']:.1f} p99 {r['ttft_ms']['p99']:.1f} ms  "
             f"latency p50 {r['latency_ms']['p50']:.1f} p99 {r['latency_ms']['p99']:.1f} ms")
    m, h = results["msgpack"], results["http"]
    results["ratio_http_vs_msgpack"] = {"req_per_s": h["req_per_s"] / m["req_per_s"],
                                        "latency_p50": h["latency_ms"]["p50"] / m["latency_ms"]["p50"]}
    echo(f"  HTTP / msgpack: {results['ratio_http_vs_msgpack']['req_per_s']:.3f}x req/s, "
         f"{results['ratio_http_vs_msgpack']['latency_p50']:.3f}x latency p50 "
         f"(load average {os.getloadavg()[0]:.1f})")
    results["load_average"] = os.getloadavg()
    return results
