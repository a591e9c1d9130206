"""The broker: one process that fans client requests out to ready workers.

Pattern: the Majordomo broker and Paranoid Pirate heartbeats from the ZeroMQ guide.

    clients (DEALER) ──> frontend ROUTER ──[broker]── backend ROUTER <── workers (DEALER)

* A worker is routed to only after it sent "ready" (its model is loaded and its memory
  plan fits), and only while it keeps heartbeating. A worker runs up to `slots` requests at
  once (its announced batch lanes: the worker batches them continuously, docs/engine.md); a
  request goes to the least loaded worker with a free slot.
* Every request gets exactly one final reply (done or error). The broker tracks each
  request until it has answered it, and drops anything a worker sends for a request that
  was already answered (for example after its deadline passed).
* A worker that stops heartbeating is dropped. Its request is re-queued: from the start if
  nothing was streamed to the client yet, otherwise as a continuation (the tokens already
  delivered go with it and the next worker generates what follows them). Requests that
  cannot be continued exactly (handle ops, beam search, early exit) fail with "worker_lost".
* Lazy Pirate: a client that lost its connection re-sends its open requests under the same
  id with the tokens it already holds. A re-sent id this broker still knows is attached to,
  not run again (its missing tokens and final reply are replayed); an unknown one is run,
  as a continuation when the client holds tokens of it (the broker restarted).
* The queue is bounded: past `max_queue` waiting requests the client gets "busy" at once.
* Cache-aware routing: workers announce in their heartbeats the digests of the prompt prefixes
  their prefix caches hold (broker/protocol.py prefix_digests: over the prompt's text, so no
  tokenizer here). A free worker takes, among the first AFFINITY_WINDOW queued requests, the one
  whose prefix it holds deepest, else one no other worker holds; a request whose holder is busy
  waits for it (at most affinity_wait_s, and not when another request already waits for that
  worker: then the holder counts as overloaded), then goes to whichever worker is free.

The broker is single-threaded: one poll loop owns both sockets. It imports no torch.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from broker import protocol
from broker.metrics import BrokerMetrics
from broker.protocol import (
    BROKER_TO_CLIENT,
    BROKER_TO_WORKER,
    CLIENT_TO_BROKER,
    WORKER_TO_BROKER,
    Codes,
    ProtocolError,
)

log = logging.getLogger("tinyloop.broker")
request_log = logging.getLogger("tinyloop.requests")

DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_LIVENESS = 3  # missed intervals before a peer is declared dead
DEFAULT_TIMEOUT_S = 300.0  # deadline of a request that does not set timeout_s
# Ops a lost worker's stream can be continued on another worker from the tokens already delivered
# (the worker still refuses modes that are not exact, e.g. early exit; docs/service.md "Faults").
CONTINUABLE_OPS = frozenset({"generate", "generate_pool", "speculative"})
# Final replies kept for Lazy Pirate re-sends whose first reply was lost in transit.
ANSWERED_KEEP = 1024
ANSWERED_TTL_S = 60.0
# Readiness: error codes that mean the service failed a request. The client's own mistakes (invalid fields, its
# template variables, its grammar, sizes past a limit) are other codes and never count. A timeout counts only when
# the client gave the request at least DEFAULT_READY_MIN_DEADLINE_S (--ready-min-deadline): a shorter deadline is the
# client's own bet, and a client must not be able to turn /readyz red by asking for the impossible.
SERVICE_FAULT_CODES = frozenset({Codes.RUNTIME_ERROR, Codes.WORKER_LOST, Codes.TIMEOUT, Codes.FORWARD_FAILED})
DEFAULT_READY_MIN_DEADLINE_S = 30.0
DEFAULT_READY_WINDOW_S = 60.0
DEFAULT_READY_MAX_ERROR_RATE = 0.5
READY_MIN_SAMPLES = 5  # fewer finished requests than this in the window say nothing about the error rate
# Cache-aware routing looks this far into the queue, and a request is passed over at most this many times.
AFFINITY_WINDOW = 16
DEFAULT_AFFINITY_WAIT_S = 0.5
# Ops whose prompt prefix a worker's prefix cache keeps (their requests are routed by it).
PREFIX_OPS = frozenset({"generate", "generate_pool"})


@dataclass
class Request:
    key: str  # broker-assigned id, used on the worker side (client ids may collide across clients)
    client: bytes  # ZeroMQ identity of the client socket
    client_id: str
    op: str
    params: dict
    stream: bool
    arrived: float
    deadline: float
    worker: bytes | None = None  # the worker running it, if any
    pinned: bytes | None = None  # handle ops must run on this worker
    dispatched_at: float | None = None
    # The id the worker knows this attempt by ("<key>.<attempt>"): replies of an earlier attempt never count.
    dispatch_id: str | None = None
    first_token_at: float | None = None
    digests: list = field(default_factory=list)  # its prompt's prefix digests, shortest first (routing)
    passed_over: int = 0  # times a free worker took a later request instead (cache-aware routing)
    delivered: list = field(default_factory=list)  # token ids sent to the client, in order
    texts: list = field(default_factory=list)  # their text pieces (replayed to a re-sending client)
    attempts: int = 0
    cancelled: bool = False
    answered: bool = False


@dataclass
class Answered:
    """A final reply kept for a while, for a client that re-sends because it may have missed it."""

    tokens: list  # (token, pos, text) of a streamed request
    msg_type: str
    fields: dict
    at: float


@dataclass
class Worker:
    identity: bytes
    name: str
    pid: int
    ops: list
    plan_bytes: int
    max_handles: int
    device: str
    model: str
    expires_at: float
    slots: int = 1  # requests it runs at once (its batch lanes)
    running: set = field(default_factory=set)  # keys of the requests it runs
    last_start: float = 0.0  # when it was last given a request (ties go to the one that waited longest)
    pinned_queue: deque = field(default_factory=deque)  # handle requests waiting for this worker
    handles: int = 0
    served: int = 0
    leaving: bool = False  # sent "goodbye": finish the current request, take no new ones
    # What its last heartbeat said (routing): free KV blocks, requests running, digests of the prompt prefixes its
    # prefix cache holds. Between heartbeats it also holds what it was sent since (assigned: prompts it is running;
    # recent: prompts it finished after the last heartbeat).
    free_blocks: int | None = None
    lanes: int = 0
    total_blocks: int = 0  # its KV block pool, and the blocks requests and handles hold (cached-only ones are free)
    used_blocks: int = 0
    prefixes: frozenset = frozenset()
    assigned: dict = field(default_factory=dict)  # digest -> requests running with it
    recent: set = field(default_factory=set)

    def holds(self, digests: list) -> int:
        """How many of a prompt's prefix digests (shortest first) this worker holds: the depth of its cached prefix."""
        for i in range(len(digests), 0, -1):
            d = digests[i - 1]
            if d in self.prefixes or d in self.assigned or d in self.recent:
                return i
        return 0


class Broker:
    def __init__(
        self,
        frontend: str,
        backend: str,
        *,
        max_queue: int = 64,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        heartbeat_liveness: int = DEFAULT_HEARTBEAT_LIVENESS,
        max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES,
        max_worker_plan_bytes: int | None = None,
        max_handles_per_worker: int | None = None,
        max_attempts: int = 3,
        default_timeout_s: float = DEFAULT_TIMEOUT_S,
        drain_timeout_s: float = 30.0,
        ready_window_s: float = DEFAULT_READY_WINDOW_S,
        ready_max_error_rate: float = DEFAULT_READY_MAX_ERROR_RATE,
        ready_min_deadline_s: float = DEFAULT_READY_MIN_DEADLINE_S,
        curve_dir: str | None = None,
        affinity: bool = True,
        affinity_wait_s: float = DEFAULT_AFFINITY_WAIT_S,
        context: zmq.Context | None = None,
    ) -> None:
        self.frontend_endpoint = frontend
        self.affinity = affinity  # cache-aware routing (False: first come, first served on the least recently used)
        self.affinity_wait_s = affinity_wait_s  # the longest a request waits for the busy worker holding its prefix
        self.backend_endpoint = backend
        self.max_queue = max_queue
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_expiry = heartbeat_interval * heartbeat_liveness
        self.max_message_bytes = max_message_bytes
        self.max_worker_plan_bytes = max_worker_plan_bytes
        self.max_handles_per_worker = max_handles_per_worker
        self.max_attempts = max_attempts
        self.default_timeout_s = default_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.ready_window_s = ready_window_s
        self.ready_max_error_rate = ready_max_error_rate
        self.ready_min_deadline_s = ready_min_deadline_s  # shorter deadlines that pass are the client's, not a fault
        # Finished requests in the readiness window, one bucket per second: [second, finished, {fault code: n}].
        # Buckets, not one entry per request, so the memory stays bounded at any request rate.
        self.outcomes: deque[list] = deque()
        self.answered_recently: OrderedDict[tuple[bytes, str], Answered] = OrderedDict()
        self.told_reconnect: dict[bytes, float] = {}  # unknown worker identity -> when it was told to re-announce
        self.metrics = BrokerMetrics()
        self.started = time.monotonic()

        self.ctx = context or zmq.Context.instance()
        self.curve_dir = curve_dir
        self.authenticator = None
        if curve_dir is not None:
            from broker.security import start_authenticator

            self.authenticator = start_authenticator(self.ctx, curve_dir)  # before bind: no peer slips in
        self.frontend = self._router(frontend, "client")
        self.backend = self._router(backend, "worker")
        # The endpoints actually bound (a tcp port of 0 or "*" becomes a real port).
        self.frontend_endpoint = self.frontend.getsockopt_string(zmq.LAST_ENDPOINT)
        self.backend_endpoint = self.backend.getsockopt_string(zmq.LAST_ENDPOINT)

        self.workers: dict[bytes, Worker] = {}
        self.queue: deque[Request] = deque()  # requests waiting for any worker
        self.requests: dict[str, Request] = {}  # key -> every request not yet answered or still on a worker
        self.by_client: dict[tuple[bytes, str], str] = {}  # (client, client_id) -> key, until answered
        self.next_key = 0
        # Request keys carry this broker's incarnation, so a late reply from a worker that served
        # a previous broker on the same endpoint can never be taken for one of ours.
        self.instance = os.urandom(4).hex()
        self.next_heartbeat = time.monotonic() + heartbeat_interval
        self.stopping = False
        self.stop_requested = threading.Event()
        self.refresh_gauges()

    def _router(self, endpoint: str, role: str) -> zmq.Socket:
        """A ROUTER on `endpoint` for peers of `role` ("client" or "worker"; with CURVE only that role's keys)."""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.linger = 0
        # A hard cap far above the protocol limit: the protocol limit gets a polite
        # "too_large" reply; beyond this ZeroMQ drops the peer to protect memory.
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes * 4 + 4096)
        # Never drop queued replies for a slow reader: a dropped final reply would break
        # the one-final-reply promise. Output per request is bounded by max_tokens.
        sock.sndhwm = 0
        sock.rcvhwm = 0
        # A worker that reconnects keeps its identity (its handle ids name it): let the new
        # connection take the identity over instead of being refused as a duplicate.
        sock.router_handover = 1
        if self.curve_dir is not None:
            from broker.security import make_server

            make_server(sock, self.curve_dir, role)
        sock.bind(endpoint)
        return sock

    # ------------------------------------------------------------------ main loop

    def run(self) -> None:
        """Serve until stop() is called (or SIGTERM/SIGINT when installed), then drain and close."""
        # debug: `tinyloop broker` or `serve` prints the endpoints once, for the user
        log.debug("broker listening: clients %s, workers %s", self.frontend_endpoint, self.backend_endpoint)
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        drain_deadline = float("inf")  # set when the shutdown begins
        while True:
            if self.stop_requested.is_set() and not self.stopping:
                self.begin_shutdown()
                drain_deadline = time.monotonic() + self.drain_timeout_s
            if self.stopping and (not self.requests or time.monotonic() > drain_deadline):
                break
            timeout_ms = max(1, int(min(self.heartbeat_interval, 0.05) * 1000))
            events = dict(poller.poll(timeout_ms))
            # Drain a batch from each socket per wakeup: cheaper than one poll per message.
            if self.backend in events:
                for _ in range(256):
                    try:
                        frames = self.backend.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    self.on_worker_frames(frames)
            if self.frontend in events:
                for _ in range(256):
                    try:
                        frames = self.frontend.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    self.on_client_frames(frames)
            self.tick(time.monotonic())
        self.finish_shutdown()

    def stop(self) -> None:
        """Ask the loop to drain and exit (thread-safe)."""
        self.stop_requested.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def tick(self, now: float) -> None:
        """Timers: heartbeats, dead workers, deadlines; then hand out queued work."""
        if now >= self.next_heartbeat:
            for identity in list(self.workers):
                self.send_worker(identity, "heartbeat")
            self.next_heartbeat = now + self.heartbeat_interval
            for identity, worker in list(self.workers.items()):
                if now > worker.expires_at:
                    log.warning("worker %s (pid %d) stopped heartbeating; dropping it", worker.name, worker.pid)
                    self.metrics.workers_lost.inc()
                    self.drop_worker(identity, "stopped heartbeating")
        self.expire_deadlines(now)
        self.dispatch()
        self.refresh_gauges()

    # ------------------------------------------------------------------ clients

    def on_client_frames(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return  # not even an identity and one frame; nobody to answer
        client, payload = frames[0], frames[1:]
        try:
            msg = protocol.decode(CLIENT_TO_BROKER, payload, self.max_message_bytes)
        except ProtocolError as err:
            self.metrics.errors.labels(err.code).inc()
            self.send_client(client, "error", id=err.request_id, code=err.code, message=err.message)
            return
        if msg.type == "request":
            self.on_request(client, msg)
        elif msg.type == "cancel":
            self.on_cancel(client, msg["id"])
        elif msg.type == "status":
            self.send_client(client, "status_reply", id=msg["id"], status=self.status())

    def on_request(self, client: bytes, msg: protocol.Message) -> None:
        client_id = msg["id"]
        now = time.monotonic()
        received = msg.get("received")  # present: a Lazy Pirate re-send of a request the client may have lost
        if received is not None and self.on_resend(client, client_id, received):
            return
        if self.stopping:
            return self.reject(client, client_id, Codes.SHUTTING_DOWN, "the broker is shutting down")
        if (client, client_id) in self.by_client:
            return self.reject(client, client_id, Codes.DUPLICATE_ID, f"request id {client_id!r} is already in flight")
        waiting = len(self.queue) + sum(len(w.pinned_queue) for w in self.workers.values())
        # A re-send was admitted by a previous broker already: a restart must not turn it into "busy".
        if waiting >= self.max_queue and received is None:
            return self.reject(client, client_id, Codes.BUSY, f"queue is full ({self.max_queue} requests waiting)")
        timeout = msg.get("timeout_s") or self.default_timeout_s
        self.next_key += 1
        req = Request(
            key=f"{self.instance}-{self.next_key}",
            client=client,
            client_id=client_id,
            op=msg["op"],
            params=msg["params"],
            stream=msg["stream"],
            arrived=now,
            deadline=now + timeout,
        )
        prompt = req.params.get("prompt")
        if self.affinity and req.op in PREFIX_OPS and isinstance(prompt, (str, list)):
            req.digests = protocol.prefix_digests(prompt)
        if received:
            # The client holds part of the answer from a previous broker: continue after it, or say why not.
            req.delivered, req.texts = list(received), [""] * len(received)
            if not self.continuable(req):
                self.requests[req.key] = req
                return self.answer_error(req, Codes.WORKER_LOST, f"the broker restarted after {len(received)} token(s) "
                                         f"were streamed and this request ({self.why_not_continuable(req)}) cannot be "
                                         "continued without duplicating output")
        if req.op in protocol.HANDLE_OPS:
            # Handle ids are "<worker identity>:<n>", so the owner is known without a lookup table.
            owner = req.params["handle"].rpartition(":")[0].encode()
            worker = self.workers.get(owner)
            if worker is None or worker.leaving:
                return self.reject(
                    client,
                    client_id,
                    Codes.HANDLE_UNKNOWN,
                    f"handle {req.params['handle']!r} is not held by any live worker (its worker is gone or it never existed)",
                )
            req.pinned = owner
            worker.pinned_queue.append(req)
        else:
            self.queue.append(req)
        self.requests[req.key] = req
        self.by_client[(client, client_id)] = req.key
        self.dispatch()

    def on_resend(self, client: bytes, client_id: str, received: list) -> bool:
        """Attach a re-sent request to what this broker knows of it; False when it knows nothing."""
        key = self.by_client.get((client, client_id))
        if key is not None:
            req = self.requests[key]
            for i in range(len(received), len(req.delivered)):  # tokens lost in transit
                self.send_client(client, "token", id=client_id, token=req.delivered[i], pos=i, text=req.texts[i])
            return True
        old = self.answered_recently.get((client, client_id))
        if old is None:
            return False
        for token, pos, text in old.tokens[len(received):]:
            self.send_client(client, "token", id=client_id, token=token, pos=pos, text=text)
        self.send_client(client, old.msg_type, **old.fields)
        return True

    @staticmethod
    def why_not_continuable(req: Request) -> str:
        """What keeps a streamed request from being continued elsewhere; "" when it can be (the worker still
        refuses modes it cannot continue exactly, such as early exit)."""
        if req.op not in CONTINUABLE_OPS:
            return f"op {req.op!r}"
        return "beam search" if req.params.get("beam_size", 1) > 1 else ""

    def continuable(self, req: Request) -> bool:
        return not self.why_not_continuable(req)

    def may_retry(self, req: Request) -> bool:
        """Whether a request its worker failed through no fault of its own runs again: attempts left, not cancelled,
        not tied to its worker's handle, and nothing streamed that another run could not continue."""
        return req.attempts < self.max_attempts and not req.cancelled and req.pinned is None and \
            (not req.delivered or self.continuable(req))

    def on_cancel(self, client: bytes, client_id: str) -> None:
        key = self.by_client.get((client, client_id))
        if key is None:
            return  # already answered or never seen: nothing to do, and no reply (the request had its one)
        req = self.requests[key]
        req.cancelled = True
        if req.worker is None:
            self.unqueue(req)
            self.answer_error(req, Codes.CANCELLED, "cancelled by the client before it started")
        else:
            # The worker stops decoding and replies "done" with stop_reason "cancelled".
            self.send_worker(req.worker, "cancel", id=req.dispatch_id)

    def reject(self, client: bytes, client_id: str, code: str, message: str) -> None:
        self.metrics.errors.labels(code).inc()
        self.send_client(client, "error", id=client_id, code=code, message=message)

    # ------------------------------------------------------------------ workers

    def on_worker_frames(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        identity, payload = frames[0], frames[1:]
        try:
            msg = protocol.decode(WORKER_TO_BROKER, payload, self.max_message_bytes * 4)
        except ProtocolError as err:
            # A worker speaking garbage is a bug on our side; log it, keep serving.
            log.error("bad message from worker %r: %s: %s", identity, err.code, err.message)
            return
        worker = self.workers.get(identity)
        if msg.type == "ready":
            self.told_reconnect.pop(identity, None)
            return self.on_ready(identity, msg)
        if worker is None:
            # Unknown worker (e.g. this broker restarted, or it was dropped as dead): make it re-announce. Once per
            # heartbeat: a worker streaming tokens would otherwise get one "reconnect" per token, and each extra
            # re-announcement would cost it the request it got meanwhile.
            now = time.monotonic()
            if now - self.told_reconnect.get(identity, 0.0) > self.heartbeat_interval:
                self.told_reconnect[identity] = now
                self.send_worker(identity, "reconnect")
            if len(self.told_reconnect) > 4096:  # identities that never came back
                self.told_reconnect.clear()
            return
        worker.expires_at = time.monotonic() + self.heartbeat_expiry
        if msg.type == "heartbeat":
            worker.handles = msg["handles"]
            worker.free_blocks, worker.lanes = msg.get("free_blocks"), msg.get("lanes", 0)
            worker.total_blocks, worker.used_blocks = msg.get("total_blocks", 0), msg.get("used_blocks", 0)
            if "prefixes" in msg.fields:
                worker.prefixes, worker.recent = frozenset(msg["prefixes"]), set()
        elif msg.type == "token":
            self.on_worker_token(worker, msg)
        elif msg.type == "tokens":  # one step of a worker's batch: each client gets its share in one message
            batches: dict[bytes, list[list]] = {}
            for token in protocol.unbatch(msg):
                self.on_worker_token(worker, token, batches)
            for client, items in batches.items():
                if len(items) == 1:
                    self.send_client(client, "token", **dict(zip(protocol.TOKEN_FIELDS, items[0])))
                else:
                    self.send_client(client, "tokens", items=items)
        elif msg.type in ("done", "error"):
            self.on_worker_final(worker, msg)
        elif msg.type == "goodbye":
            log.info("worker %s is leaving", worker.name)
            worker.leaving = True
            if not worker.running:
                self.drop_worker(identity, "left")

    def on_ready(self, identity: bytes, msg: protocol.Message) -> None:
        reasons = []
        if self.max_worker_plan_bytes is not None and msg["plan_bytes"] > self.max_worker_plan_bytes:
            reasons.append(
                f"memory plan of {msg['plan_bytes']} bytes exceeds the broker's per-worker limit of {self.max_worker_plan_bytes} bytes"
            )
        if self.max_handles_per_worker is not None and msg["max_handles"] > self.max_handles_per_worker:
            reasons.append(
                f"handle cap {msg['max_handles']} exceeds the broker's per-worker limit of {self.max_handles_per_worker}"
            )
        if reasons:
            log.error("refusing worker %s: %s", msg["name"], "; ".join(reasons))
            self.send_worker(identity, "refused", reason="; ".join(reasons))
            return
        if identity in self.workers:
            self.drop_worker(identity, "announced ready again")
        self.workers[identity] = Worker(
            identity=identity,
            name=msg["name"],
            pid=msg["pid"],
            ops=msg["ops"],
            plan_bytes=msg["plan_bytes"],
            max_handles=msg["max_handles"],
            device=msg["device"],
            model=msg["model"],
            expires_at=time.monotonic() + self.heartbeat_expiry,
            slots=msg.get("slots") or 1,
        )
        log.info("worker %s ready (pid %d, %s, plan %d bytes)", msg["name"], msg["pid"], msg["device"], msg["plan_bytes"])
        self.dispatch()

    def current_request(self, worker: Worker, dispatch_id: str) -> Request | None:
        """The request a worker's message is about, if it is the attempt running there now."""
        req = self.requests.get(dispatch_id.rpartition(".")[0])
        if req is None or req.worker != worker.identity or req.dispatch_id != dispatch_id:
            return None
        return req

    def on_worker_token(self, worker: Worker, msg: protocol.Message, batches: dict[bytes, list] | None = None) -> None:
        """Forward a streamed token to its client; with `batches`, a client that reads "tokens" messages gets it
        appended there instead ([id, token, pos, text]), to be sent with the step's other tokens."""
        req = self.current_request(worker, msg["id"])
        if req is None:
            # Work nobody waits for here (an earlier attempt, or a previous broker's request): stop it.
            self.send_worker(worker.identity, "cancel", id=msg["id"])
            return
        if req.answered:
            return  # late token of a request that was already answered
        if msg["pos"] != len(req.delivered):
            return  # not the next token (a continuation restates nothing): the client never sees one twice
        now = time.monotonic()
        if req.first_token_at is None:
            req.first_token_at = now
            self.metrics.ttft.observe(now - req.arrived)
        req.delivered.append(msg["token"])
        req.texts.append(msg["text"])
        if not req.stream:
            return
        if batches is not None and req.client.startswith(protocol.TOKENS_CLIENT):
            batches.setdefault(req.client, []).append([req.client_id, msg["token"], msg["pos"], msg["text"]])
        else:
            self.send_client(req.client, "token", id=req.client_id, token=msg["token"], pos=msg["pos"], text=msg["text"])

    def on_worker_final(self, worker: Worker, msg: protocol.Message) -> None:
        req = self.current_request(worker, msg["id"])
        if req is None:
            return
        worker.running.discard(req.key)
        worker.served += 1
        self.unassign(worker, req)
        del self.requests[req.key]
        if worker.leaving and not worker.running:
            self.drop_worker(worker.identity, "left")
        if req.answered:
            return  # its deadline passed earlier; the client already has its error reply
        if msg.type == "done":
            result = dict(msg["result"])
            result.setdefault("worker", worker.name)
            self.answer_done(req, result)
        elif msg["code"] == Codes.SHUTTING_DOWN and not req.delivered and not req.cancelled:
            # The worker began shutting down as this request reached it: give it to another worker.
            self.requeue(req)
        elif msg["code"] == Codes.FORWARD_FAILED and self.may_retry(req):
            # A forward it shared with others failed on the worker, not through anything in the request: run it again
            # (a stream continues after the tokens delivered), up to --max-attempts in all.
            log.warning("retrying request %s after a failed forward on %s (attempt %d of %d)", req.client_id,
                        worker.name, req.attempts, self.max_attempts)
            self.metrics.retries.inc()
            self.requeue(req)
        else:
            self.answer_error(req, msg["code"], msg["message"])

    @staticmethod
    def unassign(worker: Worker, req: Request) -> None:
        """A request left the worker: its prompt's prefix is cached there now (until the next heartbeat says)."""
        for d in req.digests:
            n = worker.assigned.pop(d, 0) - 1
            if n > 0:
                worker.assigned[d] = n
            worker.recent.add(d)

    def drop_worker(self, identity: bytes, why: str) -> None:
        """Forget a worker; settle its running and pinned requests so each still gets one reply."""
        worker = self.workers.pop(identity, None)
        if worker is None:
            return
        for key in worker.running:
            req = self.requests.get(key)
            if req is not None:
                req.worker = None
                if req.answered:
                    del self.requests[req.key]
                elif req.cancelled:
                    self.answer_error(req, Codes.CANCELLED, "cancelled by the client; its worker then died")
                elif req.pinned is not None:
                    self.answer_error(req, Codes.HANDLE_UNKNOWN, f"the worker holding handle {req.params['handle']!r} died ({why})")
                elif req.attempts >= self.max_attempts:
                    self.answer_error(req, Codes.WORKER_LOST, f"worker {worker.name} died ({why}); the request "
                                      f"already lost {req.attempts} worker(s), the most it may")
                elif not req.delivered or self.continuable(req):
                    # Nothing streamed: run it again. Tokens streamed: the next worker continues after them.
                    log.warning("re-queueing request %s from lost worker %s (%d token(s) delivered)", req.client_id,
                                worker.name, len(req.delivered))
                    self.metrics.retries.inc()
                    self.requeue(req)
                else:
                    self.answer_error(
                        req,
                        Codes.WORKER_LOST,
                        f"worker {worker.name} died ({why}) after streaming {len(req.delivered)} token(s); "
                        f"this request ({self.why_not_continuable(req)}) cannot be continued without duplicating output",
                    )
        while worker.pinned_queue:
            req = worker.pinned_queue.popleft()
            self.answer_error(req, Codes.HANDLE_UNKNOWN, f"the worker holding handle {req.params['handle']!r} is gone ({why})")

    # ------------------------------------------------------------------ scheduling

    def dispatch(self) -> None:
        """Give waiting requests to workers with a free slot: a worker's pinned work (its handles) first, then the
        shared queue, where `pick` chooses which request goes to which worker."""
        while True:
            # least loaded first, least recently given a request among equals
            free = sorted((w for w in self.workers.values() if not w.leaving and len(w.running) < w.slots),
                          key=lambda w: (len(w.running) / w.slots, w.last_start))
            pinned = next((w for w in free if w.pinned_queue), None)
            if pinned is not None:
                self.start(pinned, pinned.pinned_queue.popleft())
                continue
            chosen = self.pick(free) if free and self.queue else None
            if chosen is None:
                return
            worker, req = chosen
            self.queue.remove(req)
            self.start(worker, req)

    def pick(self, free: list[Worker]) -> tuple[Worker, Request] | None:
        """Which queued request goes to which free worker (None: leave the free workers idle for now).

        Without affinity: the oldest request to the least recently used worker. With it, among the first
        AFFINITY_WINDOW requests: the pair where a free worker holds the request's prompt prefix deepest (oldest
        request, least recently used worker among equals). Failing that, the oldest request no busy worker holds, or
        one whose holder is overloaded (more than one request waits for it), goes to the least recently used free
        worker; a request whose busy holder is not overloaded waits for it, at most `affinity_wait_s`."""
        head = self.queue[0]
        now = time.monotonic()
        if not self.affinity or head.passed_over >= AFFINITY_WINDOW or now - head.arrived > self.affinity_wait_s:
            return free[0], head
        window = list(itertools.islice(self.queue, AFFINITY_WINDOW))
        pairs = [(w.holds(r.digests) if r.digests else 0, w, r) for r in window for w in free]
        depth, worker, best = max(pairs, key=lambda p: p[0])  # the first of equals: oldest request, LRU worker
        req: Request | None = best
        if not depth:
            worker, req = free[0], None
            free_ids = {w.identity for w in free}
            busy = [w for w in self.workers.values() if w.identity not in free_ids and not w.leaving]
            backlog: dict[bytes, int] = {}
            for r in window:
                holder = max(busy, key=lambda w: w.holds(r.digests), default=None) if r.digests else None
                if holder is None or not holder.holds(r.digests):
                    req = r  # nobody holds it
                    break
                backlog[holder.identity] = backlog.get(holder.identity, 0) + 1
                if backlog[holder.identity] > 1 or now - r.arrived > self.affinity_wait_s:
                    req = r  # its holder is overloaded, or kept it waiting long enough
                    break
            if req is None:
                return None
        for r in window:
            if r is req:
                break
            r.passed_over += 1
        self.metrics.routed.labels("affinity" if depth else "least_loaded").inc()
        assert req is not None  # (the affinity pick, or the one chosen above)
        return worker, req

    def start(self, worker: Worker, req: Request) -> None:
        now = time.monotonic()
        req.worker = worker.identity
        req.attempts += 1
        req.dispatched_at = now
        req.dispatch_id = f"{req.key}.{req.attempts}"
        worker.running.add(req.key)
        worker.last_start = now
        for d in req.digests:  # it will hold this prompt's prefix: route its followers here before the next heartbeat
            worker.assigned[d] = worker.assigned.get(d, 0) + 1
        self.metrics.queue_wait.observe(now - req.arrived)
        continuation = {"delivered": req.delivered} if req.delivered else {}
        self.send_worker(
            worker.identity,
            "request",
            id=req.dispatch_id,
            op=req.op,
            params=req.params,
            stream=req.stream,
            timeout_s=max(0.0, req.deadline - now),
            queued_s=min(max(0.0, now - req.arrived), protocol.MAX_TIMEOUT_S),
            backlog_s=min(max(0.0, now - self.queue[0].arrived), protocol.MAX_TIMEOUT_S) if self.queue else 0.0,
            **continuation,
        )

    def requeue(self, req: Request) -> None:
        req.worker = None
        req.first_token_at = None
        self.requests[req.key] = req
        self.queue.appendleft(req)  # it already waited once: put it first

    def unqueue(self, req: Request) -> None:
        if req.pinned is None:
            queue = self.queue
        elif req.pinned in self.workers:
            queue = self.workers[req.pinned].pinned_queue
        else:
            return
        try:
            queue.remove(req)
        except ValueError:
            pass

    def expire_deadlines(self, now: float) -> None:
        for req in list(self.requests.values()):
            if req.answered or now < req.deadline:
                continue
            if req.worker is None:
                self.unqueue(req)
            else:
                # Stop the decode; the worker's late final reply will be dropped.
                self.send_worker(req.worker, "cancel", id=req.dispatch_id)
            waited = now - req.arrived
            self.answer_error(req, Codes.TIMEOUT, f"deadline of {req.deadline - req.arrived:.3f}s passed after {waited:.3f}s")

    # ------------------------------------------------------------------ replies

    def answer_done(self, req: Request, result: dict) -> None:
        self.finish(req, "done", {"id": req.client_id, "result": result})
        stats = result.get("stats") if isinstance(result.get("stats"), dict) else {}
        self.metrics.requests.labels(req.op, "done").inc()
        now = time.monotonic()
        self.metrics.latency.observe(now - req.arrived)
        if stats:
            generated = stats.get("generated_tokens") or 0
            self.metrics.output_tokens.inc(generated)
            self.metrics.prompt_tokens.inc(stats.get("prompt_tokens") or 0)
            self.metrics.prefix_hit_tokens.inc(stats.get("prefix_hit_tokens") or 0)
            if stats.get("stop_reason"):
                self.metrics.stop_reasons.labels(str(stats["stop_reason"])).inc()
            if req.first_token_at is None and stats.get("first_token_ms") is not None and req.dispatched_at:
                self.metrics.ttft.observe(req.dispatched_at - req.arrived + stats["first_token_ms"] / 1000)
            if generated > 1 and stats.get("decode_ms") is not None:
                self.metrics.tpot.observe(stats["decode_ms"] / 1000 / (generated - 1))
            self.metrics.depth(stats)
        # counted before the reply goes out: a client that reads /metrics on its answer finds its request there
        self.send_client(req.client, "done", id=req.client_id, result=result)
        self.log_request(req, "done", result.get("worker"), stats=stats)

    def answer_error(self, req: Request, code: str, message: str) -> None:
        self.finish(req, "error", {"id": req.client_id, "code": code, "message": message})
        self.metrics.requests.labels(req.op, "error").inc()
        self.metrics.errors.labels(code).inc()
        self.send_client(req.client, "error", id=req.client_id, code=code, message=message)  # after counting it
        worker = self.workers.get(req.worker) if req.worker else None
        self.log_request(req, "error", worker.name if worker else None, code=code, message=message)

    def finish(self, req: Request, msg_type: str, fields: dict) -> None:
        assert not req.answered, "a request must get exactly one final reply"
        req.answered = True
        self.by_client.pop((req.client, req.client_id), None)
        if req.worker is None:
            self.requests.pop(req.key, None)  # on a worker it stays tracked until the worker is free
        now = time.monotonic()
        tokens = list(zip(req.delivered, range(len(req.delivered)), req.texts)) if req.stream else []
        self.answered_recently[(req.client, req.client_id)] = Answered(tokens, msg_type, fields, now)
        self.answered_recently.move_to_end((req.client, req.client_id))
        while self.answered_recently and (len(self.answered_recently) > ANSWERED_KEEP
                                          or next(iter(self.answered_recently.values())).at < now - ANSWERED_TTL_S):
            self.answered_recently.popitem(last=False)
        if not self.outcomes or self.outcomes[-1][0] != int(now):
            self.outcomes.append([int(now), 0, {}])
        bucket = self.outcomes[-1]
        bucket[1] += 1
        if self.is_service_fault(req, fields.get("code")):
            bucket[2][fields["code"]] = bucket[2].get(fields["code"], 0) + 1

    def is_service_fault(self, req: Request, code: str | None) -> bool:
        """Did the service fail this request (readiness counts it), rather than the client ask for what it got?"""
        if code == Codes.TIMEOUT:
            return req.deadline - req.arrived >= self.ready_min_deadline_s
        return code in SERVICE_FAULT_CODES

    def log_request(self, req: Request, outcome: str, worker: str | None, **extra: Any) -> None:
        now = time.monotonic()
        line = {
            "event": "request",
            "id": req.client_id,
            "op": req.op,
            "outcome": outcome,
            "worker": worker,
            "attempts": req.attempts,
            "queue_ms": round(((req.dispatched_at or now) - req.arrived) * 1000, 3),
            "latency_ms": round((now - req.arrived) * 1000, 3),
            **extra,
        }
        request_log.info(json.dumps(line, default=str))

    # ------------------------------------------------------------------ sending

    def send_client(self, client: bytes, msg_type: str, **fields: Any) -> None:
        self.frontend.send_multipart([client, *protocol.encode(BROKER_TO_CLIENT, msg_type, **fields)])

    def send_worker(self, identity: bytes, msg_type: str, **fields: Any) -> None:
        self.backend.send_multipart([identity, *protocol.encode(BROKER_TO_WORKER, msg_type, **fields)])

    # ------------------------------------------------------------------ status and shutdown

    def status(self) -> dict:
        now = time.monotonic()
        workers = []
        for w in self.workers.values():
            current = [self.requests[k] for k in w.running if k in self.requests]
            workers.append(
                {
                    "name": w.name,
                    "pid": w.pid,
                    "device": w.device,
                    "model": w.model,
                    "state": "leaving" if w.leaving else ("busy" if w.running else "idle"),
                    "running": len(w.running),
                    "slots": w.slots,
                    "current_op": current[0].op if current else None,
                    "streamed": sum(len(r.delivered) for r in current),  # tokens its running requests streamed
                    "handles": w.handles,
                    "max_handles": w.max_handles,
                    "free_blocks": w.free_blocks,
                    "lanes": w.lanes,
                    "cached_prefixes": len(w.prefixes),
                    "plan_bytes": w.plan_bytes,
                    "served": w.served,
                    "waiting_for_handles": len(w.pinned_queue),
                    "ops": list(w.ops),
                }
            )
        return {
            "workers": workers,
            "queue": len(self.queue) + sum(len(w.pinned_queue) for w in self.workers.values()),
            "max_queue": self.max_queue,
            "in_flight": sum(len(w.running) for w in self.workers.values()),
            "uptime_s": round(now - self.started, 3),
            "stopping": self.stopping,
            "frontend": self.frontend_endpoint,
            "backend": self.backend_endpoint,
            "pid": os.getpid(),
            "instance": self.instance,
            "ready": self.readiness(now),
        }

    def readiness(self, now: float) -> dict:
        """Can the service serve now? `problems` names every reason it cannot (empty when ready)."""
        while self.outcomes and self.outcomes[0][0] < now - self.ready_window_s:
            self.outcomes.popleft()
        queued = len(self.queue) + sum(len(w.pinned_queue) for w in self.workers.values())
        ready_workers = sum(1 for w in self.workers.values() if not w.leaving)
        faults: dict[str, int] = {}
        for _, _, codes in self.outcomes:
            for code, n in codes.items():
                faults[code] = faults.get(code, 0) + n
        finished = sum(bucket[1] for bucket in self.outcomes)
        rate = sum(faults.values()) / finished if finished else 0.0
        problems = []
        if self.stopping:
            problems.append("the broker is shutting down")
        if ready_workers == 0:
            problems.append("no ready workers")
        if queued >= self.max_queue:
            problems.append(f"the queue is full ({queued} of {self.max_queue} waiting)")
        if finished >= READY_MIN_SAMPLES and rate >= self.ready_max_error_rate:
            detail = ", ".join(f"{n} {code}" for code, n in sorted(faults.items()))
            problems.append(f"{rate:.0%} of the last {finished} requests failed ({detail}) in the last "
                            f"{self.ready_window_s:.0f}s; the limit is {self.ready_max_error_rate:.0%}")
        return {"ready": not problems, "problems": problems, "ready_workers": ready_workers, "queue": queued,
                "max_queue": self.max_queue, "error_rate": round(rate, 4), "finished": finished,
                "window_s": self.ready_window_s}

    def refresh_gauges(self) -> None:
        now = time.monotonic()
        readiness = self.readiness(now)
        self.metrics.queue_depth.set(readiness["queue"])
        self.metrics.ready_workers.set(readiness["ready_workers"])
        self.metrics.busy_workers.set(sum(1 for w in self.workers.values() if w.running))
        self.metrics.live_handles.set(sum(w.handles for w in self.workers.values()))
        self.metrics.engine_gauges(readiness["queue"], self.workers.values())
        # Replaced whole (the HTTP thread reads it); `at` lets /healthz see a stalled loop.
        self.metrics.health = {"at": now, "uptime_s": round(now - self.started, 3), "instance": self.instance,
                               "readiness": readiness}

    def begin_shutdown(self) -> None:
        """Stop taking work: queued requests fail with "shutting_down", running ones may finish."""
        log.info("broker shutting down: %d queued request(s) refused, waiting for running ones", len(self.queue))
        self.stopping = True
        for req in list(self.queue):
            self.queue.remove(req)
            self.answer_error(req, Codes.SHUTTING_DOWN, "the broker is shutting down")
        for worker in self.workers.values():
            while worker.pinned_queue:
                self.answer_error(worker.pinned_queue.popleft(), Codes.SHUTTING_DOWN, "the broker is shutting down")

    def finish_shutdown(self) -> None:
        for req in list(self.requests.values()):
            if not req.answered:
                if req.worker is not None:
                    self.send_worker(req.worker, "cancel", id=req.dispatch_id)
                self.answer_error(req, Codes.SHUTTING_DOWN, "the broker shut down before the request finished")
        self.requests.clear()
        self.frontend.close(linger=1000)  # give the last replies a moment to leave
        self.backend.close(linger=100)
        if self.authenticator is not None:
            self.authenticator.stop()
        log.info("broker stopped")
