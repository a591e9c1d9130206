"""ZeroMQ CURVE: encryption and peer authentication for endpoints that cross hosts, with one role per socket.

`tinyloop keys DIR` creates a key directory:

    DIR/broker.key          broker public key      (give to clients, gateways and workers)
    DIR/broker.key_secret   broker key pair        (broker only)
    DIR/client.key_secret   client key pair        (clients and gateways: the frontend)
    DIR/worker.key_secret   worker key pair        (workers: the backend)
    DIR/client.key, DIR/worker.key                 the two public keys
    DIR/authorized/clients/ public keys the broker admits on its frontend (client.key is put here)
    DIR/authorized/workers/ public keys the broker admits on its backend (worker.key is put here)

The broker (`--curve-dir DIR`) makes both of its sockets CURVE servers, each in its own ZAP domain, and runs a ZAP
authenticator that admits on the frontend only the keys in authorized/clients and on the backend only those in
authorized/workers. So a client key (what a gateway pod holds) cannot join as a worker, read prompts or answer
them, and a worker key cannot submit requests. A peer without an admitted key is dropped by ZeroMQ during the
handshake: nothing it sends is ever seen (a client times out). Clients and gateways (`--curve-dir DIR`, or
`Client(..., curve_dir=DIR)`) need broker.key and client.key_secret; workers need broker.key and
worker.key_secret. More keys of a role: put their public key files in that role's authorized folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

# A peer's role -> the broker socket it may open (the ZAP domain of that socket) and the folder of admitted keys.
CLIENT = "client"
WORKER = "worker"
AUTHORIZED = {CLIENT: "authorized/clients", WORKER: "authorized/workers"}
ZAP_DOMAIN = {CLIENT: "tinyloop-frontend", WORKER: "tinyloop-backend"}


class KeyDirectoryError(ValueError):
    """A CURVE key directory lacks what a role needs (the message names the file and the fix)."""


def create_keys(directory: str | Path) -> Path:
    """Create a fresh broker key pair and one key pair per role in `directory` (see the module doc)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(directory, "broker")
    for role in (CLIENT, WORKER):
        public, _ = zmq.auth.create_certificates(directory, role)
        authorized = directory / AUTHORIZED[role]
        authorized.mkdir(parents=True, exist_ok=True)
        shutil.copy(public, authorized / f"{role}.key")
    return directory


def start_authenticator(context: zmq.Context, directory: str | Path) -> ThreadAuthenticator:
    """Admit on each broker socket only the CURVE peers of its role (must run before bind)."""
    directory = Path(directory)
    for role, folder in AUTHORIZED.items():
        if not (directory / folder).is_dir():
            raise KeyDirectoryError(f"CURVE key directory {directory} has no {folder}/ (the {role} keys the broker "
                                    f"admits): it predates key roles or is incomplete; make a new one with "
                                    f"`tinyloop keys DIR`")
    auth = ThreadAuthenticator(context)
    auth.start()
    for role, folder in AUTHORIZED.items():
        auth.configure_curve(domain=ZAP_DOMAIN[role], location=str(directory / folder))
    return auth


def make_server(sock: zmq.Socket, directory: str | Path, role: str) -> None:
    """Make `sock` a CURVE server that admits only peers of `role` (CLIENT: the frontend, WORKER: the backend)."""
    public, secret = zmq.auth.load_certificate(_need(Path(directory), "broker.key_secret", "the broker"))
    sock.zap_domain = ZAP_DOMAIN[role].encode()
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def make_client(sock: zmq.Socket, directory: str | Path, role: str = CLIENT) -> None:
    """Connect `sock` to the broker as a peer of `role` with that role's key pair."""
    directory = Path(directory)
    who = "a worker" if role == WORKER else "a client or gateway"
    public, secret = zmq.auth.load_certificate(_need(directory, f"{role}.key_secret", who))
    server_public, _ = zmq.auth.load_certificate(_need(directory, "broker.key", who))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


def _need(directory: Path, name: str, who: str) -> Path:
    path = directory / name
    if not path.is_file():
        raise KeyDirectoryError(f"CURVE key directory {directory} has no {name}, which {who} needs "
                        f"(`tinyloop keys DIR` makes it; docs/service.md, Keys)")
    return path
