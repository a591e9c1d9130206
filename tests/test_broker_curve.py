"""CURVE over TCP: only peers holding an authorized key reach the broker, and traffic is encrypted."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

REPO = Path(__file__).resolve().parent.parent

from broker.client import Client, RequestTimeout  # noqa: E402
from broker.security import create_keys  # noqa: E402
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
