"""Network namespaces as hosts, for tests that need a real network between processes (root and `ip netns`).

A namespace has its own network stack, so a process started in it (`Host.run`) reaches the others only
over its link, as on another machine. Two shapes:

* `veth_host`: one namespace linked to this one by a veth pair (test_broker_netns.py).
* `Lan`: a switch (a bridge in this namespace, itself a host on it at .254) with any number of host
  namespaces on it, each by one link. `Host.cut` unplugs a host's link at the switch: its processes live
  on, their packets go nowhere, nobody is told (a lost host, not a dead process). `Host.restore` plugs it
  back. `Host.hosts` writes the host's /etc/hosts (`ip netns exec` mounts /etc/netns/NAME/hosts there),
  the stand-in for the cluster DNS.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path



def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


def require_netns() -> None:
    """The host tests are part of the suite (CI runs as root): fail, never skip, where they cannot run."""
    assert os.geteuid() == 0 and shutil.which("ip") is not None, \
        "the network-namespace tests need root and iproute2 (`ip netns`)"


def add_namespace(ns: str, here: str, there: str) -> None:
    """Namespace `ns` with the `there` end of a veth pair inside it (up, no address yet) and `here` outside."""
    sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
    sh("ip", "link", "set", there, "netns", ns)
    sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")


def delete_namespace(ns: str, here: str) -> None:
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)  # gone with ns, usually
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


@contextlib.contextmanager
def veth_host():
    """A namespace "remote" linked to this one by a veth pair: 10.77.x.1 here, 10.77.x.2 there. Yields (ns, here ip)."""
    require_netns()
    tag = uuid.uuid4().hex[:6]
    ns, here, there = f"tl{tag}", f"tla{tag}", f"tlb{tag}"
    subnet = f"10.77.{int(tag[:2], 16)}"
    try:
        add_namespace(ns, here, there)
        sh("ip", "addr", "add", f"{subnet}.1/30", "dev", here)
        sh("ip", "link", "set", here, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{subnet}.2/30", "dev", there)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", there, "up")
        yield ns, f"{subnet}.1"
    finally:
        delete_namespace(ns, here)


@dataclass
class Host:
    """A namespace on a Lan: `ip`, its link `port` (the switch's end) and `nic` (its own end)."""

    lan: "Lan"
    ns: str
    port: str
    nic: str
    ip: str

    def run(self, argv: list[str]) -> list[str]:
        """argv run on this host."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def cut(self) -> None:
        """Unplug the link at the switch: nothing reaches the host or leaves it, and it is not told."""
        sh("ip", "link", "set", self.port, "nomaster")

    def restore(self) -> None:
        sh("ip", "link", "set", self.port, "master", self.lan.bridge)

    def mac(self) -> str:
        out = subprocess.run(self.run(["cat", f"/sys/class/net/{self.nic}/address"]), check=True,
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip()

    def hosts(self, names: dict[str, str]) -> None:
        """This host's /etc/hosts: name -> address. Written in place (the mount follows the file, not its name),
        read again by every lookup (glibc does not cache /etc/hosts)."""
        path = Path(f"/etc/netns/{self.ns}/hosts")
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for name, ip in names.items())
        with open(path, "r+" if path.exists() else "w") as f:
            f.truncate(0)
            f.write(text)


class Lan:
    """A switch and the hosts on it: 10.78.x.0/24, this namespace at .254."""

    def __init__(self) -> None:
        require_netns()
        self.tag = uuid.uuid4().hex[:5]
        self.subnet = f"10.78.{int(self.tag[:2], 16)}"
        self.bridge = f"tlbr{self.tag}"
        self.hosts_: list[Host] = []
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        self.ip = f"{self.subnet}.254"

    def host(self, suffix: int, mac: str | None = None) -> Host:
        """A new host at .suffix, plugged in. With `mac` (and the address of an unplugged host) it stands in for
        that host as a Service's stable address would: peers reach it without learning a new address."""
        n = len(self.hosts_)
        host = Host(self, f"tl{self.tag}h{n}", f"tlp{self.tag}h{n}", f"tln{self.tag}h{n}", f"{self.subnet}.{suffix}")
        add_namespace(host.ns, host.port, host.nic)
        self.hosts_.append(host)
        in_ns = ["ip", "netns", "exec", host.ns, "ip"]
        if mac:
            sh(*in_ns, "link", "set", host.nic, "address", mac)
        sh(*in_ns, "addr", "add", f"{host.ip}/24", "dev", host.nic)
        sh(*in_ns, "link", "set", host.nic, "up")
        sh("ip", "link", "set", host.port, "master", self.bridge, "up")
        return host

    def close(self) -> None:
        for host in self.hosts_:
            delete_namespace(host.ns, host.port)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
