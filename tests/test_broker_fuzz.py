"""Fuzz a live broker process: whatever arrives on its frontend, it answers with an error
reply carrying the code the schema predicts (or handles a valid message), and keeps serving."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings

REPO = Path(__file__).resolve().parent.parent

from broker import protocol  # noqa: E402
from broker.protocol import CLIENT_TO_BROKER, ProtocolError  # noqa: E402
from test_broker import Service  # noqa: E402
from test_protocol import fuzz_frames  # noqa: E402


@pytest.fixture(scope="module")
def live():
    svc = Service("--max-queue", "1000")  # no workers: valid requests just wait in the queue
    svc.start_broker()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(svc.frontend)
    yield svc, sock
    sock.close()
    svc.close()


def expected_reply(frames: list[bytes]) -> tuple[str, str | None]:
    """What the broker must answer: ("error", code), ("status_reply", None) or ("none", None)."""
    try:
        msg = protocol.decode(CLIENT_TO_BROKER, frames)
    except ProtocolError as err:
        return "error", err.code
    if msg.type == "status":
        return "status_reply", None
    return "none", None  # a valid request is queued (no worker); a cancel has no reply of its own


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(frames=fuzz_frames)
def test_broker_answers_garbage_and_survives(live, frames):
    svc, sock = live
    frames = [f for f in frames]
    if not frames:
        frames = [b""]  # ZeroMQ cannot send a message with no frames
    kind, code = expected_reply(frames)
    sock.send_multipart(frames)
    if kind == "none":
        if msgpack.unpackb(frames[1], raw=False).get("type") == "request":
            # Withdraw it so the queue stays empty; its one final reply is "cancelled".
            request_id = msgpack.unpackb(frames[1], raw=False)["id"]
            sock.send_multipart(protocol.encode(CLIENT_TO_BROKER, "cancel", id=request_id))
            kind, code = "error", "cancelled"
        else:
            return
    assert sock.poll(3000), f"no reply to {frames!r}"
    reply = protocol.decode(protocol.BROKER_TO_CLIENT, sock.recv_multipart())
    assert reply.type == kind, (frames, reply)
    if kind == "error":
        assert reply["code"] == code, (frames, reply)


def test_broker_still_serves_after_fuzzing(live):
    svc, sock = live
    sock.send_multipart(protocol.encode(CLIENT_TO_BROKER, "status", id="final"))
    assert sock.poll(3000)
    reply = protocol.decode(protocol.BROKER_TO_CLIENT, sock.recv_multipart())
    assert reply.type == "status_reply" and reply["status"]["queue"] == 0
    assert svc.broker.poll() is None
