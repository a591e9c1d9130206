"""`tinyloop serve` with the real model: kill a worker under concurrent load, restart,
clean shutdown on SIGTERM, and the launcher's summed memory-plan check (one test: each
start of the service loads the model in every worker, which is the slow part)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

from broker import launcher  # noqa: E402
from broker.client import Client, ServiceError, WorkerLost  # noqa: E402

MODEL = os.environ.get("TINYLOOP_SERVICE_TEST_MODEL")  # None: the bundled model
MODEL_ARGS = ["--model", MODEL] if MODEL else []
WORKER_ARGS = [*MODEL_ARGS, "--max-seq-len", "256", "--threads", "1", "--heartbeat-interval", "0.3"]


def start_serve(tmp: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        launcher.service_command("serve", "--workers", "2", "--frontend", f"ipc://{tmp}/f", "--backend",
                                 f"ipc://{tmp}/b", "--log-dir", str(tmp / "logs"), *WORKER_ARGS, *extra),
        env=launcher.child_env(), cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )


@pytest.fixture
def tmp():
    path = Path(tempfile.mkdtemp(prefix="tls-", dir="/tmp"))  # ipc paths must be short
    yield path
    shutil.rmtree(path, ignore_errors=True)


def first_event_batch(replay_endpoint: str) -> list:
    """Batch 0 of a worker's KV-cache events, asked of its replay socket: [ts, events, data_parallel_rank]."""
    import msgpack
    import zmq

    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:
        dealer.linger = 0
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert dealer.poll(10_000), replay_endpoint
        _, seq, payload = dealer.recv_multipart()
        assert int.from_bytes(seq, "big") == 0
        return msgpack.unpackb(payload)


def test_kill_worker_under_load_restart_clean_shutdown_and_plan_check(tmp):
    # each worker publishes KV-cache events on an endpoint of its own, as vLLM's data-parallel ranks do
    serve = start_serve(tmp, "--kv-events-endpoint", f"ipc://{tmp}/kv", "--kv-events-replay-endpoint",
                        f"ipc://{tmp}/kvr")
    try:
        status = launcher.wait_for_workers(f"ipc://{tmp}/f", 2, 300, [serve])
        for rank, suffix in ((0, ""), (1, "-1")):  # w1 on the endpoints as given, w2 on the next ones
            assert (tmp / f"kv{suffix}").exists()
            _, events, batch_rank = first_event_batch(f"ipc://{tmp}/kvr{suffix}")
            assert events == [["AllBlocksCleared"]] and batch_rank == rank
        pids = {w["name"]: w["pid"] for w in status["workers"]}
        plan_bytes = status["workers"][0]["plan_bytes"]
        # The ready line says what the lanes are and what the pool holds, each as itself ("24 of the 16 lanes" was not)
        ready = next(line for line in (tmp / "logs" / "w2.log").read_text().splitlines() if " ready on " in line)
        assert re.search(r"; 16 lanes; the pool holds \d+ sequence\(s\) of 256 tokens at \d+ loops;", ready), ready
        with Client(f"ipc://{tmp}/f", timeout=60) as client:
            streamed = [client.submit("generate", {"prompt": f"def f{i}(x):\n", "max_tokens": 128}, stream=True)
                        for i in range(4)]
            plain = [client.submit("generate", {"prompt": f"class C{i}:\n", "max_tokens": 128}) for i in range(6)]
            # Kill w1 as soon as it is busy with a request that has already streamed: the kill lands mid-request
            # however fast the model decodes.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                w1 = {w["name"]: w for w in client.status()["workers"]}.get("w1", {})
                if w1.get("state") == "busy" and w1.get("streamed", 0) > 0:
                    break
                time.sleep(0.01)
            os.kill(pids["w1"], signal.SIGKILL)

            tokens: dict[str, list[int]] = {}
            outcomes: dict[str, tuple] = {}
            for p in streamed:
                tokens[p.id] = []
                try:
                    for event in p:
                        tokens[p.id].append(event.token)
                    outcomes[p.id] = ("done", p.result())
                except ServiceError as err:
                    outcomes[p.id] = ("error", err)
            for p in plain:
                try:
                    outcomes[p.id] = ("done", p.result())
                except ServiceError as err:
                    outcomes[p.id] = ("error", err)
            assert not client.socket.poll(500), "a request got a second final reply"

            assert len(outcomes) == 10
            for p in plain:  # nothing was streamed for these: a lost worker's ones were retried
                assert outcomes[p.id][0] == "done", outcomes[p.id]
            for p in streamed:
                kind, value = outcomes[p.id]
                if kind == "done":
                    assert value.tokens == tokens[p.id], "streamed tokens duplicated or lost"
                else:
                    assert isinstance(value, WorkerLost), value
            # The kill hit a request in flight: it either failed (had streamed) or was re-queued.
            lost = sum(1 for kind, _ in outcomes.values() if kind == "error")
            requeued = (tmp / "logs" / "broker.log").read_text().count("re-queueing request")
            assert lost + requeued >= 1
            # The launcher restarts w1 (a new process).
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                workers = {w["name"]: w["pid"] for w in client.status()["workers"]}
                if "w1" in workers and workers["w1"] != pids["w1"]:
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"w1 was not restarted: {workers}")
            assert client.generate("x = 1\n", max_tokens=2).stats["generated_tokens"] >= 1

            # SIGTERM: the running request still gets its answer, then everything stops.
            running = client.submit("generate", {"prompt": "import os\n", "max_tokens": 16})
            time.sleep(0.3)
            serve.send_signal(signal.SIGTERM)
            assert running.result().stats["generated_tokens"] >= 1
        assert serve.wait(60) == 0
        _, err = serve.communicate(timeout=5)
        assert "all 2 workers ready" in err and "restarting it" in err and "stopped" in err

        # Room for one and a half workers: the launcher refuses before starting anything.
        shutil.rmtree(tmp / "logs")
        serve = start_serve(tmp, "--device-budget", str(int(plan_bytes * 1.5)))
        _, err = serve.communicate(timeout=300)
        assert serve.returncode == 3, err
        assert "refusing to start: 2 workers" in err and "KV block pool" in err
        assert not (tmp / "logs" / "broker.log").exists()
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(10)
