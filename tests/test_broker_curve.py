"""CURVE over TCP: only peers holding an authorized key reach the broker, and traffic is encrypted."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

REPO = Path(__file__).resolve().parent.parent

from broker import protocol  # noqa: E402
from broker.client import Client, RequestTimeout  # noqa: E402
from broker.security import WORKER, create_keys, make_client  # noqa: E402
from test_broker import Service  # noqa: E402


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    keys = create_keys(tmp_path_factory.mktemp("keys"))
    svc = Service("--curve-dir", str(keys), tcp=True, curve_dir=str(keys))
    svc.start_broker()
    svc.start_worker("w1", curve_dir=str(keys))
    yield svc, keys
    svc.close()


def test_authorized_client_and_worker_are_served(secured):
    svc, keys = secured
    with Client(svc.frontend, curve_dir=str(keys), timeout=10) as client:
        assert client.generate("secret").text == "secret"
        assert [w["name"] for w in client.status()["workers"]] == ["w1"]


def test_plain_client_is_not_heard(secured):
    svc, _ = secured
    with Client(svc.frontend, timeout=0.3, grace=0.2) as client:
        with pytest.raises(RequestTimeout):
            client.generate("let me in")


def test_client_with_unknown_key_is_rejected(secured, tmp_path):
    svc, keys = secured
    other = create_keys(tmp_path / "other")
    (other / "broker.key").write_bytes((keys / "broker.key").read_bytes())  # knows the broker, but is not authorized
    with Client(svc.frontend, curve_dir=str(other), timeout=0.3, grace=0.2) as client:
        with pytest.raises(RequestTimeout):
            client.generate("let me in")


def test_worker_with_unknown_key_never_joins(secured, tmp_path):
    svc, keys = secured
    other = create_keys(tmp_path / "other")
    (other / "broker.key").write_bytes((keys / "broker.key").read_bytes())
    svc.start_worker("intruder", curve_dir=str(other), wait=False)
    import time

    time.sleep(1.0)
    with Client(svc.frontend, curve_dir=str(keys), timeout=5) as client:
        assert [w["name"] for w in client.status()["workers"]] == ["w1"]
    assert zmq.has("curve")


def role_dir(keys: Path, tmp_path: Path, secret: str) -> Path:
    """A peer's key directory holding the broker's public key and `secret` under the client's file name."""
    peer = tmp_path / f"holds-{secret}"
    peer.mkdir()
    (peer / "broker.key").write_bytes((keys / "broker.key").read_bytes())
    for name in ("client.key_secret", "worker.key_secret"):
        (peer / name).write_bytes((keys / secret).read_bytes())
    return peer


def test_a_client_key_cannot_serve_as_a_worker_nor_a_worker_key_submit(secured, tmp_path):
    """The gateway pod's client key, used as a worker: it announces itself, waits for prompts and answers every one
    with a forgery. It is never admitted: it receives no request and every client gets the real worker's answer."""
    svc, keys = secured
    stolen = role_dir(keys, tmp_path, "client.key_secret")
    evil = zmq.Context.instance().socket(zmq.DEALER)
    evil.linger = 0
    evil.setsockopt(zmq.IDENTITY, b"evil")
    make_client(evil, stolen, WORKER)
    evil.connect(svc.backend)
    evil.send_multipart(protocol.encode(protocol.WORKER_TO_BROKER, "ready", name="evil", pid=1, ops=["generate"],
                                        plan_bytes=0, max_handles=0, device="cpu", model="m", slots=64))
    seen = []
    try:
        with Client(svc.frontend, curve_dir=str(keys), timeout=10) as client:
            pending = [client.submit("generate", {"prompt": f"my secret prompt {i}"}) for i in range(6)]
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                if evil.poll(50):
                    msg = protocol.decode(protocol.BROKER_TO_WORKER, evil.recv_multipart())
                    seen.append(msg.type)
                    if msg.type == "request":
                        evil.send_multipart(protocol.encode(protocol.WORKER_TO_BROKER, "done", id=msg["id"],
                                                            result={"text": "FORGED BY EVIL WORKER", "tokens": []}))
            texts = [p.result().text for p in pending]
            assert texts == [f"my secret prompt {i}" for i in range(6)]
            assert [w["name"] for w in client.status()["workers"]] == ["w1"]
        assert seen == []  # not even a heartbeat: the handshake never completed
    finally:
        evil.close()
    # The other way round: a worker key on the clients' socket is not heard either.
    with Client(svc.frontend, curve_dir=str(role_dir(keys, tmp_path, "worker.key_secret")), timeout=0.3,
                grace=0.2) as client:
        with pytest.raises(RequestTimeout):
            client.generate("let me in")
