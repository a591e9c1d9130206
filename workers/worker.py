"""The worker process's messaging side: talks to the broker, runs requests on an engine.

Two threads, because a generation may take seconds and heartbeats must not wait for it:

* the I/O thread (started by WorkerProcess.run) owns the DEALER socket to the broker:
  it sends "ready" and heartbeats, receives requests and cancels, and forwards whatever
  the compute thread produced. It reconnects when the broker goes quiet (Paranoid Pirate).
  It sleeps in a poll between messages and never runs torch, so it takes no core from the compute.
* the compute thread (the caller of WorkerProcess.run, the thread that loaded the model: see `run`
  for why) drives the engine and hands its token/done/error messages to the I/O
  thread over an inproc socket (ZeroMQ sockets must not be shared between threads). An engine
  with a scheduler (`join` / `step`: workers/engine.py) batches requests continuously: between
  two steps the thread takes the requests that arrived, and a request joins the running batch
  at the next step and leaves it when done. What the batch does not take (`join` says no: the
  handle ops, a continuation with nothing left to generate) runs between two steps (`run`). An
  engine without a scheduler runs one request at a time (`run`).

Cancellation and deadlines reach the decode through `should_stop`, which the engine checks
before each step and from the runtime's on_token callback.

This module does not import torch; the engine (workers/engine.py) does.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, cast

import zmq

from broker import protocol
from broker.protocol import BROKER_TO_WORKER, WORKER_TO_BROKER, Codes, ProtocolError, WorkerExit
from workers.handle_registry import EngineError

log = logging.getLogger("tinyloop.worker")

# What a message emitted by the compute thread for a token looks like to the engine.
TokenSink = Callable[[int, int, str], None]


class Engine(Protocol):
    """What the worker runs requests on (workers/engine.py: the real model)."""

    ops: list[str]
    plan_bytes: int
    max_handles: int
    device: str
    model_name: str

    def run(self, op: str, params: dict, on_token: TokenSink | None, should_stop: Callable[[], bool],
            delivered: list[int] | None = None) -> dict:
        """Run one op. `delivered` (a continuation): tokens the client already has; generate what follows them,
        streaming positions from len(delivered) on, and return the whole answer (delivered tokens included)."""
        ...

    def live_handles(self) -> int: ...


class Batching(Protocol):
    """An engine that batches continuously (workers/engine.py); `slots`: the requests it runs at once."""

    slots: int

    def join(self, key: str, op: str, params: dict, on_token: TokenSink | None, should_stop: Callable[[], bool],
             delivered: list[int] | None = None, queued_s: float = 0.0, backlog_s: float = 0.0) -> bool:
        """Add a request to the batch (False: it must run alone, through `run`). Raises EngineError for a bad one.
        queued_s: the seconds it has waited so far (broker queue included); backlog_s: the age of the oldest request
        still in the broker's queue when it was sent."""
        ...

    def step(self) -> list[tuple[str, dict | EngineError]]:
        """One scheduling iteration; (key, result or error) of the requests that finished in it."""
        ...

    def idle(self) -> bool: ...


@dataclass
class Job:
    key: str
    op: str
    params: dict
    stream: bool
    deadline: float | None
    delivered: list[int] | None = None  # a continuation of a stream whose worker was lost
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_s: float = 0.0  # seconds it waited in the broker's queue before it was sent here
    backlog_s: float = 0.0  # the age of the oldest request left in the broker's queue when it was sent
    received: float = field(default_factory=time.perf_counter)  # when it reached this worker

    def waited(self) -> float:
        """Seconds since it reached the broker (its queue there, and here until now)."""
        return self.queued_s + time.perf_counter() - self.received

    def should_stop(self) -> bool:
        return self.cancelled.is_set() or (self.deadline is not None and time.monotonic() > self.deadline)


class WorkerProcess:
    def __init__(
        self,
        engine: Engine,
        endpoint: str,
        *,
        name: str = "worker",
        heartbeat_interval: float = 1.0,
        heartbeat_liveness: int = 3,
        reconnect_max_s: float = 8.0,
        drain_timeout_s: float = 30.0,
        curve_dir: str | None = None,
        context: zmq.Context | None = None,
    ):
        self.engine = engine
        self.endpoint = endpoint
        self.name = name
        # The identity carries a random incarnation, so handle ids of a restarted worker never
        # collide with those of its previous life.
        self.identity = f"{name}-{uuid.uuid4().hex[:8]}"
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_expiry = heartbeat_interval * heartbeat_liveness
        self.reconnect_max_s = reconnect_max_s
        self.drain_timeout_s = drain_timeout_s
        self.curve_dir = curve_dir
        self.ctx = context or zmq.Context.instance()
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.running: dict[str, Job] = {}  # jobs accepted and not yet answered (guarded by the GIL; small)
        self.stop_requested = threading.Event()
        self.outbox_endpoint = f"inproc://worker-outbox-{uuid.uuid4().hex}"
        self.step_tokens: list[list] = []  # [key, token, pos, text] streamed in the batch step now running
        self.dealer: zmq.Socket | None = None
        self.last_ready_at = 0.0

    def run(self) -> int:
        """Serve until stopped; returns the exit code. The compute loop runs in the calling thread, the I/O loop
        beside it: the model was loaded in this thread, so its OpenMP thread pool is the only one in the process.
        libgomp spins between parallel regions only while the threads of all its pools fit the cores; a second
        pool (compute in a new thread beside the loader's) throttled it to ~100 spins, every region of a decode
        step then woke its threads through the kernel, and batch-1 decode ran 4-6x slower than `generate`."""
        outbox = self.ctx.socket(zmq.PULL)
        outbox.bind(self.outbox_endpoint)
        result: list[int] = []
        compute_done = threading.Event()
        io = threading.Thread(target=lambda: result.append(self.io_loop(outbox, compute_done)), name="io", daemon=True)
        io.start()
        try:
            self.compute_loop()  # returns once the I/O loop has ended; an engine bug propagates (the process exits)
        finally:
            compute_done.set()
        io.join()
        return result[0] if result else WorkerExit.OK

    # ------------------------------------------------------------------ I/O thread

    def io_loop(self, outbox: zmq.Socket, compute_done: threading.Event) -> int:
        self.connect()
        exit_code: int = WorkerExit.OK
        reconnect_delay = self.heartbeat_interval
        last_heard = time.monotonic()
        next_heartbeat = time.monotonic() + self.heartbeat_interval
        leaving_since: float | None = None
        poller: zmq.Poller | None = None
        poller_for: zmq.Socket | None = None
        while True:
            if self.stop_requested.is_set() and leaving_since is None:
                leaving_since = time.monotonic()
                log.info("worker %s stopping: finishing %d running request(s)", self.name, len(self.running))
                self.send("goodbye")
            if leaving_since is not None:
                if not self.running and not outbox.poll(0):
                    break
                if time.monotonic() - leaving_since > self.drain_timeout_s:
                    for job in list(self.running.values()):
                        job.cancelled.set()
            if poller_for is not self.dealer:  # (re)build the poller after a reconnect
                poller, poller_for = zmq.Poller(), self.dealer
                poller.register(self.dealer, zmq.POLLIN)
                poller.register(outbox, zmq.POLLIN)
            assert poller is not None and self.dealer is not None  # (connected, and polled since)
            events = dict(poller.poll(int(self.heartbeat_interval * 250)))
            if outbox in events:
                while True:
                    try:
                        frames = outbox.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.send_frames(frames)
            if self.dealer in events:
                while True:
                    try:
                        frames = self.dealer.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    last_heard = time.monotonic()
                    reconnect_delay = self.heartbeat_interval
                    code = self.on_broker_frames(frames)
                    if code is not None:
                        exit_code = code
                        self.stop_requested.set()
                        leaving_since = time.monotonic() - self.drain_timeout_s  # nothing to drain
            now = time.monotonic()
            if now >= next_heartbeat:
                cache_state: dict = getattr(self.engine, "cache_state", dict)()  # routing fields; an engine may have none
                self.send("heartbeat", handles=self.engine.live_handles(), lanes=len(self.running), **cache_state)
                next_heartbeat = now + self.heartbeat_interval
            if now - last_heard > self.heartbeat_expiry and leaving_since is None:
                # Paranoid Pirate: the broker went quiet. Reconnect with a growing back-off.
                log.warning("worker %s: broker silent for %.1fs, reconnecting in %.1fs", self.name, now - last_heard, reconnect_delay)
                self.abandon_running("the broker went silent")
                # Close the old socket first: were the link to return during the back-off, its pending connect would
                # deliver the queued "ready", and the broker would hand requests to a socket about to be replaced.
                self.dealer.close(linger=0)
                self.dealer = None
                time.sleep(reconnect_delay)
                reconnect_delay = min(reconnect_delay * 2, self.reconnect_max_s)
                self.connect()
                last_heard = time.monotonic()
        self.jobs.put(None)
        compute_done.wait(timeout=5)
        assert self.dealer is not None  # (connected)
        self.dealer.close(linger=1000)  # let the final replies and goodbye leave
        outbox.close(linger=0)
        return exit_code

    def connect(self) -> None:
        if self.dealer is not None:
            self.dealer.close(linger=0)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, self.identity.encode())
        self.dealer.linger = 0
        self.dealer.sndhwm = 0
        if self.curve_dir is not None:
            from broker.security import WORKER, make_client

            make_client(self.dealer, self.curve_dir, WORKER)  # the worker key: the backend admits no client key
        self.dealer.connect(self.endpoint)
        self.send_ready()

    def send_ready(self) -> None:
        self.last_ready_at = time.monotonic()
        self.send(
            "ready",
            name=self.name,
            pid=os.getpid(),
            ops=list(self.engine.ops),
            plan_bytes=int(self.engine.plan_bytes),
            max_handles=int(self.engine.max_handles),
            device=self.engine.device,
            model=self.engine.model_name,
            slots=int(getattr(self.engine, "slots", 1)),
        )

    def send(self, msg_type: str, **fields: Any) -> None:
        self.send_frames(protocol.encode(WORKER_TO_BROKER, msg_type, **fields))

    def send_frames(self, frames: list[bytes]) -> None:
        # Never block the I/O thread: with no connection at all (e.g. a CURVE handshake the broker
        # keeps refusing) a blocking send would stall heartbeats and reconnects. The broker treats
        # whatever is lost like a dead worker's work.
        assert self.dealer is not None  # (connected: the I/O loop sends only then)
        try:
            self.dealer.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("worker %s: no connection to the broker; dropped a message", self.name)

    def on_broker_frames(self, frames: list[bytes]) -> int | None:
        """Handle one broker message; returns an exit code when the worker must stop."""
        try:
            msg = protocol.decode(BROKER_TO_WORKER, frames, max_bytes=1 << 30)
        except ProtocolError as err:
            log.error("bad message from broker: %s: %s", err.code, err.message)
            return None
        if msg.type == "request":
            if self.stop_requested.is_set():
                # The broker re-queues this elsewhere (nothing was streamed).
                self.send("error", id=msg["id"], code=Codes.SHUTTING_DOWN, message=f"worker {self.name} is shutting down")
                return None
            timeout = msg["timeout_s"]
            job = Job(msg["id"], msg["op"], msg["params"], msg["stream"], None if timeout is None else time.monotonic() + timeout,
                      msg.get("delivered"), queued_s=msg.get("queued_s") or 0.0, backlog_s=msg.get("backlog_s") or 0.0)
            self.running[job.key] = job
            self.jobs.put(job)
        elif msg.type == "cancel":
            cancelled = self.running.get(msg["id"])
            if cancelled is not None:
                cancelled.cancelled.set()
        elif msg.type == "reconnect":
            if time.monotonic() - self.last_ready_at > self.heartbeat_interval:
                self.abandon_running("the broker does not know this worker")
                self.send_ready()
            # else: it answers a message sent before our "ready" reached the broker; the broker knows us now
        elif msg.type == "refused":
            log.error("worker %s refused by the broker: %s", self.name, msg["reason"])
            return WorkerExit.REFUSED_BY_BROKER
        return None  # heartbeats only refresh liveness

    def abandon_running(self, why: str) -> None:
        """Stop work no broker will take a reply for: the broker that sent it restarted, or wrote this worker
        off as dead and re-queued the work elsewhere. Frees the compute thread for new requests sooner."""
        if self.running:
            log.warning("worker %s: cancelling %d running request(s): %s", self.name, len(self.running), why)
        for job in list(self.running.values()):
            job.cancelled.set()

    def request_stop(self) -> None:
        self.stop_requested.set()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.request_stop())

    # ------------------------------------------------------------------ compute thread

    def compute_loop(self) -> None:
        out = self.ctx.socket(zmq.PUSH)
        out.sndhwm = 0
        out.connect(self.outbox_endpoint)

        def emit(msg_type: str, **fields: Any) -> None:
            out.send_multipart(protocol.encode(WORKER_TO_BROKER, msg_type, **fields))

        engine = cast(Batching, self.engine) if hasattr(self.engine, "step") else None  # (a batching engine)
        batching = engine is not None
        pending: deque[Job] = deque()  # arrived, not started: first come, first served
        while True:
            # Wait for work only when there is none; while a batch runs, take what arrived between two steps.
            waits = not pending and (engine is None or engine.idle())
            try:
                while True:
                    job = self.jobs.get(block=waits)
                    if job is None:
                        out.close(linger=1000)
                        return
                    pending.append(job)
                    waits = False
            except queue.Empty:
                pass
            while pending:
                job = pending[0]
                if job.op == "ping" or job.should_stop() or not batching or not self.join(job, emit):
                    self.run_alone(job, emit)  # between two steps: a handle op, a ping, an answer without work
                pending.popleft()
            if engine is not None and not engine.idle():
                finished = engine.step()
                if self.step_tokens:  # before the replies: a request's tokens come before its final message
                    emit("tokens", items=self.step_tokens)
                    self.step_tokens = []
                for key, outcome in finished:
                    self.reply(self.running.get(key), outcome, emit)

    def token_sink(self, job: Job, emit: Callable[..., None]) -> TokenSink | None:
        if not job.stream:
            return None
        key = job.key

        def sink(token: int, pos: int, text: str) -> None:
            emit("token", id=key, token=token, pos=pos, text=text)
        return sink

    def batch_sink(self, job: Job) -> TokenSink | None:
        """A batched job's tokens wait for the end of the step and leave in one "tokens" message with the other
        lanes' (compute_loop): one message per step instead of one per token, which cost the worker, the broker
        and the client ~20 % of the service's CPU at 8 lanes (docs/engine.md)."""
        if not job.stream:
            return None
        key = job.key

        def sink(token: int, pos: int, text: str) -> None:
            self.step_tokens.append([key, token, pos, text])
        return sink

    def join(self, job: Job, emit: Callable[..., None]) -> bool:
        """Add a job to the engine's batch; False when it must run alone. A rejected job is answered here."""
        try:
            continuation = {"delivered": job.delivered} if job.delivered else {}
            return cast(Batching, self.engine).join(job.key, job.op, job.params, self.batch_sink(job),
                                                    job.should_stop, queued_s=job.waited(), backlog_s=job.backlog_s,
                                                    **continuation)
        except Exception as exc:  # noqa: BLE001 (EngineError, or an engine bug: answered, never fatal)
            self.reply(job, exc, emit)
            return True

    def run_alone(self, job: Job, emit: Callable[..., None]) -> None:
        try:
            if job.should_stop():
                raise EngineError(Codes.TIMEOUT if not job.cancelled.is_set() else Codes.CANCELLED, "stopped before it started")
            if job.op == "ping":
                # Round trip through the worker without touching the model.
                result: dict | Exception = {"payload": job.params.get("payload", "")}
            else:
                continuation = {"delivered": job.delivered} if job.delivered else {}
                result = self.engine.run(job.op, job.params, self.token_sink(job, emit), job.should_stop, **continuation)
        except Exception as exc:  # noqa: BLE001
            result = exc
        self.reply(job, result, emit)

    def reply(self, job: Job | None, outcome: dict | Exception, emit: Callable[..., None]) -> None:
        """The one final message of a job: done, or error with a code."""
        if job is None:
            return
        try:
            if isinstance(outcome, Exception):
                raise outcome
            if not job.cancelled.is_set() and job.should_stop():
                # Stopped by its deadline: that is a timeout, whatever the engine made of it.
                raise EngineError(Codes.TIMEOUT, "the request's deadline passed on the worker")
            emit("done", id=job.key, result={**outcome, "worker": self.name})
        except EngineError as err:
            emit("error", id=job.key, code=err.code, message=err.message[: 1 << 13])
        except Exception as exc:  # an engine bug must not kill the worker; report it
            log.error("request %s (%s) failed", job.key, job.op, exc_info=exc)
            emit("error", id=job.key, code=Codes.RUNTIME_ERROR, message=f"{type(exc).__name__}: {exc}"[: 1 << 13])
        finally:
            self.running.pop(job.key, None)
