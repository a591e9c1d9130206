"""`tinyloop loadtest --kv-routing`: what a cluster router gains from TinyLoop's KV-cache events, side by side in one
run (docs/deploy.md, "Routed by llm-d / the Inference Extension / Dynamo").

Two 1-worker services stand for two replica pods. Each worker publishes its KV-cache events; a router in this process
subscribes to both, keeps which blocks each replica holds, and weighs, as llm-d's defaults do, 3 x the share of the
prompt's leading blocks a replica holds (its precise prefix-cache scorer) against 2 x how short its queue is (its
queue scorer). Against it, on fresh services, the same prompts in the same order go round robin: what such a cluster
does when the engines publish nothing. The workload is 8 long shared prefixes (~330 tokens) x 8 short suffixes,
shuffled; each worker's block pool holds about five of the prefixes, so where a prompt goes decides whether its prefix
is cached there.

The events' cost: a third pair of services runs round robin with the events off, so the throughput of round robin with
and without them can be compared; and the work the events add to a worker (hashing each block, queueing the event,
packing and sending the batch) is timed in this process per event, which with the events per second gives the share of
a worker's time they take.
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
import time
from typing import Any, Callable

import msgpack
import zmq

from broker.client import AsyncClient
from scripts.load.loadtest import one_request, summarize
from workers.kv_events import prompt_block_hashes

LANES = 2  # requests a worker batches at once
NAMES = ["Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel"]
SUFFIXES = ["def task_{j}(x):\n    return x * {j}", "print({j})", "x_{j} = [{j}, {j}]", "class C{j}:\n    pass",
            "import os  # {j}", "\n# step {j}", "    return {j}", "value: int = {j}"]


def workload(codec_encode: Callable[[str], list[int]], seed: int = 0) -> list[tuple[int, list[int]]]:
    """(prefix index, prompt token ids): 8 prefixes x 8 suffixes in a shuffled order."""
    from scripts.bench.reuse import SCAFFOLD

    prefixes = [f"{name} project conventions.\n" + SCAFFOLD * 3 for name in NAMES]
    prompts = [(i, codec_encode(p + s.format(j=j))) for i, p in enumerate(prefixes) for j, s in enumerate(SUFFIXES)]
    random.Random(seed).shuffle(prompts)
    return prompts


class EventRouter:
    """A prefix-aware router fed by the replicas' KV-cache events (vLLM's wire format, decoded here as any router
    would: msgpack positional arrays). Blocks are matched by the hashes the events carry and the router computes
    from the prompt, as llm-d does."""

    def __init__(self, endpoints: list[str], block_size: int, lanes: int):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        for endpoint in endpoints:
            self.sub.connect(endpoint)
        self.block_size, self.lanes = block_size, lanes  # a replica's requests beyond its lanes wait in its queue
        self.held: dict[bytes, set[int]] = {}  # topic -> block hashes the replica holds
        self.events = 0
        self.inflight = [0] * len(endpoints)
        self.topics = [f"kv@r{i}@default".encode() for i in range(len(endpoints))]

    def drain(self) -> None:
        while self.sub.poll(0):
            topic, _seq, payload = self.sub.recv_multipart()
            held = self.held.setdefault(topic, set())
            for event in msgpack.unpackb(payload)[1]:
                self.events += 1
                if event[0] == "BlockStored":
                    held.update(event[1])
                elif event[0] == "BlockRemoved":
                    held.difference_update(event[1])
                elif event[0] == "AllBlocksCleared":
                    held.clear()

    def pick(self, ids: list[int]) -> int:
        """llm-d's default weighing: 3 x the share of the prompt's blocks a replica holds (precise prefix-cache
        scorer) + 2 x its queue score (1 for the shortest queue, 0 for the longest); ties to the less busy one."""
        self.drain()
        hashes = prompt_block_hashes(ids, self.block_size)
        prefix = []
        for topic in self.topics:
            held, n = self.held.get(topic, set()), 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            prefix.append(n / max(1, len(hashes)))
        waiting = [max(0, n - self.lanes) for n in self.inflight]
        spread = max(waiting) - min(waiting)
        queue = [1.0 if not spread else (max(waiting) - w) / spread for w in waiting]
        score = [3 * p + 2 * q for p, q in zip(prefix, queue)]
        return max(range(len(score)), key=lambda r: (score[r], -self.inflight[r], -r))

    def close(self) -> None:
        self.ctx.destroy(linger=0)


async def run_arm(frontends: list[str], prompts: list[tuple[int, list[int]]], router: EventRouter | None,
                  concurrency: int, max_tokens: int) -> dict:
    """Closed loop over the prompts; each goes to the router's pick (round robin without one)."""
    clients = [AsyncClient(f, timeout=300) for f in frontends]
    for c in clients:
        await c.__aenter__()
    records: list[dict] = []
    turn = iter(range(len(prompts)))
    rr = [0]

    async def user() -> None:
        for i in turn:
            ids = prompts[i][1]
            if router is not None:
                replica = router.pick(ids)
            else:
                replica, rr[0] = rr[0] % len(clients), rr[0] + 1
            if router is not None:
                router.inflight[replica] += 1
            try:
                record = await one_request(clients[replica], "generate", ids, max_tokens, 300)
            finally:
                if router is not None:
                    router.inflight[replica] -= 1
            record["replica"] = replica
            records.append(record)

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    elapsed = time.perf_counter() - t0
    for c in clients:
        await c.__aexit__(None, None, None)
    ok = [r for r in records if r["ok"]]
    return {"requests": len(records), "ok": len(ok), "duration_s": elapsed,
            "request_throughput": len(ok) / elapsed,
            "output_tokens_per_s": sum(r["tokens"] for r in ok) / elapsed,
            "requests_hit": sum(1 for r in ok if r["hit"]) / max(1, len(ok)),
            "prompt_tokens_hit": sum(r["hit"] for r in ok) / max(1, sum(r["prompt_tokens"] for r in ok)),
            "ttft_ms": summarize([r["ttft"] * 1000 for r in ok if r["ttft"] is not None]),
            "per_replica": [sum(1 for r in ok if r["replica"] == k) for k in range(len(frontends))]}


def event_cost_us(block_size: int, n: int = 4000) -> float:
    """Microseconds of worker time per announced block: the tree's listener (hash, queue) and the publisher thread's
    share (pack, send), timed with a real PUB socket in this process."""
    from workers.kv_events import EventPublisher, PrefixCacheEvents

    class Node:  # what the listener reads of a prefix-tree node
        def __init__(self, parent: "Node | None", tokens: tuple):
            self.parent, self.tokens = parent, tokens

    publisher = EventPublisher(f"inproc://cost-{os.getpid()}", "kv@cost@default")
    listener = PrefixCacheEvents(publisher, block_size, default_loops=8)
    root = Node(None, ())
    nodes, parent = [], root
    for i in range(n):
        node = Node(parent, tuple(range(i, i + block_size)))
        nodes.append(node)
        parent = node if i % 20 else root  # chains of 20 blocks, like the prompts here
    cpu0 = time.process_time()
    for node in nodes:
        listener.stored(node, 8)
    for node in reversed(nodes):
        listener.removed(node)
    publisher.close()  # waits until the publisher thread has sent everything
    return (time.process_time() - cpu0) / (2 * n) * 1e6


def kv_routing_side_by_side(*, model_path: str | None = None, max_tokens: int = 8, concurrency: int = 4,
                            threads: int = 1, echo: Callable[[str], None] = print) -> dict:
    from broker.launcher import LocalService
    from tinyloop.cache import BLOCK_TOKENS
    from tinyloop.loader import load_model

    model = load_model(model_path, 256)  # only its tokenizer: a router tokenizes the prompt itself
    prompts = workload(model.encode_prompt)
    # 2 lanes of 512 tokens at up to 16 loops: the pool keeps about five of the eight prefixes at 8 loops
    args = ["--max-seq-len", "512", "--max-handles", "0", "--max-lanes", str(LANES), "--threads", str(threads)]
    args += ["--model", model_path] if model_path else []
    results: dict[str, Any] = {"load_average": os.getloadavg(), "requests": len(prompts), "concurrency": concurrency,
                               "prompt_tokens_mean": sum(len(p) for _, p in prompts) / len(prompts)}
    echo(f"kv routing: two 1-worker services, 8 prefixes x 8 suffixes ({results['prompt_tokens_mean']:.0f} prompt "
         f"tokens on average), closed loop, concurrency {concurrency}, {max_tokens} tokens each")
    for arm in ("round_robin_no_events", "round_robin", "kv_events"):
        tmp = tempfile.mkdtemp(prefix="kvr", dir="/tmp")
        endpoints = [f"ipc://{tmp}/r{k}" for k in range(2)]
        services = []
        try:
            for k in range(2):
                events = [] if arm == "round_robin_no_events" else \
                    ["--kv-events-endpoint", endpoints[k], "--kv-events-topic", f"kv@r{k}@default"]
                services.append(LocalService(1, args + events))
            for s in services:
                s.__enter__()
            router = EventRouter(endpoints, BLOCK_TOKENS, LANES) if arm != "round_robin_no_events" else None
            time.sleep(0.5)  # let the router's subscriptions reach the publishers
            r = results[arm] = asyncio.run(run_arm([s.frontend for s in services], prompts,
                                                   router if arm == "kv_events" else None, concurrency, max_tokens))
            if router is not None:
                time.sleep(0.5)
                router.drain()
                r["events"] = router.events
                r["events_per_s"] = router.events / r["duration_s"]
                router.close()
        finally:
            for s in services:
                s.close()
        echo(f"  {arm:<22} requests hit {r['requests_hit']:>4.0%}, prompt tokens hit {r['prompt_tokens_hit']:>4.0%}, "
             f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms p99 {r['ttft_ms']['p99']:.0f} ms, "
             f"{r['request_throughput']:.2f} req/s, per replica {r['per_replica']}"
             + (f", {r['events']} events ({r['events_per_s']:.0f}/s)" if "events" in r else ""))
    cost = results["event_cost_us"] = event_cost_us(BLOCK_TOKENS)
    rr, rr_off, kv = results["round_robin"], results["round_robin_no_events"], results["kv_events"]
    results["ttft_p50_ratio"] = rr["ttft_ms"]["p50"] / kv["ttft_ms"]["p50"]
    # events per second per worker x worker time per event: the share of one worker's second they take
    results["event_share"] = kv["events_per_s"] / 2 * cost / 1e6
    results["throughput_with_events"] = rr["request_throughput"] / rr_off["request_throughput"]
    echo(f"  events: {cost:.1f} us of worker time each; at {kv['events_per_s'] / 2:.0f} events/s per worker that is "
         f"{results['event_share']:.3%} of a worker's time; round robin with events / without: "
         f"{results['throughput_with_events']:.3f}x req/s")
    echo(f"  kv events vs round robin: prompt tokens hit {kv['prompt_tokens_hit']:.0%} vs "
         f"{rr['prompt_tokens_hit']:.0%}, "
         f"TTFT p50 {results['ttft_p50_ratio']:.2f}x lower, {kv['request_throughput'] / rr['request_throughput']:.2f}x "
         f"req/s")
    return results
