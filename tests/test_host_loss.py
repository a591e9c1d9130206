"""Host loss, for real: hosts are network namespaces on one switch (tests/netlab.py), and a lost host is one
whose link is cut at the switch: its processes live on, unreachable, and nobody is told.

* A broker host and two worker hosts with two model workers each (the real `tinyloop broker` and `tinyloop
  worker` commands, over TCP with CURVE). Under a bounded load (LOAD requests, half of them streamed, from a
  client on this host), one worker host's link is cut while it streams. Every request gets exactly one final
  answer, equal to the undisturbed one (the runtime in-process); no stream shows a token twice; the broker
  drops the lost workers within its heartbeat bound; when the link returns they register again and serve.
* The same with the broker host's link cut and a new broker started on another host at the same address
  (and MAC address: what a Service's stable address gives its clients): workers and clients find it alone.
* A broker found through a name (the record of a headless Service): a worker started before the name
  resolves waits for it, and when the broker moves to another address and the name follows, the worker and
  a running client (`tinyloop loadtest` on the worker's host) resolve it again and carry on. Underneath: libzmq
  resolves a tcp:// name again at every connection attempt (a bare DEALER whose name moves).

The figures (requests, losses, duplicates, time to detect) are printed (`pytest -s`), recorded as test
properties, and quoted in docs/deploy.md. Needs root for `ip netns`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import tinyloop
from broker.client import AsyncClient, Client, ServiceError
from netlab import Host, Lan, require_netns

REPO = Path(__file__).resolve().parent.parent
HEARTBEAT = 0.3  # seconds, broker and workers
LIVENESS = 3  # beats a worker may miss before the broker drops it (the broker's default; docs/service.md)
# Expiry, plus one heartbeat (the broker checks expiries once a beat), plus status polling on two busy cores.
DETECT_BOUND_S = (LIVENESS + 1) * HEARTBEAT + 0.6
REJOIN_BOUND_S = 15.0  # a worker's reconnect back-off tops out at 8 s
FRONT, BACK, METRICS = 5555, 5556, 9100
MAX_TOKENS, MAX_SEQ_LEN = 24, 128
LOAD, AFTER, CONCURRENCY = 160, 32, 24
PROMPTS = ["def add(a, b):\n", "class Point:\n", "import os\n", "for i in range(10):\n", "def main():\n",
           "with open(path) as f:\n", "if __name__ == '__main__':\n", "return [x for x in"]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "scripts.cli", *args]


def child_env() -> dict:
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def wait_until(predicate, timeout: float, what: str) -> float:
    """Poll `predicate` until it holds; returns the seconds it took. Fails after `timeout`."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - t0


def held_since(predicate, hold: float, timeout: float, what: str) -> float:
    """The time (monotonic) from which `predicate` held for `hold` seconds in a row. Fails after `timeout`."""
    t0, since = time.monotonic(), None
    while True:
        now = time.monotonic()
        since = (since or now) if predicate() else None
        if since is not None and now - since >= hold:
            return since
        if now - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def keys():
    """CURVE keys from `tinyloop keys`: (the broker's directory, the files clients and workers get)."""
    require_netns()
    root = Path(tempfile.mkdtemp(prefix="tlh-", dir="/tmp"))
    subprocess.run(cli("keys", str(root / "broker")), env=child_env(), cwd=REPO, check=True, capture_output=True,
                   timeout=60)
    (root / "peer").mkdir()
    for name in ("broker.key", "client.key_secret", "worker.key_secret"):
        (root / "peer" / name).write_bytes((root / "broker" / name).read_bytes())
    yield root / "broker", root / "peer"
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    """The undisturbed answers: the runtime in-process, one thread like the workers."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tinyloop.load_model(None, MAX_SEQ_LEN)
    try:
        cfg = tinyloop.GenerateConfig(max_tokens=MAX_TOKENS)
        return {p: tinyloop.generate(model, p, cfg).tokens for p in PROMPTS}
    finally:
        tinyloop.free_model(model)
        torch.set_num_threads(threads)


class Cluster:
    """One test's switch and the processes on its hosts (each killed by its pid at the end)."""

    def __init__(self, keys: tuple[Path, Path]):
        self.broker_keys, self.peer_keys = keys
        self.dir = Path(tempfile.mkdtemp(prefix="tlh-", dir="/tmp"))
        self.lan = Lan()
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, host: Host, name: str, *args: str) -> subprocess.Popen:
        with open(self.dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(host.run(cli(*args)), env=child_env(), cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def broker(self, host: Host, name: str = "broker") -> subprocess.Popen:
        """A broker listening on `host`. --max-attempts 6: a returned worker may be registered, handed requests and
        dropped once more before it settles (docs/deploy.md, "Found by this test"); that costs a request an
        attempt, and this test is about losses, not about that."""
        ready = self.dir / f"{name}.json"
        proc = self.start(host, name, "broker", "--frontend", f"tcp://{host.ip}:{FRONT}",
                          "--backend", f"tcp://{host.ip}:{BACK}", "--curve-dir", str(self.broker_keys),
                          "--heartbeat-interval", str(HEARTBEAT), "--max-queue", "512", "--max-attempts", "6",
                          "--metrics-port", str(METRICS), "--metrics-host", host.ip, "--ready-file", str(ready))
        wait_until(lambda: ready.exists() or proc.poll() is not None, 30, f"{name} listening")
        assert proc.poll() is None, self.log(name)
        return proc

    def worker(self, host: Host, name: str, broker: str) -> subprocess.Popen:
        return self.start(host, name, "worker", "--connect", f"tcp://{broker}:{BACK}", "--name", name,
                          "--curve-dir", str(self.peer_keys), "--max-seq-len", str(MAX_SEQ_LEN), "--max-lanes", "4",
                          "--threads", "1", "--heartbeat-interval", str(HEARTBEAT))

    def workers_at(self, address: str) -> set[str]:
        """Names of the workers the broker at `address` counts as alive now (empty when it does not answer)."""
        try:
            with Client(f"tcp://{address}:{FRONT}", curve_dir=str(self.peer_keys)) as client:
                return {w["name"] for w in client.status(timeout=1.0)["workers"] if w["state"] != "leaving"}
        except ServiceError:
            return set()

    def status(self, address: str) -> dict:
        with Client(f"tcp://{address}:{FRONT}", curve_dir=str(self.peer_keys)) as client:
            return client.status(timeout=2.0)

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")[-3000:]

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        self.lan.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def cluster(keys):
    c = Cluster(keys)
    yield c
    c.close()


class Load(threading.Thread):
    """Requests `indices` (even ones streamed) from one AsyncClient, CONCURRENCY at a time, in its own thread."""

    def __init__(self, frontend: str, curve_dir: str, indices: range):
        super().__init__(daemon=True)
        self.frontend, self.curve_dir, self.indices = frontend, curve_dir, indices
        self.out: dict[int, tuple] = {}  # index -> (Reply or ServiceError, [(pos, token) streamed])
        self.streams: dict[int, list] = {}  # index -> [(pos, token)] of a stream so far
        self.twice: list[int] = []  # requests that got a second final answer (must stay empty)
        self.reconnects = 0

    def run(self) -> None:
        asyncio.run(self.main())

    async def main(self) -> None:
        async with AsyncClient(self.frontend, timeout=60, curve_dir=self.curve_dir, heartbeat=HEARTBEAT) as client:
            gate = asyncio.Semaphore(CONCURRENCY)
            await asyncio.gather(*(self.one(client, gate, i) for i in self.indices))
            self.reconnects = client.reconnects

    async def one(self, client: AsyncClient, gate: asyncio.Semaphore, i: int) -> None:
        async with gate:
            prompt, events = PROMPTS[i % len(PROMPTS)], self.streams.setdefault(i, [])
            try:
                if i % 2:
                    answer = await client.generate(prompt, max_tokens=MAX_TOKENS, timeout=60)
                else:
                    result: list = []
                    async for e in client.stream(prompt, max_tokens=MAX_TOKENS, timeout=60, result=result):
                        events.append((e.pos, e.token))
                    answer = result[0]
            except ServiceError as err:  # a final answer too; the tests want none of them
                answer = err
            if i in self.out:
                self.twice.append(i)
            self.out[i] = (answer, events)

    def streaming(self) -> bool:
        """Is a stream in flight with tokens delivered?"""
        return any(events and i not in self.out for i, events in list(self.streams.items()))


def tally(load: Load, expected: dict[str, list[int]]) -> dict:
    """What the client saw: answers, errors, tokens seen twice, answers unlike the undisturbed run."""
    replies = {i: r for i, (r, _) in load.out.items() if not isinstance(r, ServiceError)}
    duplicates = sum(len(ev) - len({pos for pos, _ in ev}) for _, ev in load.out.values())
    mismatches = [i for i, r in replies.items() if r.tokens != expected[PROMPTS[i % len(PROMPTS)]]
                  or (i % 2 == 0 and [t for _, t in load.out[i][1]] != r.tokens)]
    return {"requests": len(load.indices), "streamed": len([i for i in load.indices if i % 2 == 0]),
            "answers": len(load.out), "lost": len(load.indices) - len(load.out), "twice": len(load.twice),
            "errors": len(load.out) - len(replies), "duplicates": duplicates, "mismatches": len(mismatches),
            "continued": sum(1 for r in replies.values() if r.stats.get("continued_after")),
            "client_reconnects": load.reconnects}


def assert_clean(counts: dict, load: Load) -> None:
    errors = {i: str(r) for i, (r, _) in load.out.items() if isinstance(r, ServiceError)}
    assert counts["lost"] == 0 and counts["twice"] == 0, counts
    assert counts["errors"] == 0, (counts, errors)
    assert counts["duplicates"] == 0 and counts["mismatches"] == 0, counts


def report(name: str, counts: dict, record_property) -> None:
    print(f"{name}:", json.dumps(counts))
    for key, value in counts.items():
        record_property(key, value)


def metric(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}:{METRICS}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def start_pool(cluster: Cluster, hosts: list[Host], broker_ip: str) -> dict[str, list[str]]:
    """Two workers on each worker host, connected to the broker at broker_ip; returns host ns -> names."""
    names = {}
    for n, host in enumerate(hosts, 1):
        names[host.ns] = [f"h{n}-w{k}" for k in (1, 2)]
        for name in names[host.ns]:
            cluster.worker(host, name, broker_ip)
    everyone = {name for group in names.values() for name in group}
    wait_until(lambda: cluster.workers_at(broker_ip) >= everyone, 60, "four workers registered")
    return names


def cut_while_streaming(cluster: Cluster, broker_ip: str, host: Host, names: set[str], load: Load) -> dict:
    """Cut `host`'s link once its workers stream and the load is under way; wait until the broker drops them."""
    with Client(f"tcp://{broker_ip}:{FRONT}", curve_dir=str(cluster.peer_keys)) as watch:
        def streaming() -> bool:  # the cut must catch streams in the middle, on the host to be lost
            busy = [w for w in watch.status(timeout=2)["workers"] if w["name"] in names and w["streamed"]]
            return len(load.out) >= 16 and bool(busy)

        wait_until(streaming, 60, "the host streaming under load")
    host.cut()
    t_cut = time.monotonic()
    detect = wait_until(lambda: not (cluster.workers_at(broker_ip) & names), 10, "lost workers dropped")
    return {"t_cut": t_cut, "detect_s": round(detect, 2), "alive": all(cluster.procs[n].poll() is None for n in names),
            "dropped": metric(broker_ip, "tinyloop_workers_lost_total"),
            "ready": urllib.request.urlopen(f"http://{broker_ip}:{METRICS}/readyz", timeout=5).status}


def restore_and_settle(cluster: Cluster, broker_ip: str, host: Host, names: set[str]) -> dict:
    """Plug the link back; wait until the workers are registered, and registered for good (still there after a
    heartbeat expiry: a worker may first be registered from a connection it is about to drop, then dropped again,
    which the broker counts as one more lost worker)."""
    host.restore()
    t_restore = time.monotonic()
    back = lambda: cluster.workers_at(broker_ip) >= names  # noqa: E731
    rejoin = wait_until(back, REJOIN_BOUND_S, "lost workers back")
    settled = held_since(back, 2.0, REJOIN_BOUND_S, "lost workers back for good") - t_restore
    return {"t_restore": t_restore, "rejoin_s": round(rejoin, 2), "settled_s": round(settled, 2)}


def test_a_worker_host_lost_under_load_and_back(cluster, expected, record_property):
    lan = cluster.lan
    broker_host, lost, kept = lan.host(1), lan.host(11), lan.host(12)
    cluster.broker(broker_host)
    lost_names = set(start_pool(cluster, [lost, kept], broker_host.ip)[lost.ns])
    t0 = time.monotonic()
    load = Load(f"tcp://{broker_host.ip}:{FRONT}", str(cluster.peer_keys), range(LOAD))
    load.start()
    cut = cut_while_streaming(cluster, broker_host.ip, lost, lost_names, load)
    time.sleep(max(0.0, cut["t_cut"] + 2 * cut["detect_s"] + 1.0 - time.monotonic()))  # away a while longer
    back = restore_and_settle(cluster, broker_host.ip, lost, lost_names)
    load.join(90)
    after = Load(f"tcp://{broker_host.ip}:{FRONT}", str(cluster.peer_keys), range(LOAD, LOAD + AFTER))
    after.run()  # in this thread: every request of it answered too, and the returned host takes its share
    counts = {**tally(load, expected), "detect_s": cut["detect_s"], "detect_bound_s": round(DETECT_BOUND_S, 2),
              "cut_for_s": round(back["t_restore"] - cut["t_cut"], 1), "rejoin_s": back["rejoin_s"],
              "settled_s": back["settled_s"], "workers_lost": cut["dropped"],
              "flaps": metric(broker_host.ip, "tinyloop_workers_lost_total") - cut["dropped"],
              "requeued": metric(broker_host.ip, "tinyloop_retries_total"), "after_requests": AFTER,
              "after_answers": len(after.out),
              "after_by_returned_host": sum(getattr(r, "worker", None) in lost_names for r, _ in after.out.values()),
              "seconds": round(time.monotonic() - t0, 1)}
    report("worker host lost", counts, record_property)
    assert cut["alive"], "the lost host's workers live on (cut, not killed)"
    assert cut["detect_s"] <= DETECT_BOUND_S, counts
    assert cut["dropped"] == len(lost_names) and cut["ready"] == 200, counts  # the other host serves on
    assert_clean(counts, load)
    assert_clean(tally(after, expected), after)
    assert counts["continued"] >= 1, counts  # a stream cut in the middle went on on the other host
    assert counts["after_by_returned_host"] >= 1, counts


def test_the_broker_host_lost_under_load_and_replaced_at_its_address(cluster, expected, record_property):
    lan = cluster.lan
    old_host, w1, w2 = lan.host(1), lan.host(11), lan.host(12)
    old = cluster.broker(old_host, "broker-old")
    names = start_pool(cluster, [w1, w2], old_host.ip)
    everyone = {name for group in names.values() for name in group}
    t0 = time.monotonic()
    load = Load(f"tcp://{old_host.ip}:{FRONT}", str(cluster.peer_keys), range(LOAD))
    load.start()
    wait_until(lambda: len(load.out) >= 16 and load.streaming(), 60, "streams in flight")
    old_host.cut()
    t_cut = time.monotonic()
    new_host = lan.host(1, mac=old_host.mac())  # as a Service would: the same address
    cluster.broker(new_host, "broker-new")
    started = time.monotonic() - t_cut
    rejoin = wait_until(lambda: cluster.workers_at(new_host.ip) >= everyone, REJOIN_BOUND_S, "workers at the new one")
    rejoin += started
    load.join(90)
    counts = {**tally(load, expected), "new_broker_up_s": round(started, 2), "workers_rejoined_s": round(rejoin, 2),
              "seconds": round(time.monotonic() - t0, 1)}
    report("broker host lost", counts, record_property)
    assert old.poll() is None, "the old broker lives on (cut, not killed)"
    assert_clean(counts, load)
    assert counts["client_reconnects"] >= 1, counts
    assert counts["continued"] >= 1, counts  # a stream the old broker was relaying went on through the new one
    served = {w["name"]: w["served"] for w in cluster.status(new_host.ip)["workers"]}
    assert set(served) >= everyone and sum(served.values()) >= 1, served


# One ROUTER answering one message with its name (argv: endpoint name), and one DEALER on a name (argv: endpoint
# go-file): it asks once, waits for the go-file, asks again on the same socket.
ANSWER_ONCE = """
import sys, zmq
s = zmq.Context().socket(zmq.ROUTER)
s.bind(sys.argv[1])
peer, _ = s.recv_multipart()
s.send_multipart([peer, sys.argv[2].encode()])
s.close(linger=2000)
"""
ASK_TWICE = """
import os, sys, time, zmq
s = zmq.Context().socket(zmq.DEALER)
s.connect(sys.argv[1])
for n in range(2):
    while n and not os.path.exists(sys.argv[2]) and time.sleep(0.02) is None:
        pass
    s.send(b"?")
    print(s.recv().decode() if s.poll(10000) else "no answer", flush=True)
"""


def test_libzmq_resolves_a_name_again_on_each_reconnect(cluster):
    """What the workers and clients rely on when a Service's record moves: a tcp:// name is resolved on each
    connection attempt, not once at connect() (libzmq 4.x)."""
    lan = cluster.lan
    a, b, asker = lan.host(1), lan.host(2), lan.host(11)
    asker.hosts({"svc": a.ip})
    run = dict(env=child_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs = [subprocess.Popen(a.run([sys.executable, "-c", ANSWER_ONCE, f"tcp://{a.ip}:7000", "A"]), **run)]
    go = cluster.dir / "go"
    ask = subprocess.Popen(asker.run([sys.executable, "-c", ASK_TWICE, "tcp://svc:7000", str(go)]), **run)
    procs.append(ask)
    try:
        procs[0].wait(20)  # answered, and gone: the asker's connection drops and libzmq retries
        asker.hosts({"svc": b.ip})
        procs.append(subprocess.Popen(b.run([sys.executable, "-c", ANSWER_ONCE, f"tcp://{b.ip}:7000", "B"]), **run))
        time.sleep(0.5)
        go.touch()
        out, _ = ask.communicate(timeout=20)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert out.split() == ["A", "B"], out


def test_a_named_broker_is_waited_for_and_found_again_when_its_address_moves(cluster, record_property):
    lan = cluster.lan
    first, worker_host, second = lan.host(1), lan.host(11), lan.host(3)
    name = "tinyloop-broker"
    worker_host.hosts({})  # the name does not resolve yet (a headless Service with no ready pod)
    worker = cluster.worker(worker_host, "named-w", name)
    time.sleep(3.0)  # the model loads (about 1.5 s) and the worker tries a name nobody answers to
    assert worker.poll() is None, cluster.log("named-w")
    worker_host.hosts({name: first.ip})
    cluster.broker(first, "broker-first")
    found = wait_until(lambda: "named-w" in cluster.workers_at(first.ip), REJOIN_BOUND_S, "the worker finds the name")
    # A long-running client on the worker's host, through the name, while the broker moves.
    out = cluster.dir / "loadtest.json"
    client = cluster.start(worker_host, "loadtest", "loadtest", "--connect", f"tcp://{name}:{FRONT}", "--curve-dir",
                           str(cluster.peer_keys), "--requests", "60", "--concurrency", "4", "--max-tokens", "16",
                           "--timeout", "40", "--json", str(out))
    wait_until(lambda: cluster.status(first.ip)["in_flight"] > 0, 30, "the client's requests in flight")
    first.cut()
    t_cut = time.monotonic()
    cluster.broker(second, "broker-second")
    worker_host.hosts({name: second.ip})  # the record follows the new pod's address
    wait_until(lambda: "named-w" in cluster.workers_at(second.ip), REJOIN_BOUND_S, "the worker follows the name")
    moved = time.monotonic() - t_cut
    client.wait(60)
    results = json.loads(out.read_text())
    counts = {"worker_found_name_s": round(found, 2), "worker_followed_name_s": round(moved, 2),
              "client_requests": results["requests"], "client_ok": results["ok"], "client_errors": results["errors"]}
    report("named broker moved", counts, record_property)
    assert client.returncode == 0, cluster.log("loadtest")
    assert results["requests"] == results["ok"] == 60 and not results["errors"], counts
