"""Beyond one machine, for real: the worker and the client run in another network namespace
(their own network stack, reaching the broker only over a veth link, like a second host),
over TCP with CURVE. Needs root for `ip netns`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

from broker import launcher  # noqa: E402
from broker.security import create_keys  # noqa: E402
from netlab import veth_host  # noqa: E402
from test_broker import ECHO_WORKER, Service  # noqa: E402


@pytest.fixture
def remote_host():
    """A namespace "remote" linked to this one by a veth pair: 10.77.x.1 here, 10.77.x.2 there."""
    with veth_host() as host:
        yield host


def test_worker_and_client_on_another_host_over_curve(remote_host, tmp_path):
    ns, broker_ip = remote_host
    keys = create_keys(tmp_path / "keys")
    svc = Service("--curve-dir", str(keys), curve_dir=str(keys))
    svc.frontend = svc.backend = f"tcp://{broker_ip}:*"
    worker = None
    try:
        svc.start_broker()
        # The "remote" side gets only the files its worker and its client need.
        remote_keys = tmp_path / "remote-keys"
        remote_keys.mkdir()
        for name in ("broker.key", "client.key_secret", "worker.key_secret"):
            (remote_keys / name).write_bytes((keys / name).read_bytes())
        in_ns = ["ip", "netns", "exec", ns]
        worker = subprocess.Popen(
            [*in_ns, sys.executable, "-c", ECHO_WORKER, svc.backend, "remote-w", "0", "2", "100", str(remote_keys)],
            env=launcher.child_env(), cwd=str(REPO), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        workers = svc.wait_workers(lambda ws: [w["name"] for w in ws] == ["remote-w"], timeout=20)
        assert workers[0]["state"] == "idle"
        submit = subprocess.run(
            [*in_ns, *launcher.service_command("submit", "--connect", svc.frontend, "--curve-dir", str(remote_keys),
                                               "--json", "--timeout", "10", "hello from afar")],
            env=launcher.child_env(), cwd=str(REPO), capture_output=True, text=True, timeout=60,
        )
        assert submit.returncode == 0, submit.stderr
        reply = json.loads(submit.stdout)
        assert reply["text"] == "hello from afar" and reply["worker"] == "remote-w"
        # Without keys, the remote client is not heard at all.
        plain = subprocess.run(
            [*in_ns, *launcher.service_command("submit", "--connect", svc.frontend, "--timeout", "0.5", "--json", "x")],
            env=launcher.child_env(), cwd=str(REPO), capture_output=True, text=True, timeout=60,
        )
        assert plain.returncode == 1 and ("no reply" in plain.stderr or "no connection" in plain.stderr), plain.stderr
    finally:
        if worker is not None:
            worker.kill()
            worker.wait(5)
        svc.close()
