"""Health that tells the truth: /healthz is liveness, /readyz (and `tinyloop status`) says whether the service
can serve now and names every reason it cannot. A real broker process with echo workers (test_broker.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
import urllib.error
import urllib.request

import msgpack
import zmq

from broker import launcher, protocol
from broker.client import RequestTimeout
from test_broker import REPO, Service


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def status_cli(svc: Service) -> str:
    out = subprocess.run([sys.executable, "-m", "scripts.cli", "status", "--connect", svc.frontend], capture_output=True,
                         text=True, timeout=60, cwd=str(REPO), env=launcher.child_env())
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_readiness_names_no_workers_a_full_queue_and_a_high_error_rate():
    svc = Service("--metrics-port", "0", "--max-queue", "2", "--ready-window", "30", "--ready-max-error-rate", "0.5",
                  "--ready-min-deadline", "0.05")  # the 0.1 s deadlines below count as the service's failures
    svc.start_broker()
    try:
        url = svc.info["metrics"]
        assert get(url + "/healthz")[0] == 200  # alive, though it cannot serve
        code, body = get(url + "/readyz")
        assert code == 503 and body["problems"] == ["no ready workers"]
        assert "ready: NO: no ready workers" in status_cli(svc)

        svc.start_worker("w1", delay=0.05)
        code, body = get(url + "/readyz")
        assert code == 200 and body["status"] == "ready" and body["problems"] == []
        assert "ready: yes" in status_cli(svc)

        with svc.client() as client:
            # A full queue: one request running, two waiting (the limit).
            running = client.submit("generate", {"prompt": "r" * 30})
            time.sleep(0.3)
            queued = [client.submit("generate", {"prompt": "q"}) for _ in range(2)]
            time.sleep(0.2)
            code, body = get(url + "/readyz")
            assert code == 503 and body["problems"] == ["the queue is full (2 of 2 waiting)"], body
            running.result(), [q.result() for q in queued]
            assert get(url + "/readyz")[0] == 200

            # Failures on the service's side (deadlines passing on a slow worker) past half of the recent requests.
            for _ in range(6):
                try:
                    client.generate("s" * 40, timeout=0.1)
                except RequestTimeout:
                    pass
            time.sleep(0.3)
            code, body = get(url + "/readyz")
            assert code == 503 and len(body["problems"]) == 1, body
            assert "failed (6 timeout)" in body["problems"][0] and "the limit is 50%" in body["problems"][0]
            assert body["error_rate"] >= 0.5 and body["finished"] == 9
            assert "6 timeout" in status_cli(svc)
            # The client's own mistakes are not the service's failures: they only add finished requests.
            try:
                client.generate("abc", temperature=60.0)  # the echo engine's mode_error
            except Exception as err:  # noqa: BLE001
                assert getattr(err, "code", None) == "mode_error"
            ready = client.status()["ready"]
            assert ready["finished"] == 10 and "failed (6 timeout)" in ready["problems"][0]
        assert get(url + "/healthz")[0] == 200
    finally:
        svc.close()


def test_what_clients_cause_never_turns_readiness_red():
    """200 requests whose failures are the client's own: deadlines too short to meet, template variables the
    renderer owns, a malformed grammar, an oversized prompt. Each gets its one error reply; /readyz stays 200."""
    svc = Service("--metrics-port", "0", "--ready-window", "60", "--ready-max-error-rate", "0.5")
    svc.start_broker()
    try:
        svc.start_worker("w1", delay=0.02)
        url = svc.info["metrics"]
        codes: dict[str, int] = {}
        with svc.client() as client:
            for _ in range(5):  # 150 deadlines of 1 ms, 30 at a time (the queue holds 64)
                for pending in [client.submit("generate", {"prompt": "t" * 20}, timeout=0.001) for _ in range(30)]:
                    try:
                        pending.result()
                        codes["done"] = codes.get("done", 0) + 1
                    except RequestTimeout:
                        codes["timeout"] = codes.get("timeout", 0) + 1
        # What this library refuses before sending, sent raw as another client could.
        bad = [("chat", {"messages": [{"role": "user", "content": "hi"}],
                         "chat_template_kwargs": {"messages": []}}),
               ("chat", {"messages": [{"role": "user", "content": "hi"}],
                         "chat_template_kwargs": {"add_generation_prompt": False}}),
               ("chat", {"messages": [{"role": "user", "content": "hi"}],
                         "chat_template_kwargs": {"raise_exception": "x"}}),
               ("generate", {"prompt": "x", "grammar": 7}),
               ("generate", {"prompt": "x" * ((1 << 20) + 1)})]
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.linger = 0
        raw.connect(svc.frontend)
        try:
            for i in range(50):
                op, params = bad[i % len(bad)]
                body = {"type": "request", "id": uuid.uuid4().hex, "op": op, "params": params, "timeout_s": 30.0}
                raw.send_multipart([protocol.PROTOCOL_TAG, msgpack.packb(body)])
                assert raw.poll(5000), "every request gets its one final reply"
                reply = protocol.decode(protocol.BROKER_TO_CLIENT, raw.recv_multipart(), 1 << 22)
                assert reply.type == "error" and reply["code"] in ("invalid_field", "too_large"), reply.fields
                if op == "chat":
                    assert "chat_template_kwargs" in reply["message"] and params["chat_template_kwargs"].keys() \
                        <= set(reply["message"].split("'")), reply["message"]
                codes[reply["code"]] = codes.get(reply["code"], 0) + 1
        finally:
            raw.close()
        assert sum(codes.values()) == 200 and codes.get("timeout", 0) >= 140, codes
        code, body = get(url + "/readyz")
        assert code == 200 and body["problems"] == [] and body["error_rate"] == 0.0, body
    finally:
        svc.close()
