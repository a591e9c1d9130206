"""Chaos: `tinyloop serve` with the real bundled model while workers and the broker are SIGKILLed.

Waves of N greedy requests, half of them streamed, from a sync Client and an AsyncClient at once.
Meanwhile a killer thread SIGKILLs a busy worker several times (waiting for `serve` to bring it back in
between) and the broker once. A new wave starts while the killer still has kills to make, so the test
does not depend on how fast the model decodes (a bounded number of waves). Every request must get
exactly one final answer, no client may see a token twice, and every text must equal the undisturbed
run (the runtime called in-process). The counts are printed (`pytest -s`) and recorded as test properties.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

import tinyloop
from broker import launcher
from broker.client import AsyncClient, Client, ServiceError

REPO = Path(__file__).resolve().parent.parent
N_REQUESTS = 32
MAX_TOKENS = 160
MAX_WAVES = 8  # waves of N_REQUESTS until the killer is done (a restart takes seconds, a wave may take less)
WAVES_SECONDS = 150  # no wave starts after this
MAX_SEQ_LEN = 256
WORKER_KILLS = 3
HEARTBEAT = 0.3
PROMPTS = [f"def function_{i}(x, y):\n" if i % 3 == 0 else f"class Thing{i}:\n" if i % 3 == 1 else f"import os{i}\n"
           for i in range(N_REQUESTS)]


@pytest.fixture
def tmp():
    path = Path(tempfile.mkdtemp(prefix="tlc-", dir="/tmp"))  # ipc paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


def undisturbed() -> list[list[int]]:
    """Every prompt's answer in-process, in one generate_batch (6 s here, one generate after another 21 s): its
    results are generate's, prompt by prompt (tests/test_batch.py)."""
    import torch

    torch.set_num_threads(1)  # like the workers
    model = tinyloop.load_model(None, MAX_SEQ_LEN)
    try:
        cfg = tinyloop.GenerateConfig(max_tokens=MAX_TOKENS)
        return [r.tokens for r in tinyloop.generate_batch(model, PROMPTS, cfg)]
    finally:
        tinyloop.free_model(model)


class Killer(threading.Thread):
    """Kills a busy worker, waits until serve restarted it, and so on; the broker once, after the first kill."""

    def __init__(self, frontend: str, stop: threading.Event):
        super().__init__(daemon=True)
        self.frontend, self.stop = frontend, stop
        self.worker_kills = self.broker_kills = 0
        self.last_killed = None  # pid of the last worker killed
        self.waited_since = time.monotonic()
        self.error: BaseException | None = None

    def status(self, client: Client) -> dict | None:
        try:
            return client.status(timeout=2)
        except ServiceError:
            return None

    def run(self) -> None:
        try:
            with Client(self.frontend, timeout=30) as client:
                while not self.stop.is_set() and (self.worker_kills < WORKER_KILLS or not self.broker_kills):
                    status = self.status(client)
                    busy = [w for w in (status or {}).get("workers", []) if w["state"] == "busy"]
                    # the broker must have noticed the last kill (and settled that worker's requests) first: a
                    # broker killed before then would take the re-queueing, and its log line, down with it
                    noticed = status is not None and all(w["pid"] != self.last_killed for w in status["workers"])
                    if status is None or not noticed or len(status["workers"]) < 2 or not busy:
                        time.sleep(0.1)  # wait for both workers back and one of them at work
                        self.waited_since = time.monotonic()
                        continue
                    # Prefer a worker in the middle of a stream (its request must then be continued).
                    streaming = [w for w in busy if w["streamed"] > 0]
                    if not streaming and time.monotonic() < self.waited_since + 3:
                        time.sleep(0.05)
                        continue
                    busy = streaming or busy
                    self.waited_since = time.monotonic()
                    try:
                        if self.worker_kills == 1 and not self.broker_kills:
                            os.kill(status["pid"], signal.SIGKILL)
                            self.broker_kills += 1
                        else:
                            os.kill(busy[0]["pid"], signal.SIGKILL)
                            self.worker_kills += 1
                            self.last_killed = busy[0]["pid"]
                    except ProcessLookupError:
                        continue  # the broker still listed a worker that had died already: look again
                    time.sleep(1.0)
        except BaseException as exc:  # reported by the test
            self.error = exc


def sync_requests(frontend: str, indices: list[int], out: dict) -> None:
    with Client(frontend, timeout=150) as client:
        pendings = {i: client.submit("generate", {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS}, stream=i % 2 == 0)
                    for i in indices}
        for i, p in pendings.items():
            events: list = []
            try:
                events += [(e.pos, e.token) for e in p] if i % 2 == 0 else []
                out[i] = (p.result(), events)
            except ServiceError as err:  # a final answer too, but the test wants every one to succeed
                out[i] = (err, events)
        out["sync_reconnects"] = client.reconnects


async def async_requests(frontend: str, indices: list[int], out: dict) -> None:
    async with AsyncClient(frontend, timeout=150) as client:
        async def one(i: int) -> None:
            events: list = []
            try:
                if i % 2:
                    out[i] = (await client.generate(PROMPTS[i], max_tokens=MAX_TOKENS), [])
                    return
                result: list = []
                async for e in client.stream(PROMPTS[i], max_tokens=MAX_TOKENS, result=result):
                    events.append((e.pos, e.token))
                out[i] = (result[0], events)
            except ServiceError as err:
                out[i] = (err, events)

        await asyncio.gather(*(one(i) for i in indices))
        out["async_reconnects"] = client.reconnects


def test_chaos_kills_workers_and_the_broker(tmp, record_property):
    expected = undisturbed()
    serve = subprocess.Popen(
        launcher.service_command("serve", "--workers", "2", "--frontend", f"ipc://{tmp}/f", "--backend", f"ipc://{tmp}/b",
                                 "--log-dir", str(tmp / "logs"), "--max-seq-len", str(MAX_SEQ_LEN), "--threads", "1",
                                 "--heartbeat-interval", str(HEARTBEAT), "--max-attempts", "8", "--skip-plan-check",
                                 # two lanes per worker: a kill hits two requests in flight
                                 "--max-lanes", "2"),
        env=launcher.child_env(), cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    frontend = f"ipc://{tmp}/f"
    try:
        launcher.wait_for_workers(frontend, 2, 300, [serve])
        t0 = time.monotonic()
        stop = threading.Event()
        killer = Killer(frontend, stop)
        killer.start()
        sync_part = [i for i in range(N_REQUESTS) if i % 4 < 2]
        async_part = [i for i in range(N_REQUESTS) if i % 4 >= 2]
        waves: list[dict] = []
        while len(waves) < MAX_WAVES and time.monotonic() < t0 + WAVES_SECONDS and (not waves or killer.is_alive()):
            out: dict = {}
            sync_thread = threading.Thread(target=sync_requests, args=(frontend, sync_part, out))
            async_thread = threading.Thread(target=lambda: asyncio.run(async_requests(frontend, async_part, out)))
            sync_thread.start()
            async_thread.start()
            sync_thread.join(170)
            async_thread.join(170)
            waves.append(out)
        stop.set()
        killer.join(10)
        elapsed = time.monotonic() - t0

        answers = [(w, i) for w, out in enumerate(waves) for i in range(N_REQUESTS) if i in out]
        results = {(w, i): waves[w][i] for w, i in answers}
        duplicates = sum(1 for r in results.values() if r[1] and [pos for pos, _ in r[1]] != list(range(len(r[1]))))
        failed = {key: str(r[0]) for key, r in results.items() if isinstance(r[0], ServiceError)}
        mismatches = [key for key, r in results.items() if key not in failed and (r[0].tokens != expected[key[1]]
                      or (r[1] and [t for _, t in r[1]] != r[0].tokens))]
        log = (tmp / "logs" / "broker.log").read_text(errors="replace") if (tmp / "logs" / "broker.log").exists() else ""
        requests = N_REQUESTS * len(waves)
        counts = {"waves": len(waves), "requests": requests, "streamed": requests // 2,
                  "worker_kills": killer.worker_kills, "broker_kills": killer.broker_kills, "answers": len(answers),
                  "duplicates": duplicates, "mismatches": len(mismatches), "errors": len(failed),
                  "continued": log.count("token(s) delivered)") - log.count("(0 token(s)"),
                  "client_reconnects": sum(out.get("sync_reconnects", 0) + out.get("async_reconnects", 0) for out in waves),
                  "seconds": round(elapsed, 1)}
        print("chaos:", json.dumps(counts))
        for key, value in counts.items():
            record_property(key, value)
        assert killer.error is None, killer.error
        assert killer.worker_kills == WORKER_KILLS and killer.broker_kills == 1, counts
        assert len(answers) == requests, counts
        assert not failed, (counts, failed)
        assert duplicates == 0 and not mismatches, (counts, mismatches)
        assert counts["client_reconnects"] >= 2  # both clients rode out the broker restart
        assert counts["continued"] >= 1, counts  # at least one stream went on after its worker died
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait(10)
    _, err = serve.communicate(timeout=10)
    assert "died with code -9; restarting it on the same endpoints" in err
