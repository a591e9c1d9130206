"""KV-cache events in vLLM's wire format, so that cluster routers (llm-d's precise prefix-cache scorer, the Gateway
API Inference Extension's endpoint picker with it, NVIDIA Dynamo's KV router) see what a worker's prefix cache holds.

The wire (vLLM's `vllm/distributed/kv_events.py`, read by llm-d's `pkg/kvevents` and Dynamo's ZMQ relay):

* a ZeroMQ PUB socket; each message is three frames: the topic (`kv@<pod>@<model>`), the sequence number as 8 bytes
  big-endian (0, 1, 2, ... per publisher), and a msgpack payload;
* the payload is an EventBatch, a positional array `[ts, events, data_parallel_rank]`;
* each event is a positional array led by its tag:
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]`,
  `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`;
* an optional ROUTER socket replays: a request `[b"", start_seq as 8 bytes big-endian]` is answered by one
  `[b"", seq, payload]` per buffered batch from that number on, then `[b"", -1 as 8 signed bytes, b""]`.

What TinyLoop sends: one BlockStored per 16-token block its prefix cache keeps (tinyloop/prefix_tree.py), with the
block's own 16 token ids and its parent's hash (None for a prompt's first block), and one BlockRemoved with the same
hash when the block leaves the cache. A partial last block (a registered scaffold's tail) is not announced: routers
hash whole blocks only. A worker starts with AllBlocksCleared: whatever an earlier life of it announced is gone.

Block hashes are the ones llm-d computes from a prompt's tokens (its `kvblock.ChunkedTokenDatabase`, itself vLLM's
`sha256_cbor`): the last 8 bytes, big-endian, of SHA-256 over the canonical CBOR of `[parent, tokens, extra]`, the
first block's parent being SHA-256 of CBOR(seed) likewise (the seed is vLLM's PYTHONHASHSEED, llm-d's HashSeed;
`--kv-events-seed`, default ""). So a router that hashes the prompt itself finds the blocks a worker announced, and
the hashes are the same after a restart and on every replica (`extra` is None: no adapters, no media).

Only blocks cached at the model's default loop count are announced. A looped model's cached entries depend on the loop
count (docs/cache-reuse.md: one prefix tree per count), and no router knows about loops: Dynamo matches blocks by their
tokens, so a block cached at 16 loops would look like a hit to a request at 8. Requests that routers send (OpenAI
requests without TinyLoop's `loops` field) run at the default count, and those are the blocks they can use.

The tree calls `PrefixCacheEvents` in the compute thread; it only appends to a queue. The publisher thread owns the
sockets (ZeroMQ sockets are not thread-safe), batches what the queue holds and keeps the last batches for replay.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

log = logging.getLogger("tinyloop.worker")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
MAX_EVENTS_PER_BATCH = 1024
REPLAY_BATCHES = 10_000  # batches kept for replay (vLLM's default buffer_steps)


# ----------------------------------------------------------------------------- the hashes


def cbor(value: Any) -> bytes:
    """Canonical CBOR (RFC 8949, shortest forms) of the few types the block hash covers: non-negative ints, text,
    lists and None."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return cbor_head(0, value)
    if isinstance(value, str):
        data = value.encode()
        return cbor_head(3, len(data)) + data
    if isinstance(value, (list, tuple)):
        return cbor_head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise TypeError(f"no CBOR for {type(value).__name__}")


def cbor_head(major: int, n: int) -> bytes:
    if n < 0:
        raise ValueError("only non-negative integers")
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise ValueError("integer too large for CBOR's head")


def sha256_low64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[24:], "big")


def root_hash(seed: str) -> int:
    """The parent of a prompt's first block."""
    return sha256_low64(cbor(seed))


def block_hash(parent: int, tokens: list[int] | tuple) -> int:
    return sha256_low64(cbor([parent, list(tokens), None]))  # [parent, tokens, extra keys]


def prompt_block_hashes(ids: list[int], block_size: int, seed: str = "") -> list[int]:
    """The hashes of a prompt's whole blocks, as a router computes them to look its prefix up."""
    parent, hashes = root_hash(seed), []
    for i in range(0, len(ids) - block_size + 1, block_size):
        parent = block_hash(parent, ids[i:i + block_size])
        hashes.append(parent)
    return hashes


# ----------------------------------------------------------------------------- the events


def block_stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int) -> list:
    # lora_id, medium, lora_name: no adapters; medium None is the engine's own block pool (routers' first tier)
    return ["BlockStored", hashes, parent, token_ids, block_size, None, None, None]


def block_removed(hashes: list[int]) -> list:
    return ["BlockRemoved", hashes, None]


def all_blocks_cleared() -> list:
    return ["AllBlocksCleared"]


def event_batch(events: list[list], rank: int) -> bytes:
    return msgpack.packb([time.time(), events, rank], use_bin_type=True)


# ----------------------------------------------------------------------------- the publisher


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host (`tcp://*:5557`), ipc or inproc binds; a named host is connected to (llm-d's
    endpoint picker binds one SUB socket and every model server connects its PUB to it)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def bind_or_connect(socket: zmq.Socket, endpoint: str) -> None:
    if binds(endpoint):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)


def offset_port(endpoint: str, offset: int) -> str:
    """`tcp://*:5557` + 2 -> `tcp://*:5559`: the endpoint of the worker `offset` places after the first (vLLM does
    the same per data-parallel rank). Other transports get a suffix."""
    if not offset:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + offset}"
    return f"{endpoint}-{offset}"


class EventPublisher:
    """The PUB socket (and the optional ROUTER for replay) in a thread of their own, fed through a queue."""

    def __init__(self, endpoint: str, topic: str, *, replay_endpoint: str | None = None, rank: int = 0,
                 context: zmq.Context | None = None):
        self.topic, self.rank = topic.encode(), rank
        self.events: queue.SimpleQueue[list | None] = queue.SimpleQueue()
        self.replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self.sequence = 0
        ctx = context or zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.sndhwm = 100_000
        self.pub.linger = 1000
        bind_or_connect(self.pub, endpoint)
        self.replay = None
        if replay_endpoint:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.linger = 0
            self.replay.bind(replay_endpoint)
        self.thread = threading.Thread(target=self.run, name="kv-events", daemon=True)
        self.thread.start()

    def put(self, event: list) -> None:
        self.events.put(event)

    def close(self) -> None:
        """Send what is queued, then close the sockets."""
        self.events.put(None)
        self.thread.join(timeout=5)

    def run(self) -> None:
        closing = False
        while not closing:
            if self.replay is not None and self.replay.poll(0):
                self.serve_replay()
            try:
                first = self.events.get(timeout=0.05)
            except queue.Empty:
                # libzmq attaches a (re)connected subscriber and reads its subscription only when the socket is
                # used; without this, the first batch after a subscriber (re)connects would go to nobody
                self.pub.getsockopt(zmq.EVENTS)
                continue
            batch = [first]
            while len(batch) < MAX_EVENTS_PER_BATCH and batch[-1] is not None:  # what else is queued joins it
                try:
                    batch.append(self.events.get_nowait())
                except queue.Empty:
                    break
            closing = batch[-1] is None
            events = [e for e in batch if e is not None]
            if events:
                self.send(events)
        self.pub.close()
        if self.replay is not None:
            self.replay.close()

    def send(self, events: list[list]) -> None:
        payload = event_batch(events, self.rank)
        seq = self.sequence.to_bytes(8, "big")
        self.pub.send_multipart([self.topic, seq, payload])
        self.replay_buffer.append((self.sequence, payload))
        self.sequence += 1

    def serve_replay(self) -> None:
        assert self.replay is not None  # (served only where there is a replay socket)
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:  # [identity, b"", start]: anything else is not a replay request
            log.warning("kv events: ignoring a malformed replay request of %d frames", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self.replay_buffer):
            if seq >= start:
                self.replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        self.replay.send_multipart([identity, b"", END_OF_REPLAY, b""])


class PrefixCacheEvents:
    """The prefix tree's listener (tinyloop/prefix_tree.py: TreeListener): turns stored and removed nodes into
    events. Remembers the hash it announced per node, so a removal names exactly what was stored."""

    def __init__(self, publisher: EventPublisher, block_size: int, default_loops: int, seed: str = ""):
        self.publisher, self.block_size, self.default_loops = publisher, block_size, default_loops
        self.root = root_hash(seed)
        self.hashes: dict[Any, int] = {}  # tree node -> the hash its BlockStored carried
        publisher.put(all_blocks_cleared())

    def stored(self, node: Any, loops: int) -> None:
        if len(node.tokens) != self.block_size or loops != self.default_loops:  # see the module's docstring
            return
        parent = self.hashes.get(node.parent)
        if parent is None and node.parent.parent is not None:  # its parent was never announced (a partial block)
            return
        h = self.hashes[node] = block_hash(self.root if parent is None else parent, node.tokens)
        self.publisher.put(block_stored([h], parent, list(node.tokens), self.block_size))

    def removed(self, node: Any) -> None:
        h = self.hashes.pop(node, None)
        if h is not None:
            self.publisher.put(block_removed([h]))
