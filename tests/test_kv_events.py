"""KV-cache events, end to end: two real 1-worker services (broker and worker processes, the bundled model) publish
their prefix caches' events over real ZeroMQ sockets while requests sharing prefixes run, blocks are evicted and a
worker restarts.

The subscriber here is written from the protocol as vLLM documents it (vllm/distributed/kv_events.py; docs/deploy.md
"Routed by llm-d / the Inference Extension / Dynamo"), not from TinyLoop's encoder: three frames (topic, 8-byte
big-endian sequence number, msgpack payload), the payload a positional array [ts, events, data_parallel_rank], each
event a positional array led by its tag, and a ROUTER that replays from a sequence number and ends with -1. It keeps
each replica's live blocks as the token prefixes they hold, and checks as it goes that chains hold (a block's parent is
live), that a removal names a hash that was stored and nothing extends, and that a token prefix has one hash wherever
and whenever it is announced (on both replicas, before and after a restart).

NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`, from the ai-dynamo-runtime wheel) reads the same
streams: a real cluster router's decoder, which must route a prompt to the replica holding its prefix.
"""

from __future__ import annotations

import hashlib
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from broker import launcher
from broker.client import Client

BLOCK = 16  # tokens per block: BlockStored's block_size says so too, checked below
PROMPT_BLOCKS = 8  # each shared prefix: 8 whole blocks
# --max-lanes 2 at --max-seq-len 256: the pool holds about a thousand tokens at 8 loops, so the load below evicts
WORKER_ARGS = ["--max-seq-len", "256", "--max-handles", "0", "--threads", "1", "--max-lanes", "2"]
HEARTBEAT_S = 0.3


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def prefix(i: int) -> list[int]:
    """Shared prefix i: 8 blocks of token ids no other prefix starts with."""
    return [200 + 37 * i + (7 * j) % 113 for j in range(PROMPT_BLOCKS * BLOCK)]


def prompt(i: int, k: int) -> list[int]:
    """Prefix i and a 20-token suffix k (a partial last block: only whole blocks are announced)."""
    return prefix(i) + [3000 + 20 * k + j for j in range(20)]


# ----------------------------------------------------------------------------- the subscriber (from the protocol)


class Replica:
    def __init__(self, topic: bytes, replay: str):
        self.topic, self.replay = topic, replay
        self.expected: int | None = None  # the next sequence number
        self.live: dict[int, tuple] = {}  # hash -> the whole token prefix its block ends
        self.by_prefix: dict[tuple, int] = {}
        self.clears = self.stored = self.removed = 0


class Subscriber:
    def __init__(self, ctx: zmq.Context, replicas: dict[str, tuple[str, str]]):
        """replicas: name -> (PUB endpoint, replay endpoint)."""
        self.ctx = ctx
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.replicas = {f"kv@{name}@default".encode(): Replica(f"kv@{name}@default".encode(), replay)
                         for name, (_, replay) in replicas.items()}
        # PUB drops what it sends before a subscriber is connected: the test waits for a reconnection after a restart
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        for endpoint, _ in replicas.values():
            self.sub.connect(endpoint)
        self.hash_of: dict[tuple, int] = {}  # every token prefix ever announced, anywhere -> its hash
        self.replays = 0

    def connections(self, timeout: float = 0.0) -> int:
        """How many connections to a publisher were made since the last call (waiting up to `timeout` for one)."""
        made = 0
        while self.monitor.poll(int(timeout * 1000) if not made else 0):
            made += recv_monitor_message(self.monitor)["event"] == zmq.EVENT_CONNECTED
        if made:  # libzmq sends a new connection our subscription once the socket is used: use it, let it arrive
            self.pump(quiet=0.3)
        return made

    def replica(self, name: str) -> Replica:
        return self.replicas[f"kv@{name}@default".encode()]

    def pump(self, quiet: float = 0.6, timeout: float = 30.0) -> None:
        """Take messages until none came for `quiet` seconds."""
        deadline = time.monotonic() + timeout
        while self.sub.poll(int(quiet * 1000)):
            assert time.monotonic() < deadline, "the event stream never went quiet"
            frames = self.sub.recv_multipart()
            assert len(frames) == 3, frames
            topic, seq_bytes, payload = frames
            assert len(seq_bytes) == 8
            self.receive(self.replicas[topic], int.from_bytes(seq_bytes, "big"), payload)

    def receive(self, r: Replica, seq: int, payload: bytes) -> None:
        if r.expected is not None and seq == r.expected:
            self.apply(r, payload)
            r.expected = seq + 1
            return
        if r.expected is not None and seq < r.expected:  # numbering started again: the publisher restarted
            r.expected = None
        # A gap (or the first message we saw, after a slow join): ask the replay socket for what we missed.
        self.replay(r, 0 if r.expected is None else r.expected, upto=seq)
        if r.expected == seq:
            self.apply(r, payload)
            r.expected = seq + 1

    def replay(self, r: Replica, start: int, upto: int) -> None:
        self.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(r.replay)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        try:
            while True:
                assert dealer.poll(10_000), "no answer from the replay socket"
                empty, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == -1:
                    assert empty == b"" and payload == b""
                    break
                if seq >= upto:  # the live message that showed the gap is applied by the caller
                    continue
                assert r.expected in (None, seq), (r.expected, seq)
                self.apply(r, payload)
                r.expected = seq + 1
        finally:
            dealer.close()
        if r.expected is None:
            r.expected = upto

    def apply(self, r: Replica, payload: bytes) -> None:
        batch = msgpack.unpackb(payload)
        assert isinstance(batch, list) and len(batch) == 3, batch
        ts, events, rank = batch
        assert isinstance(ts, float) and abs(ts - time.time()) < 600 and rank == 0
        for event in events:
            tag, fields = event[0], event[1:]
            if tag == "BlockStored":
                hashes, parent, token_ids, block_size, lora_id, medium, lora_name = fields
                assert block_size == BLOCK and len(token_ids) == BLOCK * len(hashes)
                assert (lora_id, medium, lora_name) == (None, None, None)
                assert parent is None or parent in r.live, "a block's parent is live when it is stored"
                start = r.live[parent] if parent is not None else ()
                for i, h in enumerate(hashes):
                    tokens = start + tuple(token_ids[: BLOCK * (i + 1)])
                    assert isinstance(h, int) and 0 <= h < 2**64
                    assert self.hash_of.setdefault(tokens, h) == h, "one token prefix, one hash, everywhere, always"
                    assert h not in r.live or r.live[h] == tokens
                    r.live[h], r.by_prefix[tokens] = tokens, h
                    r.stored += 1
            elif tag == "BlockRemoved":
                hashes, medium = fields
                assert medium is None
                for h in hashes:
                    assert h in r.live, "a removal names a hash a BlockStored sent"
                    tokens = r.live.pop(h)
                    assert not any(len(t) == len(tokens) + BLOCK and t[: len(tokens)] == tokens
                                   for t in r.by_prefix), "a block leaves after the blocks extending it"
                    del r.by_prefix[tokens]
                    r.removed += 1
            elif tag == "AllBlocksCleared":
                assert fields == []
                r.live.clear()
                r.by_prefix.clear()
                r.clears += 1
            else:
                raise AssertionError(f"unknown event {event!r}")

    def cached_blocks(self, name: str, ids: list[int]) -> int:
        """How many leading whole blocks of ids the replica announced and still holds: its prefix-cache score."""
        by_prefix, k = self.replica(name).by_prefix, 0
        while len(ids) >= BLOCK * (k + 1) and tuple(ids[: BLOCK * (k + 1)]) in by_prefix:
            k += 1
        return k

    def route(self, ids: list[int]) -> str:
        scores = {name: self.cached_blocks(name, ids) for name in ("a", "b")}
        return max(scores, key=lambda n: (scores[n], n == "a"))


# ----------------------------------------------------------------------------- llm-d's block hash, from its description


def cbor_head(major: int, n: int) -> bytes:
    """RFC 8949's head in its shortest form, as canonical CBOR encodes it."""
    if n < 24:
        return bytes([major << 5 | n])
    size = next(size for size in (1, 2, 4, 8) if n < 1 << (8 * size))
    return bytes([major << 5 | {1: 24, 2: 25, 4: 26, 8: 27}[size]]) + n.to_bytes(size, "big")


def llm_d_block_hashes(ids: list[int], seed: str = "") -> list[int]:
    """llm-d's kvblock.ChunkedTokenDatabase (vLLM's sha256_cbor): the low 8 bytes of SHA-256 over the canonical CBOR
    of [parent, tokens, null], chained from SHA-256 of CBOR(seed)."""
    low64 = lambda data: int.from_bytes(hashlib.sha256(data).digest()[24:], "big")  # noqa: E731
    parent, hashes = low64(cbor_head(3, len(seed.encode())) + seed.encode()), []
    for i in range(0, len(ids) - BLOCK + 1, BLOCK):
        block = cbor_head(4, BLOCK) + b"".join(cbor_head(0, t) for t in ids[i:i + BLOCK])
        parent = low64(cbor_head(4, 3) + cbor_head(0, parent) + block + b"\xf6")
        hashes.append(parent)
    return hashes


# ----------------------------------------------------------------------------- Dynamo's indexer


class DynamoIndexer:
    """NVIDIA Dynamo's standalone KV indexer: it subscribes to each worker's PUB socket (replaying gaps) and answers
    which worker holds how many blocks of a prompt (POST /query)."""

    def __init__(self, log: Path):
        self.port = free_ports(1)[0]
        self.proc = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--port", str(self.port),
                                      "--threads", "1"], stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self.ok("GET", "/health"):
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)

    def call(self, method: str, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode()
            return json.loads(text) if text else None

    def ok(self, method: str, path: str) -> bool:
        try:
            self.call(method, path)
            return True
        except OSError:
            return False

    def register(self, instance_id: int, endpoint: str, replay: str) -> None:
        self.call("POST", "/register", {"instance_id": instance_id, "endpoint": endpoint, "replay_endpoint": replay,
                                        "model_name": "default", "block_size": BLOCK})

    def scores(self, ids: list[int]) -> dict[int, int]:
        """Worker id -> prompt tokens in the longest prefix of `ids` it holds."""
        answer = self.call("POST", "/query", {"token_ids": ids, "model_name": "default"})
        return {int(k): v["longest_matched"] for k, v in answer["instances"].items()}

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


# ----------------------------------------------------------------------------- the test


def wait_for_metrics(port: int, predicate, timeout: float = 20) -> dict[str, float]:
    """The broker's /metrics as {series: value} once `predicate` holds for them (heartbeats carry the workers'
    state)."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            lines = resp.read().decode().splitlines()
        series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")}
        if predicate(series):
            return series
        assert time.monotonic() < deadline, {k: v for k, v in series.items() if "vllm" in k or "worker_" in k}
        time.sleep(0.2)


def worker_events_args(name: str, ports: tuple[int, int]) -> list[str]:
    return ["--kv-events-endpoint", f"tcp://*:{ports[0]}", "--kv-events-replay-endpoint", f"tcp://*:{ports[1]}",
            "--kv-events-topic", f"kv@{name}@default"]


def start_worker(svc: launcher.LocalService, worker: str, name: str, ports: tuple[int, int]) -> None:
    svc.start_worker(worker, *worker_events_args(name, ports))


def wait_registered(svc: launcher.LocalService, worker: str, timeout: float = 180) -> None:
    """Until the broker has a ready worker called `worker` (a restarted one registers under its new name)."""
    deadline = time.monotonic() + timeout
    with Client(svc.frontend, timeout=10) as client:
        while True:
            names = [w["name"] for w in client.status()["workers"]]
            if worker in names:
                return
            assert svc.workers[worker].poll() is None, svc.log(worker)[-3000:]
            assert time.monotonic() < deadline, f"{worker} did not register: {names}"
            time.sleep(0.2)


def test_events_follow_the_prefix_caches_of_two_replicas_through_evictions_and_a_restart(tmp_path):
    ports = free_ports(5)
    endpoints = {"a": (ports[0], ports[1]), "b": (ports[2], ports[3])}
    metrics_port = ports[4]  # service a's broker: the gauges the Inference Extension's endpoint picker reads
    ctx = zmq.Context()
    services = [launcher.LocalService(0, WORKER_ARGS, heartbeat_interval=HEARTBEAT_S, log_dir=tmp_path / name,
                                      broker_args=["--metrics-port", str(metrics_port)] if name == "a" else [])
                for name in ("a", "b")]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    indexer = None
    try:
        svc = dict(zip(("a", "b"), services))
        for name, s in svc.items():
            s.start()  # the broker (no workers yet)
            start_worker(s, "w1", name, endpoints[name])
        indexer = DynamoIndexer(tmp_path / "indexer.log")
        sub = Subscriber(ctx, {name: (f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}")
                               for name, (p, r) in endpoints.items()})
        for name, s in svc.items():
            wait_registered(s, "w1")
        # as Dynamo's discovery would, once the workers are up (its listener does not retry a refused connection)
        for instance_id, name in ((1, "a"), (2, "b")):
            indexer.register(instance_id, f"tcp://127.0.0.1:{endpoints[name][0]}",
                             f"tcp://127.0.0.1:{endpoints[name][1]}")
        clients = {name: Client(s.frontend, timeout=120) for name, s in svc.items()}

        def send(name: str, ids: list[int]):
            reply = clients[name].generate(ids, max_tokens=1)
            assert reply.stats["prompt_tokens"] == len(ids)
            return reply

        # 1. Shared prefixes on each replica; the subscriber joined late, so it replays from 0 (AllBlocksCleared).
        for i, k in ((0, 0), (0, 1), (1, 0)):
            send("a", prompt(i, k))
        for i, k in ((2, 0), (2, 1), (0, 2)):
            send("b", prompt(i, k))
        sub.pump()
        a, b = sub.replica("a"), sub.replica("b")
        assert a.clears == 1 and b.clears == 1 and sub.replays >= 2
        assert sub.cached_blocks("a", prompt(0, 5)) == PROMPT_BLOCKS and sub.cached_blocks("a", prompt(2, 5)) == 0
        assert sub.cached_blocks("b", prompt(2, 5)) == PROMPT_BLOCKS and sub.cached_blocks("b", prompt(1, 5)) == 0
        # (prefix 0 is on both: the same hashes, checked by Subscriber.apply), and they are the ones llm-d computes
        ids = prompt(0, 0)
        announced = [sub.hash_of[tuple(ids[:BLOCK * (k + 1)])] for k in range(PROMPT_BLOCKS)]
        assert announced == llm_d_block_hashes(ids)[:PROMPT_BLOCKS]

        # A router scoring replicas by the announced blocks sends each prompt where its prefix is, and it hits there.
        for i, holder in ((1, "a"), (2, "b")):
            ids = prompt(i, 7)
            assert sub.route(ids) == holder
            assert send(holder, ids).stats["prefix_hit_tokens"] >= PROMPT_BLOCKS * BLOCK
        # Dynamo's indexer decoded the same streams and agrees.
        deadline = time.monotonic() + 20
        while True:
            scores = {i: indexer.scores(prompt(i, 9)) for i in (1, 2)}
            if scores[1].get(1, 0) >= PROMPT_BLOCKS * BLOCK and scores[2].get(2, 0) >= PROMPT_BLOCKS * BLOCK:
                break
            assert time.monotonic() < deadline, scores
            time.sleep(0.3)
        assert scores[1].get(2, 0) == 0 and scores[2].get(1, 0) == 0, scores

        # The engine gauges under vLLM's names, beside TinyLoop's own per worker: a request running holds blocks.
        # (At 16 loops: its blocks go into the prefix cache's tree for 16 loops, which is not announced, since a
        # router cannot tell depths apart.)
        sub.pump()
        stored = a.stored
        with clients["a"].stream(prompt(1, 20), max_tokens=100, loops=16, grammar={"regex": "[a-z]{100}"}) as stream:
            next(iter(stream))
            running = wait_for_metrics(metrics_port, lambda m: m["vllm:num_requests_running"] == 1
                                       and m["vllm:kv_cache_usage_perc"] > 0)
            stream.cancel()
        assert running["vllm:num_requests_waiting"] == 0
        assert running['tinyloop_worker_kv_cache_usage_ratio{worker="w1"}'] == running["vllm:kv_cache_usage_perc"]
        # done: nothing runs, and the blocks only the prefix cache holds count as free (as in vLLM)
        wait_for_metrics(metrics_port, lambda m: m["vllm:num_requests_running"] == 0
                         and m["vllm:kv_cache_usage_perc"] == 0)
        sub.pump()
        assert a.stored == stored

        # 2. More prefixes than replica a's pool holds: evictions, announced as BlockRemoved.
        for i in range(3, 9):
            send("a", prompt(i, 0))
        sub.pump()
        assert a.removed > 0
        # Every block stored is either removed or still cached: the worker's own prefix hit equals what the events
        # say it holds (whole blocks; at most 15 tokens more from a partly shared last block).
        for i in (0, 1, 5, 8):
            ids = prompt(i, 11)
            held = sub.cached_blocks("a", ids)
            hit = send("a", ids).stats["prefix_hit_tokens"]
            assert min(BLOCK * held, len(ids) - 1) <= hit <= min(BLOCK * held + BLOCK - 1, len(ids) - 1), (i, held, hit)
            sub.pump()
        assert sub.cached_blocks("a", prompt(8, 99)) == PROMPT_BLOCKS  # the newest prefix stays

        # 3. Replica b's worker dies and a new one starts on the same endpoints: AllBlocksCleared, found by replay.
        for _ in range(3):
            send("b", prompt(2, 12))  # more batches, so the new numbering starts below where the old one got
        sub.pump()
        sub.connections()
        svc["b"].workers["w1"].send_signal(signal.SIGKILL)
        svc["b"].workers["w1"].wait(10)
        start_worker(svc["b"], "w2", "b", endpoints["b"])
        wait_registered(svc["b"], "w2")
        assert sub.connections(timeout=30) == 1  # the subscriber found the new publisher (at the old endpoint)
        send("b", prompt(0, 13))
        sub.pump()
        sub.monitor.close()
        assert b.clears == 2 and sub.cached_blocks("b", prompt(2, 0)) == 0  # the old life's blocks are gone
        assert sub.cached_blocks("b", prompt(0, 0)) == PROMPT_BLOCKS  # same hashes as before and as on a
        # Dynamo's discovery drops a dead worker and registers its successor as a new instance (its listener does not
        # follow a publisher that starts numbering again): the blocks of the old life go, the new ones count.
        indexer.call("POST", "/unregister", {"instance_id": 2, "model_name": "default"})
        indexer.register(3, f"tcp://127.0.0.1:{endpoints['b'][0]}", f"tcp://127.0.0.1:{endpoints['b'][1]}")
        send("b", prompt(0, 16))  # its next batch shows the indexer the gap, which it replays
        deadline = time.monotonic() + 20
        while indexer.scores(prompt(0, 15)).get(3, 0) < PROMPT_BLOCKS * BLOCK:
            assert time.monotonic() < deadline, indexer.scores(prompt(0, 15))
            time.sleep(0.3)
        assert set(indexer.scores(prompt(2, 15))) <= {1}  # nobody holds prefix 2 since b restarted (a never did)
        for c in clients.values():
            c.close()
    finally:
        if indexer is not None:
            indexer.close()
        for s in services:
            s.close()
        ctx.destroy(linger=0)
