"""The wire schema: round trips, field rules, and fuzzing of the decoder (pure, no sockets)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parent.parent

from broker import protocol  # noqa: E402
from broker.client import ERROR_CLASSES, ServiceError  # noqa: E402
from broker.protocol import (  # noqa: E402
    BROKER_TO_CLIENT,
    BROKER_TO_WORKER,
    CLIENT_TO_BROKER,
    WORKER_TO_BROKER,
    Codes,
    ProtocolError,
)


def frames_of(msg_type: str, **fields) -> list[bytes]:
    return [protocol.PROTOCOL_TAG, msgpack.packb({"type": msg_type, **fields})]


def code_of(direction: str, frames: list[bytes], **kw) -> str:
    with pytest.raises(ProtocolError) as err:
        protocol.decode(direction, frames, **kw)
    return err.value.code


SAMPLES = [
    (CLIENT_TO_BROKER, "request", dict(id="r1", op="generate", params={"prompt": "def f():", "max_tokens": 4},
                                       stream=True, timeout_s=2.5)),
    (CLIENT_TO_BROKER, "request", dict(id="r2", op="generate", params={"prompt": [1, 2, 3], "loops": None, "seed": 7,
                                                                       "stop_sequences": ["\n\n", [5, 6]]})),
    (CLIENT_TO_BROKER, "request", dict(id="r3", op="resume", params={"handle": "w1-ab:3", "loops": 8})),
    (CLIENT_TO_BROKER, "request", dict(id="r4", op="speculative", params={"prompt": "x", "draft_loops": 2,
                                                                          "verify_loops": 8, "draft_ahead": 4})),
    (CLIENT_TO_BROKER, "cancel", dict(id="r1")),
    (CLIENT_TO_BROKER, "status", dict(id="s")),
    (BROKER_TO_CLIENT, "token", dict(id="r1", token=17, pos=0, text="de")),
    (BROKER_TO_CLIENT, "tokens", dict(items=[["r1", 17, 0, "de"], ["r2", 5, 3, ""]])),
    (BROKER_TO_CLIENT, "done", dict(id="r1", result={"tokens": [1], "text": "a", "stats": {"stop_reason": "eos"}})),
    (BROKER_TO_CLIENT, "error", dict(id=None, code="bad_frame", message="no")),
    (WORKER_TO_BROKER, "ready", dict(name="w1", pid=12, ops=["generate", "ping"], plan_bytes=10, max_handles=2,
                                     device="cpu", model="bundled")),
    (WORKER_TO_BROKER, "heartbeat", dict(handles=0)),
    (WORKER_TO_BROKER, "tokens", dict(items=[["r1.0", 17, 0, "de"], ["r2.0", 5, 3, ""]])),
    (WORKER_TO_BROKER, "goodbye", {}),
    (BROKER_TO_WORKER, "request", dict(id="9", op="ping", params={}, stream=False, timeout_s=None)),
    (BROKER_TO_WORKER, "refused", dict(reason="too big")),
    (BROKER_TO_WORKER, "reconnect", {}),
]


@pytest.mark.parametrize("direction,msg_type,fields", SAMPLES, ids=[f"{d}:{t}" for d, t, _ in SAMPLES])
def test_round_trip(direction, msg_type, fields):
    msg = protocol.decode(direction, protocol.encode(direction, msg_type, **fields))
    assert msg.type == msg_type
    for name, value in fields.items():
        assert msg.fields[name] == value


def test_defaults_and_message_directions():
    msg = protocol.decode(CLIENT_TO_BROKER, frames_of("request", id="a", op="ping", params={}))
    assert msg["stream"] is False and "timeout_s" not in msg.fields
    # A worker message type is not a client message type.
    assert code_of(CLIENT_TO_BROKER, frames_of("ready", name="w")) == Codes.BAD_MESSAGE
    assert code_of(WORKER_TO_BROKER, frames_of("status", id="a")) == Codes.BAD_MESSAGE


@pytest.mark.parametrize(
    "params,needle",
    [
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),  # bool is not an int on the wire
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": math.nan}, "temperature"),
        ({"prompt": "x", "temperature": -1.0}, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "stop_sequences": [""]}, "stop_sequences"),
        ({"prompt": "x", "stop_sequences": "\n"}, "stop_sequences"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "colour": "blue"}, "colour"),
    ],
)
def test_invalid_generate_fields_are_named(params, needle):
    with pytest.raises(ProtocolError) as err:
        protocol.decode(CLIENT_TO_BROKER, frames_of("request", id="a", op="generate", params=params))
    assert err.value.code == Codes.INVALID_FIELD
    assert needle in err.value.message
    assert err.value.request_id == "a"  # so the error reply can name the request


@pytest.mark.parametrize("items,needle", [
    ([], "length"),  # a step with no tokens sends no message
    ([["r1", 17, 0]], "[id, token, pos, text]"),
    ([["r1", 17, 0, "de", 1]], "[id, token, pos, text]"),
    ([["r1", -1, 0, "de"]], "token"),
    ([["r1", 17, 0, 5]], "text"),
    ([["", 17, 0, "de"]], "id"),
    ({"r1": [17, 0, "de"]}, "list"),
])
def test_tokens_items_are_checked_like_token_messages(items, needle):
    with pytest.raises(ProtocolError) as err:
        protocol.decode(WORKER_TO_BROKER, frames_of("tokens", items=items))
    assert err.value.code == Codes.INVALID_FIELD
    assert needle in err.value.message


def test_unbatch_reads_tokens_as_token_messages():
    frames = protocol.encode(BROKER_TO_CLIENT, "tokens", items=[["r1", 17, 0, "de"], ["r2", 5, 3, ""]])
    msgs = protocol.unbatch(protocol.decode(BROKER_TO_CLIENT, frames))
    assert [(m.type, m.fields) for m in msgs] == [("token", {"id": "r1", "token": 17, "pos": 0, "text": "de"}),
                                                 ("token", {"id": "r2", "token": 5, "pos": 3, "text": ""})]
    done = protocol.decode(BROKER_TO_CLIENT, protocol.encode(BROKER_TO_CLIENT, "done", id="r1", result={}))
    assert protocol.unbatch(done) == [done]


def test_frame_level_errors():
    assert code_of(CLIENT_TO_BROKER, [b"x"]) == Codes.BAD_FRAME
    assert code_of(CLIENT_TO_BROKER, [protocol.PROTOCOL_TAG, b"", b""]) == Codes.BAD_FRAME
    assert code_of(CLIENT_TO_BROKER, [b"tinyloop/2", b"\x80"]) == Codes.BAD_VERSION
    assert code_of(CLIENT_TO_BROKER, [protocol.PROTOCOL_TAG, b"\x80" * 10], max_bytes=5) == Codes.TOO_LARGE
    assert code_of(CLIENT_TO_BROKER, [protocol.PROTOCOL_TAG, msgpack.packb({1: 2})]) == Codes.BAD_MESSAGE
    assert code_of(CLIENT_TO_BROKER, frames_of("request", id="a", op="fly", params={})) == Codes.UNKNOWN_OP


def test_overlong_id_is_not_echoed():
    with pytest.raises(ProtocolError) as err:
        protocol.decode(CLIENT_TO_BROKER, frames_of("cancel", id="x" * 500))
    assert err.value.request_id is None
    # ...so the broker's error reply still encodes.
    protocol.encode(BROKER_TO_CLIENT, "error", id=err.value.request_id, code=err.value.code, message=err.value.message)


def test_every_error_code_has_a_client_error_class():
    for code in protocol.ERROR_CODES:
        cls = ERROR_CLASSES.get(code, ServiceError)
        err = cls("m", code=code)
        assert err.code == code
    assert set(ERROR_CLASSES) <= set(protocol.ERROR_CODES)


def test_every_op_and_code_is_documented():
    doc = (REPO / "docs" / "protocol.md").read_text()
    for op in protocol.OPS:
        assert f"`{op}`" in doc, op
    for code in protocol.ERROR_CODES:
        assert f"`{code}`" in doc, code
    for direction in protocol.MESSAGES.values():
        for msg_type, fields in direction.items():
            assert f"`{msg_type}`" in doc, msg_type
            for name in fields:
                assert f"`{name}`" in doc, name


def test_importing_the_client_does_not_import_torch():
    """The service's processes read the runtime's torch-free facts (tinyloop/fields.py, tinyloop/env.py) and nothing
    else of it (docs/architecture.md)."""
    facts = "{'tinyloop', 'tinyloop.fields', 'tinyloop.env', 'tinyloop.errors'}"
    code = ("import sys; import broker.client, broker.broker, broker.protocol, broker.supervisor, broker.gateway; "
            "import scripts.load.loadtest, scripts.service_cli, workers.worker; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.') "
            f"or (m.startswith('tinyloop') and m not in {facts})]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- fuzzing

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)

field_names = st.sampled_from(
    ["id", "op", "params", "stream", "timeout_s", "prompt", "max_tokens", "handle", "token", "pos", "text", "code",
     "result", "name", "ops", "plan_bytes", "loops", "stop_sequences", "x"]
)

structured_bodies = st.fixed_dictionaries(
    {"type": st.sampled_from(["request", "cancel", "status", "token", "ready", "heartbeat", "nope"]) | st.text(max_size=5)},
    optional={
        "id": st.text(max_size=3) | msgpack_values,
        "op": st.sampled_from(list(protocol.OPS)) | st.text(max_size=5),
        "params": st.dictionaries(field_names, msgpack_values, max_size=5) | msgpack_values,
        "stream": msgpack_values,
        "timeout_s": msgpack_values,
    },
)


def _packed(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


fuzz_frames = st.one_of(
    st.lists(st.binary(max_size=64), min_size=0, max_size=4),
    st.tuples(st.just(protocol.PROTOCOL_TAG), st.binary(max_size=64)).map(list),
    st.tuples(st.just(protocol.PROTOCOL_TAG), msgpack_values.map(_packed)).map(list),
    st.tuples(st.just(protocol.PROTOCOL_TAG), structured_bodies.map(_packed)).map(list),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=fuzz_frames, direction=st.sampled_from([CLIENT_TO_BROKER, WORKER_TO_BROKER, BROKER_TO_WORKER]))
def test_decoder_raises_only_protocol_errors(frames, direction):
    try:
        msg = protocol.decode(direction, frames)
    except ProtocolError as err:
        assert err.code in protocol.ERROR_CODES
        assert err.request_id is None or (isinstance(err.request_id, str) and len(err.request_id) <= 128)
        return
    # Whatever got through re-encodes: it is a well-formed message of its direction.
    assert protocol.decode(direction, protocol.encode(direction, msg.type, **msg.fields)).fields == msg.fields
