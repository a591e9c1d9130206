"""Client library for the TinyLoop service: a synchronous Client and an asyncio AsyncClient.

Meant for queue producers in other services: it needs only pyzmq and msgpack (importing it
never imports torch) and works from any host that can reach the broker's frontend endpoint.

    from broker.client import Client
    with Client("tcp://broker-host:5555") as client:
        reply = client.generate("def add(a, b):", max_tokens=32, timeout=30)
        print(reply.text, reply.stats["stop_reason"])

        with client.stream("import os", max_tokens=16) as stream:
            for token in stream:
                print(token.text, end="", flush=True)
        print(stream.result.stats)

Every call has a timeout. The deadline is sent to the broker, which expires the request
(and stops the decode on the worker); the client also stops waiting a little after it, in
case the broker itself is unreachable. Failures raise a subclass of ServiceError chosen by
the reply's error code.

Losing the broker costs latency, not answers (the Lazy Pirate pattern of the ZeroMQ guide):
the client notices a lost connection (the socket's disconnect event, or no answer to a probe
after `heartbeat * liveness` seconds of silence), opens a fresh socket under the same
identity and re-sends every request that has no final reply yet, under the same id and with
the tokens it already received, so a restarted broker continues streams where they broke
and a live one replays only what was lost. Token positions are checked on arrival, so a
token is never handed out twice. A client that has never heard from any broker, though, fails
its requests after `connect_timeout` (8 s) with a RequestTimeout naming the endpoint: a wrong
endpoint or a broker that is not running is said in seconds, not at each request's deadline.

A request that cannot be sent as it is (a field out of range, a string holding a lone
surrogate, a value msgpack cannot write) raises InvalidRequest before anything is sent.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from broker import protocol
from broker.protocol import BROKER_TO_CLIENT, CLIENT_TO_BROKER, Codes, ProtocolError

DEFAULT_TIMEOUT_S = 120.0
# Requests generate_batch keeps in flight: enough to fill every worker's batch lanes (2 workers x 16 by default),
# few enough that the broker's queue (64 by default) never answers "busy".
BATCH_WINDOW = 32
# How long past the request deadline the client waits for the broker's own timeout reply.
CLIENT_GRACE_S = 2.0
# Lazy Pirate: probe a broker silent this long while requests are open; reconnect after LIVENESS silences.
HEARTBEAT_S = 1.0
LIVENESS = 3
# A client that has never heard from its broker fails its requests after this long, naming the endpoint (a wrong
# endpoint, or no broker there); once it has heard from one, it rides out a broker restart until the deadline.
CONNECT_TIMEOUT_S = 8.0

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- errors


class ServiceError(Exception):
    """A request ended with an error reply (or no reply). `code` is a protocol error code."""

    code = "service_error"

    def __init__(self, message: str, code: str | None = None, request_id: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.request_id = request_id

    @property
    def retryable(self) -> bool:
        return self.code in protocol.RETRYABLE_CODES


class ServerBusy(ServiceError):
    """The broker's queue is full; back off and retry."""

    code = Codes.BUSY


class RequestTimeout(ServiceError, TimeoutError):
    """The deadline passed (reported by the broker, or no reply reached the client in time)."""

    code = Codes.TIMEOUT


class RequestCancelled(ServiceError):
    """The request was cancelled before a worker started it."""

    code = Codes.CANCELLED


class InvalidRequest(ServiceError, ValueError):
    """The request broke the wire schema or the runtime's config/mode rules."""

    code = Codes.INVALID_FIELD


class BadEndpoint(ServiceError, ValueError):
    """The endpoint given is not one ZeroMQ can connect to (a typo, a port that is not a number), or the CURVE key
    directory lacks this client's keys: nothing was sent."""

    code = "bad_endpoint"

    def __init__(self, message: str, option: str = "--connect"):
        super().__init__(message)
        self.option = option  # the command-line option that gave the bad value (--connect or --curve-dir)


def check_endpoint(endpoint: str) -> None:
    """Raise BadEndpoint when ZeroMQ cannot connect to `endpoint` at all (tcp://HOST:PORT, ipc://PATH, ...). A broker
    that is merely not up yet is not an error here: the connection is retried."""
    sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        raise BadEndpoint(f"cannot connect to {endpoint!r}: {exc.strerror} (an endpoint looks like tcp://HOST:PORT "
                          f"or ipc:///PATH)") from None
    finally:
        sock.close()


class UnsupportedOperation(ServiceError):
    """The op does not exist, or this service's runtime does not implement it."""

    code = Codes.UNSUPPORTED_OP


class HandleLost(ServiceError, KeyError):
    """The handle was evicted by the live-handle cap, released, or its worker is gone."""

    code = Codes.HANDLE_UNKNOWN

    def __str__(self) -> str:  # KeyError would otherwise print repr(message)
        return self.message


class WorkerLost(ServiceError):
    """The worker died after streaming part of the answer; it was not retried."""

    code = Codes.WORKER_LOST


class ServiceUnavailable(ServiceError):
    """The broker is shutting down."""

    code = Codes.SHUTTING_DOWN


ERROR_CLASSES: dict[str, type[ServiceError]] = {
    Codes.BUSY: ServerBusy,
    Codes.TIMEOUT: RequestTimeout,
    Codes.CANCELLED: RequestCancelled,
    Codes.BAD_FRAME: InvalidRequest,
    Codes.BAD_VERSION: InvalidRequest,
    Codes.BAD_MESSAGE: InvalidRequest,
    Codes.INVALID_FIELD: InvalidRequest,
    Codes.TOO_LARGE: InvalidRequest,
    Codes.DUPLICATE_ID: InvalidRequest,
    Codes.CONFIG_ERROR: InvalidRequest,
    Codes.MODE_ERROR: InvalidRequest,
    Codes.BUDGET: InvalidRequest,
    Codes.UNKNOWN_OP: UnsupportedOperation,
    Codes.UNSUPPORTED_OP: UnsupportedOperation,
    Codes.HANDLE_EVICTED: HandleLost,
    Codes.HANDLE_UNKNOWN: HandleLost,
    Codes.WORKER_LOST: WorkerLost,
    Codes.SHUTTING_DOWN: ServiceUnavailable,
}


def error_from_reply(fields: dict) -> ServiceError:
    cls = ERROR_CLASSES.get(fields["code"], ServiceError)
    return cls(f"{fields['code']}: {fields['message']}", code=fields["code"], request_id=fields.get("id"))


# ---------------------------------------------------------------------------- results


@dataclass
class TokenEvent:
    token: int
    pos: int
    text: str  # the new text this token completes (may be "" inside a multi-byte character)


@dataclass
class Reply:
    """The final "done" reply of a request."""

    result: dict = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.result.get("tokens", [])

    @property
    def text(self) -> str:
        return self.result.get("text", "")

    @property
    def stats(self) -> dict:
        return self.result.get("stats", {})

    @property
    def worker(self) -> str | None:
        return self.result.get("worker")

    @property
    def handle(self) -> str | None:
        return self.result.get("handle")


_ids = itertools.count(1)


async def wait_within(awaitable: Any, timeout: float) -> Any:
    """`asyncio.wait_for` without its lost cancellation: before Python 3.12 a task cancelled just as the awaited
    thing finished got the result and never saw the cancel, so a gateway whose client hung up mid-stream kept the
    request running on the service. Here a cancel always raises; the timeout raises asyncio.TimeoutError."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise asyncio.TimeoutError
    return task.result()


def new_request_id() -> str:
    # Unique within this process; the broker keys requests by (client socket, id).
    return f"{os.getpid():x}-{next(_ids)}"


def build_request(op: str, params: dict, stream: bool, timeout: float, request_id: str | None,
                  received: list[int] | None = None) -> tuple[str, list[bytes]]:
    """Validate locally (so a bad field raises InvalidRequest without a round trip) and encode.
    `received` (a re-send): the tokens of this request already received."""
    request_id = request_id or new_request_id()
    resend = {"received": received} if received is not None else {}
    if isinstance(params.get("logit_bias"), dict):  # msgpack maps on the wire have string keys, as JSON's do
        params = {**params, "logit_bias": {str(k): v for k, v in params["logit_bias"].items()}}
    try:
        frames = protocol.encode(
            CLIENT_TO_BROKER, "request", id=request_id, op=op, params=params, stream=stream, timeout_s=timeout, **resend
        )
    except ProtocolError as err:
        raise ERROR_CLASSES.get(err.code, InvalidRequest)(f"{err.code}: {err.message}", code=err.code) from None
    return request_id, frames


def generate_params(prompt: str | list[int], config: dict) -> dict:
    return {"prompt": prompt, **{k: v for k, v in config.items() if v is not None or k in ("loops", "seed")}}


def _connect(ctx: zmq.Context, endpoint: str, curve_dir: str | None, identity: bytes) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER under `identity` (kept across reconnects: the broker knows a re-sent request by identity and
    id) and a monitor socket that reports when its connection drops."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.setsockopt(zmq.IDENTITY, identity)
    if curve_dir is not None:  # encrypted, authenticated connection (see broker/security.py)
        from broker.security import KeyDirectoryError, make_client

        try:
            make_client(sock, curve_dir)
        except KeyDirectoryError as exc:
            sock.close()
            raise BadEndpoint(str(exc), "--curve-dir") from None
    try:
        sock.connect(endpoint)
    except zmq.ZMQError:
        sock.close()
        check_endpoint(endpoint)  # says why, as BadEndpoint
        raise
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    return sock, monitor


def _close(sock: zmq.Socket, monitor: zmq.Socket, linger: int) -> None:
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=linger)


def new_identity() -> bytes:
    # TOKENS_CLIENT: this client reads "tokens" messages (a worker step's tokens of its requests in one message)
    return protocol.TOKENS_CLIENT + os.urandom(8).hex().encode()


@dataclass
class Outgoing:
    """What a re-send needs of a request that has no final reply yet."""

    op: str | None  # None: a status request
    params: dict | None
    stream: bool
    deadline: float  # monotonic time the broker's deadline ends
    received: list[int] = field(default_factory=list)  # streamed token ids received so far, in order

    def frames(self, request_id: str, now: float) -> list[bytes]:
        if self.op is None:
            return protocol.encode(CLIENT_TO_BROKER, "status", id=request_id)
        remaining = max(self.deadline - now, 0.001)
        assert self.params is not None  # (a request's: only a status request has none)
        return build_request(self.op, self.params, self.stream, remaining, request_id, list(self.received))[1]


def _answer(msg: protocol.Message) -> Any:
    """What a final message answers: a Reply (or, to a status request, the status); an error reply raises."""
    if msg.type == "error":
        raise error_from_reply(msg.fields)
    return Reply(msg["result"]) if msg.type == "done" else msg["status"]


# ---------------------------------------------------------------------------- the protocol, for both clients


class _Core:
    """What Client and AsyncClient share, written once: the connection, the requests without a final reply,
    filing what arrives, and the Lazy Pirate watch over the broker. A client adds only how it waits (a
    blocking poll in the caller's thread, or one asyncio task) and where a request's unread messages wait."""

    context_class: type[zmq.Context]
    poller_class: type[zmq.Poller]
    _new_box: Callable[[], Any]  # an empty box for one request's unread messages
    _put: Callable[[Any, protocol.Message], None]  # (box, message): file one message into it

    def __init__(self, endpoint: str, *, timeout: float = DEFAULT_TIMEOUT_S, grace: float = CLIENT_GRACE_S,
                 curve_dir: str | None = None, context: zmq.Context | None = None, heartbeat: float = HEARTBEAT_S,
                 liveness: int = LIVENESS, connect_timeout: float = CONNECT_TIMEOUT_S):
        self.endpoint = endpoint
        self.timeout = timeout
        self.grace = grace
        self.curve_dir = curve_dir
        self.heartbeat = heartbeat
        self.liveness = liveness
        self.connect_timeout = connect_timeout
        self.heard = False  # anything ever arrived from a broker on this endpoint
        self.waiting_since = time.monotonic()  # since when requests are open without pause
        self.ctx = context or self.context_class.instance()
        self.identity = new_identity()
        self.inbox: dict[str, Any] = {}  # request id -> its box of messages not yet consumed
        self.open: dict[str, Outgoing] = {}  # requests still waiting for their final reply (re-sent on reconnect)
        self.reconnects = 0  # connections lost and re-established (each re-sent every open request)
        self._connect()

    def _connect(self) -> None:
        self.socket, self.monitor = _connect(self.ctx, self.endpoint, self.curve_dir, self.identity)
        # Plain views of the same two sockets, for the calls that must not wait: on an asyncio socket these
        # would return a Future (holding any error) instead of the answer.
        self._plain: zmq.Socket = zmq.Socket.shadow(self.socket.underlying)
        self._plain_monitor: zmq.Socket = zmq.Socket.shadow(self.monitor.underlying)
        self.poller = self.poller_class()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.last_heard = self.last_probe = time.monotonic()

    def _shutdown(self) -> None:
        for request_id in list(self.open):
            self.cancel_quietly(request_id)  # nobody will read the answers: stop the work
        _close(self.socket, self.monitor, 100)

    # ---- requests

    def _start(self, op: str | None, params: dict | None, stream: bool, timeout: float | None,
               request_id: str | None = None) -> tuple[str, list[bytes], float]:
        """Encode a request (op None: a status request) and track it before it is sent (an asyncio reader may
        file its reply while the send is awaited). Returns its id, its frames and when to stop waiting."""
        timeout = timeout or self.timeout
        if op is None:
            request_id = new_request_id()
            frames = protocol.encode(CLIENT_TO_BROKER, "status", id=request_id)
        else:
            assert params is not None  # (a request's: only a status request has none)
            request_id, frames = build_request(op, params, stream, timeout, request_id)
        now = time.monotonic()
        if not self.open:
            self.last_heard = self.waiting_since = now  # silence while nothing was open says nothing about the broker
        self.open[request_id] = Outgoing(op, params, stream, now + timeout)
        self.inbox.setdefault(request_id, self._new_box())
        return request_id, frames, now + timeout + self.grace

    def _forget(self, request_id: str) -> None:
        self.open.pop(request_id, None)
        self.inbox.pop(request_id, None)

    def _cancel_frames(self, request_id: str) -> list[bytes]:
        return protocol.encode(CLIENT_TO_BROKER, "cancel", id=request_id)

    def cancel_quietly(self, request_id: str) -> None:
        self._send_nowait(self._cancel_frames(request_id))

    def _send_nowait(self, frames: list[bytes]) -> bool:
        """Send now or not at all (probes, re-sends, cancels nobody waits for); False if it could not go."""
        if self.socket.closed:
            return False  # the plain view does not know its socket is gone
        try:
            self._plain.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def _no_connection(self) -> RequestTimeout:
        return RequestTimeout(f"cannot send to {self.endpoint}: no connection to the broker")

    def _no_reply(self, request_id: str) -> RequestTimeout:
        return RequestTimeout(f"no reply from {self.endpoint} within the deadline", request_id=request_id)

    # ---- what arrives, and the broker's liveness

    def _service(self, events: dict) -> None:
        """After a poll of the socket and its monitor: file what arrived, then watch the broker."""
        if self.socket in events:
            for _ in range(256):  # bounded, so the waiting caller gets its turn under a flood
                try:
                    self._file(self._plain.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
        lost = self.monitor in events and (
            recv_monitor_message(self._plain_monitor, zmq.NOBLOCK)["event"] == zmq.EVENT_DISCONNECTED)
        if self.open:
            self._check_broker(lost)
        else:
            self.last_heard = time.monotonic()  # silence while nothing is open says nothing

    def _check_broker(self, lost: bool) -> None:
        """Lazy Pirate: probe a silent broker; on a lost connection reconnect and re-send."""
        now = time.monotonic()
        if not self.heard and now - self.waiting_since > self.connect_timeout:
            return self._unreachable()
        silent = now - self.last_heard
        if lost or silent > self.heartbeat * self.liveness:
            self._reconnect("the connection dropped" if lost else f"no answer for {silent:.1f}s")
        elif silent > self.heartbeat and now - self.last_probe > self.heartbeat:
            self.last_probe = now  # any reply proves the broker alive; a status request is the cheapest
            self._send_nowait(protocol.encode(CLIENT_TO_BROKER, "status", id="probe"))

    def _reconnect(self, why: str) -> None:
        """A fresh socket under the same identity; every request without a final reply is re-sent under its id,
        with the tokens already received, so the broker attaches it to what it still knows."""
        log.info("%s: %s; reconnecting and re-sending %d request(s)", self.endpoint, why, len(self.open))
        _close(self.socket, self.monitor, 0)
        self._connect()
        self.reconnects += 1
        now = time.monotonic()
        for request_id, outgoing in self.open.items():
            if not self._send_nowait(outgoing.frames(request_id, now)):  # queued until the connection is up
                break  # no room: the next reconnect tries again

    def _unreachable(self) -> None:
        """No broker ever answered: fail every open request now, naming the endpoint, rather than each at its
        deadline. (A cancel follows each request, should a broker appear and read them after all.)"""
        keys = " (and with CURVE: does it hold this client's key?)" if self.curve_dir else ""
        message = (f"no answer from a broker at {self.endpoint} within {self.connect_timeout:.0f}s: is it running, "
                   f"and is this its frontend endpoint?{keys}")
        for request_id, outgoing in list(self.open.items()):
            del self.open[request_id]
            if outgoing.op is not None:
                self.cancel_quietly(request_id)
            self._put(self.inbox[request_id],
                      protocol.Message("error", {"id": request_id, "code": Codes.TIMEOUT, "message": message}))

    def _file(self, frames: list[bytes]) -> None:
        self.last_heard = time.monotonic()
        self.heard = True
        try:
            msg = protocol.decode(BROKER_TO_CLIENT, frames, max_bytes=1 << 30)
        except ProtocolError:
            return  # nothing sensible to do with a garbled reply; the request will time out
        for one in protocol.unbatch(msg):
            self._file_one(one)

    def _file_one(self, msg: protocol.Message) -> None:
        request_id = msg.get("id")
        outgoing = self.open.get(request_id)
        if outgoing is None:
            return  # not ours, or its final reply is already here (a replay after a reconnect)
        if msg.type == "token":
            if msg["pos"] != len(outgoing.received):
                return  # replayed after a reconnect and already here: never hand a token out twice
            outgoing.received.append(msg["token"])
        else:
            del self.open[request_id]  # final: nothing left to re-send
        self._put(self.inbox[request_id], msg)


# ---------------------------------------------------------------------------- sync client


class Client(_Core):
    """Synchronous client. Not thread-safe: use one Client per thread.

    Several requests may be outstanding at once (submit() returns a Pending); replies for
    other requests that arrive while one is being waited on are kept for their owner.
    """

    context_class = zmq.Context
    poller_class = zmq.Poller
    _new_box, _put = list, staticmethod(list.append)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._shutdown()

    # ---- high-level calls

    def submit(self, op: str, params: dict, *, stream: bool = False, timeout: float | None = None,
               request_id: str | None = None) -> "Pending":
        return Pending(self, *self._request(op, params, stream, timeout, request_id))

    def generate(self, prompt: str | list[int], *, timeout: float | None = None, **config: Any) -> Reply:
        """Run one generation and return its final reply. `config` takes GenerateConfig fields."""
        return self.submit("generate", generate_params(prompt, config), timeout=timeout).result()

    def generate_batch(self, prompts: list, *, window: int = BATCH_WINDOW, timeout: float | None = None,
                       return_exceptions: bool = False, **config: Any) -> list:
        """Generate from many prompts (the offline batching lane): at most `window` requests in flight, which the
        workers batch continuously; the replies in prompt order. A failed prompt raises its ServiceError, or with
        return_exceptions=True stands in the list in place of its reply."""
        replies: list = []
        in_flight: list[Pending] = []

        def settle_oldest() -> None:  # replies of the others are filed meanwhile
            try:
                replies.append(in_flight.pop(0).result())
            except ServiceError as err:
                if not return_exceptions:
                    for pending in in_flight:
                        pending.cancel()
                    raise
                replies.append(err)

        for prompt in prompts:
            if len(in_flight) == window:
                settle_oldest()
            in_flight.append(self.submit("generate", generate_params(prompt, config), timeout=timeout))
        while in_flight:
            settle_oldest()
        return replies

    def stream(self, prompt: str | list[int], *, timeout: float | None = None, op: str = "generate",
               **config: Any) -> "Pending":
        """Start a streamed generation; iterate the returned Pending for TokenEvents."""
        return self.submit(op, generate_params(prompt, config), stream=True, timeout=timeout)

    def call(self, op: str, timeout: float | None = None, **params: Any) -> Reply:
        """Run any op (build_handle, resume, release_handle, generate_pool, speculative, ping)."""
        return self.submit(op, params, timeout=timeout).result()

    def status(self, timeout: float = 5.0) -> dict:
        request_id, deadline = self._request(None, None, False, timeout)
        msg = self._next(request_id, deadline)
        self._forget(request_id)
        return _answer(msg)

    def cancel(self, request_id: str) -> None:
        if request_id in self.open:
            self._send(self._cancel_frames(request_id), self.grace)

    # ---- plumbing

    def _request(self, op: str | None, params: dict | None, stream: bool, timeout: float | None,
                 request_id: str | None = None) -> tuple[str, float]:
        request_id, frames, deadline = self._start(op, params, stream, timeout, request_id)
        try:
            self._send(frames, deadline - time.monotonic())
        except RequestTimeout:
            self._forget(request_id)
            raise
        return request_id, deadline

    def _send(self, frames: list[bytes], timeout: float) -> None:
        # A DEALER blocks on send while it has no connection (broker down, or a CURVE handshake
        # that keeps failing); wait at most `timeout` for one.
        try:
            if not self.socket.poll(int(timeout * 1000), zmq.POLLOUT):
                raise zmq.Again()
            self.socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            raise self._no_connection() from None

    def _next(self, request_id: str, deadline: float) -> protocol.Message:
        """The next message for request_id, receiving (and filing) others' messages meanwhile."""
        box = self.inbox[request_id]
        while not box:
            now = time.monotonic()
            if now >= deadline:
                self._forget(request_id)
                self.cancel_quietly(request_id)
                raise self._no_reply(request_id)
            # Waking at least every half heartbeat lets _service probe a silent broker in time.
            self._service(dict(self.poller.poll(int(min(deadline - now, self.heartbeat / 2) * 1000) + 1)))
        return box.pop(0)


class Pending:
    """One outstanding request of a sync Client: iterate it for tokens, then read .result,
    or call .result() directly. Leaving a `with` block early cancels the request."""

    def __init__(self, client: Client, request_id: str, deadline: float):
        self.client = client
        self.id = request_id
        self.deadline = deadline
        self.final: Reply | None = None
        self.error: ServiceError | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        while self.final is None and self.error is None:
            msg = self._next()
            if msg.type == "token":
                yield TokenEvent(msg["token"], msg["pos"], msg["text"])
        if self.error is not None:
            raise self.error

    def _next(self) -> protocol.Message:
        try:
            msg = self.client._next(self.id, self.deadline)
        except ServiceError as err:
            self.error = err
            raise
        if msg.type != "token":
            self.client._forget(self.id)
            try:
                self.final = _answer(msg)
            except ServiceError as err:
                self.error = err
        return msg

    def result(self) -> Reply:
        """Wait for the final reply (skipping tokens); raises the request's ServiceError."""
        while self.final is None and self.error is None:
            self._next()
        if self.error is not None:
            raise self.error
        assert self.final is not None
        return self.final

    def cancel(self) -> None:
        """Ask the service to stop this request; its final reply still arrives (see result())."""
        self.client.cancel(self.id)

    @property
    def done(self) -> bool:
        return self.final is not None or self.error is not None

    def __enter__(self) -> "Pending":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.done:
            self.cancel()
            try:
                self.result()
            except ServiceError:
                pass


# ---------------------------------------------------------------------------- asyncio client


class AsyncClient(_Core):
    """asyncio client. One background task reads replies and routes them to their request.

        async with AsyncClient(endpoint) as client:
            reply = await client.generate("x = ", max_tokens=8)
            async for token in client.stream("y = ", max_tokens=8):
                ...

    Cancelling the task that awaits a request (or breaking out of a stream) cancels the
    request on the service too.
    """

    context_class = zmq.asyncio.Context
    poller_class = zmq.asyncio.Poller
    poller: zmq.asyncio.Poller
    _new_box, _put = asyncio.Queue, staticmethod(asyncio.Queue.put_nowait)
    reader: asyncio.Task | None = None  # started by the first request

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            try:
                await self.reader
            except asyncio.CancelledError:
                pass
        self._shutdown()

    async def submit(self, op: str, params: dict, *, timeout: float | None = None) -> Reply:
        return await self._ask(op, params, timeout)

    async def generate(self, prompt: str | list[int], *, timeout: float | None = None, **config: Any) -> Reply:
        return await self.submit("generate", generate_params(prompt, config), timeout=timeout)

    async def call(self, op: str, timeout: float | None = None, **params: Any) -> Reply:
        return await self.submit(op, params, timeout=timeout)

    async def generate_batch(self, prompts: list, *, window: int = BATCH_WINDOW, timeout: float | None = None,
                             return_exceptions: bool = False, **config: Any) -> list:
        """As Client.generate_batch: at most `window` requests in flight, the replies in prompt order."""
        gate = asyncio.Semaphore(window)

        async def one(prompt) -> Reply:
            async with gate:
                return await self.generate(prompt, timeout=timeout, **config)

        return await asyncio.gather(*(one(p) for p in prompts), return_exceptions=return_exceptions)

    async def stream(self, prompt: str | list[int], *, timeout: float | None = None, op: str = "generate",
                     result: list | None = None, **config: Any) -> AsyncIterator[TokenEvent]:
        """Yield TokenEvents; the final Reply is appended to `result` when a list is given."""
        messages = self._messages(op, generate_params(prompt, config), True, timeout)
        try:
            async for msg in messages:
                if msg.type == "token":
                    yield TokenEvent(msg["token"], msg["pos"], msg["text"])
                else:
                    final = _answer(msg)
                    if result is not None:
                        result.append(final)
        finally:
            await messages.aclose()  # runs the cancel in _messages when the caller stopped early

    async def status(self, timeout: float = 5.0) -> dict:
        return await self._ask(None, None, timeout)

    # ---- plumbing

    async def _ask(self, op: str | None, params: dict | None, timeout: float | None) -> Any:
        """What the final message of an unstreamed request answers (see _answer)."""
        messages = self._messages(op, params, False, timeout)
        try:
            async for msg in messages:
                if msg.type != "token":
                    return _answer(msg)
        finally:
            await messages.aclose()  # forgets the request now, not when the generator is collected
        raise ServiceError("the reply stream ended without a final reply")  # unreachable by protocol

    async def _messages(self, op: str | None, params: dict | None, stream: bool,
                        timeout: float | None) -> AsyncGenerator[protocol.Message, None]:
        """Send one request (op None: a status request) and yield its messages up to and including the final one."""
        request_id, frames, deadline = self._start(op, params, stream, timeout)
        box = self.inbox[request_id]
        if self.reader is None or self.reader.done():
            self.reader = asyncio.get_running_loop().create_task(self._read_forever())
        finished = sent = False
        try:
            await self._send(frames, deadline - time.monotonic())
            sent = True
            while not finished:
                try:
                    msg = await wait_within(box.get(), max(deadline - time.monotonic(), 0.001))
                except asyncio.TimeoutError:
                    raise self._no_reply(request_id) from None
                finished = msg.type != "token"
                yield msg
        finally:
            self._forget(request_id)
            if sent and not finished and op is not None:
                # Cancelled task, timeout or abandoned stream: stop the work on the service.
                try:
                    await self._send(self._cancel_frames(request_id), self.grace)
                except (zmq.ZMQError, RequestTimeout):
                    pass

    async def _send(self, frames: list[bytes], timeout: float) -> None:
        # Without a connection a DEALER send waits forever; bound it (see Client._send).
        try:
            await wait_within(self.socket.send_multipart(frames), timeout)
        except asyncio.TimeoutError:
            raise self._no_connection() from None

    async def _read_forever(self) -> None:
        """Route replies to their requests; while requests are open, watch the broker."""
        while True:
            self._service(dict(await self.poller.poll(int(self.heartbeat * 500))))
