"""Prometheus metrics and the HTTP health probe of the broker.

The broker loop is single-threaded; it updates these metrics and a small health snapshot.
A daemon thread serves them over HTTP:

    GET /metrics  -> Prometheus text format
    GET /healthz  -> liveness: 200 {"status": "ok", ...} while the broker loop runs, 503 when it stalled
    GET /readyz   -> readiness: 200 when the service can serve now (a ready worker, room in the queue,
                     recent error rate below its limit), else 503; the body names every problem

Liveness says nothing about workers on purpose: an orchestrator restarts a broker that fails it,
and restarting the broker cannot bring workers back. Readiness is what a load balancer routes by.

Each broker gets its own CollectorRegistry so several brokers can live in one process (tests).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# The broker loop ticks at least every 50 ms; silence this long means it is stuck.
STALLED_AFTER_S = 5.0
# Buckets in seconds: from sub-millisecond broker round trips to minute-long CPU generations.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# Loops a generated token ran (elastic depth, early exit): every count up to 16, then the usual depths of big models.
LOOP_BUCKETS = (*range(1, 17), 20, 24, 32, 48, 64, 96, 128)
RECENT_S = 30.0  # the window of the tinyloop_recent_* depth gauges


class BrokerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("tinyloop_queue_depth", "Requests waiting for a worker", registry=r)
        self.ready_workers = Gauge("tinyloop_ready_workers", "Workers that announced ready and are alive", registry=r)
        self.busy_workers = Gauge("tinyloop_busy_workers", "Workers running a request", registry=r)
        self.live_handles = Gauge("tinyloop_live_handles", "Live handles over all workers", registry=r)
        self.requests = Counter(
            "tinyloop_requests", "Requests finished, by op and outcome (done|error)", ["op", "outcome"], registry=r
        )
        self.errors = Counter("tinyloop_errors", "Error replies, by code", ["code"], registry=r)
        self.stop_reasons = Counter("tinyloop_stop_reasons", "Finished generations, by stop reason", ["reason"], registry=r)
        self.output_tokens = Counter("tinyloop_output_tokens", "Generated tokens", registry=r)
        self.prompt_tokens = Counter("tinyloop_prompt_tokens", "Prompt tokens", registry=r)
        self.retries = Counter("tinyloop_retries", "Requests re-queued after their worker was lost or a forward they shared failed", registry=r)
        self.workers_lost = Counter("tinyloop_workers_lost", "Workers that stopped heartbeating", registry=r)
        self.routed = Counter("tinyloop_routed", "Queued requests given to a free worker by cache-aware routing: to the "
                              "worker holding their prompt prefix (affinity) or not (least_loaded)", ["how"], registry=r)
        self.prefix_hit_tokens = Counter("tinyloop_prefix_hit_tokens", "Prompt tokens whose prefill a worker's prefix "
                                         "cache skipped", registry=r)
        self.ttft = Histogram(
            "tinyloop_time_to_first_token_seconds", "Arrival at the broker to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "tinyloop_time_per_output_token_seconds", "Decode time per output token after the first", buckets=TOKEN_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "tinyloop_request_latency_seconds", "Arrival at the broker to final reply", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "tinyloop_queue_wait_seconds", "Arrival at the broker to dispatch to a worker", buckets=LATENCY_BUCKETS, registry=r
        )
        # What cluster routers read (the Gateway API Inference Extension's model-server protocol, under vLLM's names:
        # docs/deploy.md, "Routed by llm-d / the Inference Extension / Dynamo"). One series each: a router scrapes
        # one endpoint per replica and reads one value, so these are the service's totals; with one worker per
        # service (deploy/kubernetes/inference-pool) they are that worker's. TinyLoop's own names give each worker.
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a worker (the queue)", registry=r)
        self.vllm_running = Gauge("vllm:num_requests_running", "Requests the workers run", registry=r)
        self.vllm_kv_usage = Gauge("vllm:kv_cache_usage_perc", "Share of the workers' KV blocks held by running "
                                   "requests and handles, 0 to 1 (blocks only the prefix cache holds count as free)",
                                   registry=r)
        self.worker_running = Gauge("tinyloop_worker_requests_running", "Requests a worker runs", ["worker"],
                                    registry=r)
        self.worker_kv_usage = Gauge("tinyloop_worker_kv_cache_usage_ratio", "Share of a worker's KV blocks held by "
                                     "running requests and handles, 0 to 1", ["worker"], registry=r)
        self.worker_series: set[str] = set()
        # The depth tokens ran (elastic depth: docs/engine.md; early exit), from each finished request's stats: what
        # quality was traded for latency
        self.token_loops = Histogram("tinyloop_token_loops", "Loops each generated token ran", buckets=LOOP_BUCKETS,
                                     registry=r)
        self.tokens_below = Counter("tinyloop_tokens_below_asked_loops", "Generated tokens that ran fewer loops than "
                                    "their request asked (elastic depth's cap, early exit)", registry=r)
        self.recent_loops = Gauge("tinyloop_recent_loops_mean", f"Mean loops per generated token over the last "
                                  f"{RECENT_S:.0f} s of finished requests", registry=r)
        self.recent_below = Gauge("tinyloop_recent_below_asked_loops_ratio", f"Share of generated tokens below "
                                  f"their asked loops over the last {RECENT_S:.0f} s", registry=r)
        self.recent_loss = Gauge("tinyloop_recent_loss_increase", f"Estimated rise of loss per token (nats, the "
                                 f"model's loss_vs_loops) over the last {RECENT_S:.0f} s", registry=r)
        self.recent: deque[tuple[float, int, float, int, float]] = deque()  # (at, tokens, loops, below, loss)
        # Written by the broker loop, read by the HTTP thread; replaced whole, so no lock is needed.
        self.health: dict = {"at": time.monotonic(), "uptime_s": 0.0, "instance": None,
                             "readiness": {"ready": False, "problems": ["the broker is starting"]}}

    def engine_gauges(self, queued: int, workers) -> None:
        """Set the gauges routers read from the queue and what each worker's heartbeat said."""
        workers = list(workers)
        self.vllm_waiting.set(queued)
        self.vllm_running.set(sum(len(w.running) for w in workers))
        total, used = sum(w.total_blocks for w in workers), sum(w.used_blocks for w in workers)
        self.vllm_kv_usage.set(used / total if total else 0.0)
        names = {w.name for w in workers}
        for gone in self.worker_series - names:  # not clear(): a scrape in between would miss the live ones
            self.worker_running.remove(gone)
            self.worker_kv_usage.remove(gone)
        self.worker_series = names
        for w in workers:
            self.worker_running.labels(w.name).set(len(w.running))
            self.worker_kv_usage.labels(w.name).set(w.used_blocks / w.total_blocks if w.total_blocks else 0.0)

    def depth(self, stats: dict, now: float | None = None) -> None:
        """Count the loops a finished request's tokens ran (its stats' loops_histogram) and refresh the recent
        gauges."""
        hist = stats.get("loops_histogram")
        if not isinstance(hist, dict) or not hist:
            return
        tokens = loops = 0
        for depth, count in hist.items():
            try:
                depth, count = int(depth), int(count)
            except (TypeError, ValueError):
                continue
            for _ in range(min(count, 1 << 16)):
                self.token_loops.observe(depth)
            tokens, loops = tokens + count, loops + depth * count
        below = int(stats.get("tokens_below_loops") or 0)
        self.tokens_below.inc(below)
        now = time.monotonic() if now is None else now
        self.recent.append((now, tokens, float(loops), below, float(stats.get("loss_increase") or 0.0) * tokens))
        while self.recent and self.recent[0][0] < now - RECENT_S:
            self.recent.popleft()
        n = sum(r[1] for r in self.recent)
        if n:
            self.recent_loops.set(sum(r[2] for r in self.recent) / n)
            self.recent_below.set(sum(r[3] for r in self.recent) / n)
            self.recent_loss.set(sum(r[4] for r in self.recent) / n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def probe(health: dict, readiness: bool) -> tuple[int, dict]:
    """HTTP status and JSON body of /healthz (readiness False) or /readyz from the broker's snapshot."""
    age = time.monotonic() - health["at"]
    if age > STALLED_AFTER_S:
        return 503, {"status": "stalled", "problems": [f"the broker loop has not run for {age:.1f}s"]}
    if not readiness:
        return 200, {"status": "ok", "uptime_s": health["uptime_s"], "instance": health["instance"]}
    ready = health["readiness"]
    return (200 if ready["ready"] else 503), {"status": "ready" if ready["ready"] else "not_ready", **ready}


def serve_http(metrics: BrokerMetrics, host: str, port: int) -> ThreadingHTTPServer:
    """Start the /metrics and /healthz endpoint in a daemon thread; returns the server (port may be 0)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
            if self.path == "/metrics":
                body, status, ctype = metrics.render(), 200, CONTENT_TYPE_LATEST
            elif self.path in ("/healthz", "/health", "/readyz"):
                status, answer = probe(metrics.health, self.path == "/readyz")
                body, ctype = json.dumps(answer).encode(), "application/json"
            else:
                body, status, ctype = b"not found\n", 404, "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # keep probe traffic out of the logs
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="broker-http", daemon=True).start()
    return server
