"""ZeroMQ CURVE: encryption and peer authentication for endpoints that cross hosts.

`tinyloop keys DIR` creates a key directory:

    DIR/broker.key         broker public key      (give to clients and workers)
    DIR/broker.key_secret  broker key pair         (broker only)
    DIR/client.key_secret  client key pair         (clients and workers)
    DIR/authorized/        public keys the broker accepts (client.key is put here)

The broker (`--curve-dir DIR`) makes both of its sockets CURVE servers and runs a ZAP
authenticator that admits only peers whose public key is in DIR/authorized. Clients and
workers (`--curve-dir DIR`, or `Client(..., curve_dir=DIR)`) need broker.key and
client.key_secret. A peer without an authorized key cannot connect: ZeroMQ drops it during
the handshake, so its requests are never seen (the client times out).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


def create_keys(directory: str | Path) -> Path:
    """Create a fresh broker and client key pair in `directory` (see the module doc)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(directory, "broker")
    client_public, _ = zmq.auth.create_certificates(directory, "client")
    authorized = directory / "authorized"
    authorized.mkdir(exist_ok=True)
    shutil.copy(client_public, authorized / "client.key")
    return directory


def start_authenticator(context: zmq.Context, directory: str | Path) -> ThreadAuthenticator:
    """Admit only CURVE peers whose public keys are in DIR/authorized (must run before bind)."""
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve(domain="*", location=str(Path(directory) / "authorized"))
    return auth


def make_server(sock: zmq.Socket, directory: str | Path) -> None:
    public, secret = zmq.auth.load_certificate(Path(directory) / "broker.key_secret")
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def make_client(sock: zmq.Socket, directory: str | Path) -> None:
    directory = Path(directory)
    public, secret = zmq.auth.load_certificate(directory / "client.key_secret")
    server_public, _ = zmq.auth.load_certificate(directory / "broker.key")
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public
