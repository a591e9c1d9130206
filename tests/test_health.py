"""Health that tells the truth: /healthz is liveness, /readyz (and `tinyloop status`) says whether the service
can serve now and names every reason it cannot. A real broker process with echo workers (test_broker.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

from broker import launcher
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
    svc = Service("--metrics-port", "0", "--max-queue", "2", "--ready-window", "30", "--ready-max-error-rate", "0.5")
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
