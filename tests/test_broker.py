"""Broker routing, queueing, deadlines, cancellation, heartbeats and fault handling.

These tests start a real broker process and real worker processes (workers/worker.py's
WorkerProcess, the same messaging code the model worker runs) over real ZeroMQ ipc
sockets. The workers here run a small echo engine instead of the model, because what is
under test is routing: the echo engine streams the prompt's characters back, one every
`delay` seconds, so tests control exactly how long a request runs. The end-to-end tests
with the real model are in test_service.py.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgpack
import pytest
import zmq

REPO = Path(__file__).resolve().parent.parent

from broker import launcher, protocol  # noqa: E402
from broker.client import (  # noqa: E402
    Client,
    HandleLost,
    InvalidRequest,
    RequestCancelled,
    RequestTimeout,
    ServerBusy,
    UnsupportedOperation,
    WorkerLost,
)

HEARTBEAT = 0.2  # seconds; a dead peer is noticed after 3 missed beats

# A worker process with an echo engine. argv: endpoint name delay max_handles plan_bytes [curve_dir]
ECHO_WORKER = r"""
import sys, time
from workers.worker import WorkerProcess
from workers.handle_registry import EngineError, HandleRegistry
from broker.protocol import Codes

endpoint, name, delay, max_handles, plan_bytes = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
curve_dir = sys.argv[6] if len(sys.argv) > 6 else None

class EchoEngine:
    ops = ["ping", "generate", "build_handle", "resume", "release_handle"]
    device, model_name = "cpu", "echo"

    def __init__(self):
        self.plan_bytes, self.max_handles = plan_bytes, max_handles
        self.handles = HandleRegistry(max_handles, "echo")

    def live_handles(self):
        return len(self.handles)

    def run(self, op, params, on_token, should_stop, delivered=None):
        # delivered: a continuation (the previous worker died mid-stream); echo from where it broke.
        if delivered and params.get("beam_size", 1) > 1:
            raise EngineError(Codes.WORKER_LOST, "echo: a beam stream cannot be continued")
        if op == "build_handle":
            return {"handle": self.handles.add(params["prompt"])}
        if op == "release_handle":
            self.handles.release(params["handle"])
            return {"released": params["handle"]}
        if op == "resume":
            prompt = self.handles.get(params["handle"])
        elif op == "generate":
            prompt = params["prompt"]
        else:
            raise EngineError(Codes.UNSUPPORTED_OP, f"echo worker does not do {op}")
        if params.get("temperature", 0) > 50:
            raise EngineError(Codes.MODE_ERROR, "temperature > 50 is rejected by the echo engine")
        tokens, stop = [], "max_tokens"
        for pos, ch in enumerate(prompt[: params.get("max_tokens", 64)]):
            if pos < len(delivered or []):
                tokens.append(ord(ch))
                continue
            time.sleep(delay)
            if should_stop():
                stop = "cancelled"
                break
            tokens.append(ord(ch))
            if on_token:
                on_token(ord(ch), pos, ch)
        stats = {"prompt_tokens": len(prompt), "generated_tokens": len(tokens), "prefill_ms": 0.1,
                 "first_token_ms": delay * 1000, "decode_ms": delay * 1000 * len(tokens), "stop_reason": stop}
        return {"tokens": tokens, "text": "".join(map(chr, tokens)), "stats": stats}

process = WorkerProcess(EchoEngine(), endpoint, name=name, heartbeat_interval=%(hb)s, curve_dir=curve_dir)
process.engine.handles.id_prefix = process.identity
process.install_signal_handlers()
sys.exit(process.run())
""".replace("%(hb)s", str(HEARTBEAT))


class Service:
    """A broker process plus echo workers, on ipc endpoints in a private temp dir."""

    def __init__(self, *broker_args: str, tcp: bool = False, curve_dir: str | None = None):
        self.curve_dir = curve_dir  # the key directory clients of this fixture use
        # ipc paths must be short (about 100 bytes), so not under pytest's long tmp_path.
        self.dir = Path(tempfile.mkdtemp(prefix="tlb-", dir="/tmp"))
        if tcp:  # the broker picks free ports; start_broker reads them back from its ready file
            self.frontend = self.backend = "tcp://127.0.0.1:*"
        else:
            self.frontend = f"ipc://{self.dir}/front"
            self.backend = f"ipc://{self.dir}/back"
        self.broker_args = broker_args
        self.workers: dict[str, subprocess.Popen] = {}
        self.broker: subprocess.Popen | None = None
        self.info: dict = {}

    def start_broker(self) -> None:
        ready = self.dir / f"ready-{time.monotonic_ns()}.json"
        self.broker = launcher.spawn(
            ["broker", "--frontend", self.frontend, "--backend", self.backend, "--ready-file", str(ready),
             "--heartbeat-interval", str(HEARTBEAT), "--log-level", "warning", *self.broker_args],
            self.dir / "broker.log",
        )
        self.info = launcher.wait_for_file(ready, self.broker, 20)
        self.frontend, self.backend = self.info["frontend"], self.info["backend"]

    def start_worker(self, name: str, delay: float = 0.0, max_handles: int = 4, plan_bytes: int = 1000,
                     wait: bool = True, curve_dir: str | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", ECHO_WORKER, self.backend, name, str(delay), str(max_handles), str(plan_bytes),
             *([str(curve_dir)] if curve_dir else [])],
            env=launcher.child_env(), cwd=str(REPO), stdout=open(self.dir / f"{name}.log", "ab"), stderr=subprocess.STDOUT,
        )
        self.workers[name] = proc
        if wait:
            self.wait_workers(lambda ws: name in [w["name"] for w in ws])
        return proc

    def wait_workers(self, predicate, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        with Client(self.frontend, curve_dir=self.curve_dir) as client:
            while time.monotonic() < deadline:
                workers = client.status(timeout=5)["workers"]
                if predicate(workers):
                    return workers
                time.sleep(0.05)
        raise AssertionError(f"workers never matched; last: {workers}")

    def client(self, timeout: float = 20.0) -> Client:
        return Client(self.frontend, timeout=timeout, curve_dir=self.curve_dir)

    def close(self) -> None:
        for proc in [*self.workers.values(), self.broker]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def service():
    svc = Service()
    svc.start_broker()
    yield svc
    svc.close()


def final_replies(client: Client, pendings) -> dict:
    """Collect the outcome of each request: ("done", reply) or ("error", exception)."""
    outcomes = {}
    for p in pendings:
        try:
            outcomes[p.id] = ("done", p.result())
        except Exception as exc:  # noqa: BLE001 - the test inspects the type
            outcomes[p.id] = ("error", exc)
    return outcomes


# ----------------------------------------------------------------------------- routing


def test_routes_only_to_ready_workers_and_streams_in_order(service):
    with service.client() as client:
        # No worker yet: the request waits in the queue rather than failing.
        pending = client.submit("generate", {"prompt": "hello"}, stream=True, timeout=20)
        time.sleep(0.3)
        assert not pending.done
        service.start_worker("w1", delay=0.01)
        events = list(pending)
        assert "".join(e.text for e in events) == "hello"
        assert [e.pos for e in events] == [0, 1, 2, 3, 4]
        reply = pending.result()
        assert reply.text == "hello" and reply.worker == "w1"
        assert reply.stats["stop_reason"] == "max_tokens"
        assert client.call("ping", payload="x").result["payload"] == "x"


def test_requests_spread_over_idle_workers(service):
    service.start_worker("w1", delay=0.02)
    service.start_worker("w2", delay=0.02)
    with service.client() as client:
        pendings = [client.submit("generate", {"prompt": "abcdefghij"}) for _ in range(8)]
        workers = [p.result().worker for p in pendings]
    assert set(workers) == {"w1", "w2"}
    # One request at a time per worker: 8 requests of 0.2 s on 2 workers take about 0.8 s.


def test_tcp_endpoints_on_free_ports():
    svc = Service(tcp=True)
    try:
        svc.start_broker()
        assert svc.frontend.startswith("tcp://127.0.0.1:") and svc.frontend != svc.backend
        svc.start_worker("w1")
        with svc.client() as client:
            assert client.generate("over tcp").text == "over tcp"
    finally:
        svc.close()


def test_busy_when_queue_full(service):
    service.close()
    svc = Service("--max-queue", "2")
    svc.start_broker()
    try:
        svc.start_worker("w1", delay=0.05)
        with svc.client() as client:
            running = client.submit("generate", {"prompt": "x" * 20})
            time.sleep(0.2)  # let it reach the worker
            queued = [client.submit("generate", {"prompt": "ab"}) for _ in range(2)]
            t0 = time.monotonic()
            with pytest.raises(ServerBusy) as err:
                client.submit("generate", {"prompt": "ab"}).result()
            assert time.monotonic() - t0 < 0.5, "busy must be told at once"
            assert err.value.retryable
            assert running.result().text == "x" * 20
            assert [q.result().text for q in queued] == ["ab", "ab"]
    finally:
        svc.close()


def test_deadline_expires_running_and_queued_requests(service):
    service.start_worker("w1", delay=0.05)
    with service.client() as client:
        slow = client.submit("generate", {"prompt": "y" * 60}, stream=True, timeout=0.5)
        queued = client.submit("generate", {"prompt": "z"}, timeout=0.3)
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            slow.result()
        with pytest.raises(RequestTimeout):
            queued.result()
        assert time.monotonic() - t0 < 2.0
        # The decode was stopped on the worker, which is free again right away.
        t1 = time.monotonic()
        assert client.generate("ok", timeout=5).text == "ok"
        assert time.monotonic() - t1 < 1.5


def test_cancel_queued_and_running(service):
    service.start_worker("w1", delay=0.05)
    with service.client() as client:
        running = client.submit("generate", {"prompt": "r" * 200}, stream=True)
        queued = client.submit("generate", {"prompt": "q"})
        next(iter(running))  # it is decoding
        queued.cancel()
        with pytest.raises(RequestCancelled):
            queued.result()
        running.cancel()
        reply = running.result()
        assert reply.stats["stop_reason"] == "cancelled"
        assert len(reply.tokens) < 200
        assert client.generate("after").text == "after"


def test_exactly_one_reply_when_worker_killed(service):
    """SIGKILL a worker mid-load: unstreamed requests retry elsewhere, streamed ones continue elsewhere
    from the tokens already delivered; none answered twice, no token seen twice."""
    victim = service.start_worker("w1", delay=0.05)
    service.start_worker("w2", delay=0.05)
    with service.client() as client:
        streamed = [client.submit("generate", {"prompt": "s" * 30}, stream=True) for _ in range(2)]
        beams = [client.submit("generate", {"prompt": "b" * 30, "beam_size": 2}, stream=True) for _ in range(2)]
        plain = [client.submit("generate", {"prompt": "p" * 6}) for _ in range(6)]
        time.sleep(0.4)  # both workers busy, the rest queued
        victim.kill()
        everything = streamed + beams + plain
        tokens = {p.id: [(e.pos, e.token) for e in p] for p in streamed}
        outcomes = final_replies(client, everything)
        # Anything else arriving later would be a duplicate: there must be nothing left.
        assert not client.socket.poll(500)
    assert len(outcomes) == len(everything)
    for p in plain:
        kind, value = outcomes[p.id]
        assert kind == "done" and value.text == "p" * 6, value  # retried if it was on w1
    for p in streamed:  # continued on w2 if it was on w1: every token once, in order
        kind, value = outcomes[p.id]
        assert kind == "done" and value.text == "s" * 30, value
        assert tokens[p.id] == [(i, ord("s")) for i in range(30)]
    # A beam stream cannot be continued: if one was hit after streaming, it is the only kind of loss.
    for p in beams:
        kind, value = outcomes[p.id]
        assert (kind == "done" and value.text == "b" * 30) or (kind == "error" and isinstance(value, WorkerLost)), value
    workers = service.wait_workers(lambda ws: [w["name"] for w in ws] == ["w2"])
    assert workers[0]["state"] == "idle"


def test_handles_route_to_their_worker_and_evict(service):
    service.start_worker("w1", max_handles=2)
    service.start_worker("w2", max_handles=2)
    with service.client() as client:
        handles = [client.call("build_handle", prompt=f"h{i}", l_used=1) for i in range(4)]
        for reply in handles:
            # The owner is named in the id; the resume goes there whoever is idle.
            for _ in range(3):
                resumed = client.call("resume", handle=reply.handle, loops=4, max_tokens=8)
                assert resumed.worker == reply.worker
        by_worker: dict = {}
        for reply in handles:
            by_worker.setdefault(reply.worker, []).append(reply.handle)
        worker, ids = next((w, ids) for w, ids in by_worker.items() if len(ids) >= 1)
        for i in range(2):  # fill that worker's cap of 2 with new handles: ids[0] is LRU, gets evicted
            client.call("build_handle", prompt=f"new{i}", l_used=1)
        with pytest.raises(HandleLost) as err:
            for handle in ids:
                client.call("resume", handle=handle, loops=4)
        assert err.value.code in ("handle_evicted",)
        with pytest.raises(HandleLost) as err:
            client.call("resume", handle="nobody-123:1", loops=4)
        assert err.value.code == "handle_unknown"
        status = client.status()
        assert sum(w["handles"] for w in status["workers"]) <= 4


def test_handle_of_dead_worker_is_unknown(service):
    victim = service.start_worker("w1")
    with service.client() as client:
        handle = client.call("build_handle", prompt="abc", l_used=1).handle
        victim.kill()
        service.wait_workers(lambda ws: ws == [], timeout=10)
        with pytest.raises(HandleLost) as err:
            client.call("resume", handle=handle, loops=2)
        assert err.value.code == "handle_unknown" and "not held" in str(err.value)


def test_broker_refuses_worker_over_its_limits(service):
    service.close()
    svc = Service("--max-worker-memory", "500", "--max-handles-limit", "2")
    svc.start_broker()
    try:
        proc = svc.start_worker("big", plan_bytes=1000, wait=False)
        assert proc.wait(20) == 4
        log = (svc.dir / "big.log").read_text()
        assert "exceeds the broker's per-worker limit" in log
        svc.start_worker("small", plan_bytes=100, max_handles=2)
        with svc.client() as client:
            assert [w["name"] for w in client.status()["workers"]] == ["small"]
    finally:
        svc.close()


# ----------------------------------------------------------------------------- bad input


def raw_socket(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    return sock


def raw_reply(sock: zmq.Socket, timeout_ms: int = 3000) -> dict:
    assert sock.poll(timeout_ms), "the broker did not answer"
    frames = sock.recv_multipart()
    assert frames[0] == protocol.PROTOCOL_TAG
    return msgpack.unpackb(frames[1])


BODY = lambda **kw: msgpack.packb(kw)  # noqa: E731

MALFORMED = [
    ([b"only one frame"], "bad_frame"),
    ([b"not the tag", BODY(type="status", id="a")], "bad_frame"),
    ([b"tinyloop/9", BODY(type="status", id="a")], "bad_version"),
    ([protocol.PROTOCOL_TAG, b"\xc1\xc1 not msgpack"], "bad_message"),
    ([protocol.PROTOCOL_TAG, msgpack.packb([1, 2, 3])], "bad_message"),
    ([protocol.PROTOCOL_TAG, BODY(type="launch_missiles", id="a")], "bad_message"),
    ([protocol.PROTOCOL_TAG, BODY(type="request", id="a", op="teleport", params={})], "unknown_op"),
    ([protocol.PROTOCOL_TAG, BODY(type="request", id="a", op="generate", params={"prompt": 5})], "invalid_field"),
    ([protocol.PROTOCOL_TAG, BODY(type="request", id="a", op="generate", params={"prompt": "x", "max_tokens": "9"})],
     "invalid_field"),
    ([protocol.PROTOCOL_TAG, BODY(type="request", id="a", op="generate", params={"prompt": "x", "top_p": 0})],
     "invalid_field"),
    ([protocol.PROTOCOL_TAG, BODY(type="request", id="a", op="generate", params={"prompt": "x", "bogus": 1})],
     "invalid_field"),
    ([protocol.PROTOCOL_TAG, BODY(type="request", id=7, op="generate", params={"prompt": "x"})], "invalid_field"),
    ([protocol.PROTOCOL_TAG, BODY(type="request", id="a", op="generate", params={"prompt": "x" * (2 << 20)})],
     "too_large"),
]


@pytest.mark.parametrize("frames,code", MALFORMED, ids=[c for _, c in MALFORMED])
def test_malformed_messages_get_error_codes(service, frames, code):
    sock = raw_socket(service.frontend)
    try:
        sock.send_multipart(frames)
        reply = raw_reply(sock)
        assert reply["type"] == "error" and reply["code"] == code, reply
        # The broker keeps serving.
        sock.send_multipart(protocol.encode(protocol.CLIENT_TO_BROKER, "status", id="after"))
        assert raw_reply(sock)["type"] == "status_reply"
    finally:
        sock.close()


def test_runtime_rejections_and_unsupported_ops_reach_the_client(service):
    service.start_worker("w1")
    with service.client() as client:
        with pytest.raises(InvalidRequest) as err:
            client.generate("abc", temperature=60.0)
        assert err.value.code == "mode_error"
        with pytest.raises(UnsupportedOperation):
            client.call("speculative", prompt="abc", draft_loops=1, verify_loops=2, draft_ahead=2)
        with pytest.raises(InvalidRequest):  # caught by the client before sending
            client.generate("abc", max_tokens=0)
        assert client.generate("still fine").text == "still fine"


def test_duplicate_request_id_is_rejected(service):
    service.start_worker("w1", delay=0.05)
    sock = raw_socket(service.frontend)
    try:
        for _ in range(2):
            sock.send_multipart(protocol.encode(protocol.CLIENT_TO_BROKER, "request", id="dup", op="generate",
                                                params={"prompt": "abcdef"}))
        replies = [raw_reply(sock) for _ in range(2)]
        assert [r["type"] for r in replies] == ["error", "done"]
        assert replies[0]["code"] == "duplicate_id"
    finally:
        sock.close()


# ----------------------------------------------------------------------------- heartbeats, shutdown, metrics


def test_worker_reconnects_after_broker_restart(service):
    service.start_worker("w1")
    service.broker.kill()
    service.broker.wait(5)
    time.sleep(HEARTBEAT * 2)
    service.start_broker()  # same endpoints
    service.wait_workers(lambda ws: [w["name"] for w in ws] == ["w1"], timeout=15)
    with service.client() as client:
        assert client.generate("back").text == "back"


def test_broker_notices_silent_worker(service):
    proc = service.start_worker("w1")
    proc.send_signal(signal.SIGSTOP)  # alive but silent: only heartbeats can tell
    try:
        service.wait_workers(lambda ws: ws == [], timeout=5)
    finally:
        proc.send_signal(signal.SIGCONT)
    # Once it wakes up it is told to re-announce itself and comes back.
    service.wait_workers(lambda ws: [w["name"] for w in ws] == ["w1"], timeout=10)


def test_sigterm_lets_in_flight_requests_finish(service):
    service.start_worker("w1", delay=0.05)
    with service.client() as client:
        running = client.submit("generate", {"prompt": "f" * 10})
        time.sleep(0.2)
        service.broker.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        late = client.submit("generate", {"prompt": "late"})
        assert running.result().text == "f" * 10
        with pytest.raises(Exception) as err:
            late.result()
        assert getattr(err.value, "code", None) in ("shutting_down", "timeout")
    assert service.broker.wait(10) == 0


def test_metrics_health_and_request_log(service):
    service.close()
    svc = Service("--metrics-port", "0", "--log-level", "info")
    svc.start_broker()
    try:
        url = svc.info["metrics"]
        # Liveness: the broker runs, workers or not. Readiness: no workers yet, and it says so.
        assert json.loads(urllib.request.urlopen(url + "/healthz", timeout=5).read())["status"] == "ok"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + "/readyz", timeout=5)
        assert err.value.code == 503
        assert json.loads(err.value.read())["problems"] == ["no ready workers"]
        svc.start_worker("w1")
        ready = json.loads(urllib.request.urlopen(url + "/readyz", timeout=5).read())
        assert ready["status"] == "ready" and ready["ready_workers"] == 1 and ready["queue"] == 0
        with svc.client() as client:
            client.generate("metrics")
            with pytest.raises(InvalidRequest):
                client.generate("x", temperature=60.0)
        text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        assert 'tinyloop_requests_total{op="generate",outcome="done"} 1.0' in text
        assert 'tinyloop_errors_total{code="mode_error"} 1.0' in text
        assert 'tinyloop_stop_reasons_total{reason="max_tokens"} 1.0' in text
        assert "tinyloop_output_tokens_total 7.0" in text
        assert "tinyloop_ready_workers 1.0" in text
        assert "tinyloop_time_to_first_token_seconds_count 1.0" in text
        svc.broker.send_signal(signal.SIGTERM)
        svc.broker.wait(10)
        log_lines = (svc.dir / "broker.log").read_text().splitlines()
        lines = [json.loads(line[line.index("{"):]) for line in log_lines if "tinyloop.requests" in line]
        done = [line for line in lines if line["outcome"] == "done"]
        assert done and done[0]["worker"] == "w1" and done[0]["stats"]["stop_reason"] == "max_tokens"
        assert {"prefill_ms", "first_token_ms", "decode_ms"} <= set(done[0]["stats"])
    finally:
        svc.close()
