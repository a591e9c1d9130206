"""The TinyLoop wire protocol: the one schema module read by broker, worker and client.

Every message is a ZeroMQ multipart message of exactly two frames:

    frame 0: the protocol tag, b"tinyloop/1" (name and version; a peer speaking another
             version is answered with the error code "bad_version")
    frame 1: a msgpack map with a "type" key and the fields of that message type

ROUTER sockets prepend the peer identity frame on receive; that frame is handled by the
broker and is not part of the schema. Every field of every message is validated here,
so the broker, the worker and the client agree on one definition. Anything that does not
validate raises ProtocolError carrying an error code, and the broker answers it with an
"error" message instead of crashing.

This module must never import torch: the client library and the broker import it. The field checks and the
request-field table come from tinyloop/fields.py, the runtime's torch-free table of its settings.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable

import msgpack

from tinyloop.fields import (GENERATE_FIELDS, MAX_LOOPS, SPECULATIVE_FIELDS, boolean, int_in, list_of, number_in,
                             one_of, optional, plain_map, template_variables, text, token_list)

PROTOCOL_NAME = b"tinyloop/"
PROTOCOL_VERSION = 1
PROTOCOL_TAG = PROTOCOL_NAME + str(PROTOCOL_VERSION).encode()

# Bodies above this size get the error "too_large" (the broker's --max-message-bytes
# may lower it). The ZeroMQ socket option MAXMSGSIZE is set to a multiple of this as a
# hard stop against memory exhaustion; beyond it ZeroMQ drops the peer's connection.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20

# Message directions. A message type is only valid in the direction it belongs to.
CLIENT_TO_BROKER = "client->broker"
BROKER_TO_CLIENT = "broker->client"
WORKER_TO_BROKER = "worker->broker"
BROKER_TO_WORKER = "broker->worker"


class Codes:
    """Error codes carried by "error" messages. docs/protocol.md explains each one."""

    BAD_FRAME = "bad_frame"  # wrong number of frames or missing protocol tag
    BAD_VERSION = "bad_version"  # protocol tag names another version
    BAD_MESSAGE = "bad_message"  # body is not a msgpack map with a known "type"
    INVALID_FIELD = "invalid_field"  # a field is missing, of the wrong type or out of range
    UNKNOWN_OP = "unknown_op"  # the request names an operation that does not exist
    UNSUPPORTED_OP = "unsupported_op"  # the op exists but this worker's runtime lacks it
    TOO_LARGE = "too_large"  # the message body exceeds the size limit
    DUPLICATE_ID = "duplicate_id"  # a request id is already in flight for this client
    BUSY = "busy"  # the broker queue is full; retry later
    TIMEOUT = "timeout"  # the request's deadline passed before it finished
    CANCELLED = "cancelled"  # the client cancelled before a worker started the request
    WORKER_LOST = "worker_lost"  # the worker died after streaming part of the answer
    HANDLE_EVICTED = "handle_evicted"  # the handle was evicted by the live-handle cap (LRU)
    HANDLE_UNKNOWN = "handle_unknown"  # no such handle (never existed, released, or its worker died)
    CONFIG_ERROR = "config_error"  # the runtime rejected a GenerateConfig field
    MODE_ERROR = "mode_error"  # the runtime rejected a combination of modes
    BUDGET = "budget"  # the request's KV blocks do not fit the worker's memory budget (tinyloop.BudgetError)
    FORWARD_FAILED = "forward_failed"  # a forward the request shared with others failed (the broker retries it)
    RUNTIME_ERROR = "runtime_error"  # any other runtime failure on the worker
    SHUTTING_DOWN = "shutting_down"  # the broker is stopping


ERROR_CODES = {
    value: name for name, value in vars(Codes).items() if not name.startswith("_")
}

# Errors a client may safely retry without changing the request.
RETRYABLE_CODES = frozenset({Codes.BUSY, Codes.WORKER_LOST, Codes.SHUTTING_DOWN, Codes.FORWARD_FAILED})


class WorkerExit(IntEnum):
    """A worker process's exit codes, read by `serve`'s supervisor and the launcher. The fatal ones say the worker
    can never start as configured (restarting it would fail the same way); any other code is a crash, and the
    worker is restarted."""

    OK = 0
    LOAD_FAILED = 2  # the model cannot be loaded (a missing or bad artifact, bad options)
    OVER_BUDGET = 3  # the memory plan exceeds the budget
    REFUSED_BY_BROKER = 4  # the broker will not use it (its plan or handle cap breaks the broker's limits)
    BAD_CONFIG = 5  # its options or files break a rule (a prefix file, --max-lanes, more scaffolds than handles)


FATAL_WORKER_EXITS = frozenset({WorkerExit.LOAD_FAILED, WorkerExit.OVER_BUDGET, WorkerExit.REFUSED_BY_BROKER,
                                WorkerExit.BAD_CONFIG})


class ProtocolError(Exception):
    """A message broke the schema. `code` is one of Codes; `request_id` is echoed when known."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id


# ---------------------------------------------------------------------------
# Field checks. Each returns an error text, or None when the value is fine.
# ---------------------------------------------------------------------------


def token_items(max_len: int) -> Callable[[Any], str | None]:
    """A list of streamed tokens, each [id, token, pos, text] (the fields of a "token" message, in that order)."""
    def check(value: Any) -> str | None:
        if not isinstance(value, list):
            return f"must be a list, got {type(value).__name__}"
        if not 1 <= len(value) <= max_len:
            return f"length must be in [1, {max_len}], got {len(value)}"
        for item in value:
            if not isinstance(item, list) or len(item) != 4:
                return "items must be [id, token, pos, text]"
            for (name, spec), part in zip(TOKEN_FIELDS.items(), item):
                error = spec.check(part)
                if error:
                    return f"item {name} {error}"
        return None
    return check


@dataclass(frozen=True)
class Field:
    check: Callable[[Any], str | None]
    required: bool = True
    default: Any = None


# ---------------------------------------------------------------------------
# Prefix digests: what a worker's prefix cache holds, in a form the broker can compute without a tokenizer.
# ---------------------------------------------------------------------------

# A prompt's prefix digests cover its first 32, 64, 128, ... characters (a string prompt) or its first 16, 32,
# 64, ... token ids (a token-id prompt): doubling lengths, so a prompt has log2(length) of them and a worker
# announces a handful per cached prompt. Digest = blake2b (8 bytes, personalised by the prompt's kind) of the prefix,
# UTF-8 text or ids as 4-byte little-endian, as an integer below 2**63. A broker routes a request to the worker that
# announced the longest of its digests; the worker then reuses the longest common *token* prefix it finds, so a
# digest only has to say where the reuse is, never what exactly is reused.
DIGEST_CHARS = 32
DIGEST_TOKENS = 16
DIGEST_MAX = 2**63 - 1
MAX_ANNOUNCED_PREFIXES = 4096


def prefix_digests(prompt: str | list[int], limit: int | None = None) -> list[int]:
    """The digests of the prompt's prefixes of DIGEST_CHARS * 2**i characters (DIGEST_TOKENS * 2**i ids), shortest
    first, for those no longer than `limit` characters (ids) (default: the whole prompt)."""
    text = isinstance(prompt, str)
    size = len(prompt) if limit is None else min(limit, len(prompt))
    h = hashlib.blake2b(digest_size=8, person=b"tinyloop-text" if text else b"tinyloop-ids")
    out, done, n = [], 0, DIGEST_CHARS if text else DIGEST_TOKENS
    while n <= size:
        piece = prompt[done:n]
        h.update(piece.encode("utf-8") if isinstance(piece, str) else struct.pack(f"<{len(piece)}I", *piece))
        out.append(int.from_bytes(h.digest(), "big") >> 1)
        done, n = n, n * 2
    return out


# ---------------------------------------------------------------------------
# Message schemas, one per (direction, type).
# ---------------------------------------------------------------------------

REQUEST_ID = Field(text(128, min_len=1))
MAX_TIMEOUT_S = 24 * 3600.0
# A client socket whose ZeroMQ identity starts with this reads "tokens" messages (this library's clients): the
# broker then sends it the tokens a worker's step streamed for its requests in one message. Carried by the identity,
# so neither an older broker nor an older client sees a field or message it does not know.
TOKENS_CLIENT = b"cb-"

# A streamed token and a final result look the same on both legs (worker -> broker -> client).
TOKEN_FIELDS = {
    "id": REQUEST_ID,
    "token": Field(int_in(0, 2**31 - 1)),
    "pos": Field(int_in(0, 2**31 - 1)),
    "text": Field(text(1 << 16)),
}
DONE_FIELDS = {"id": REQUEST_ID, "result": Field(plain_map(64))}

MESSAGES: dict[str, dict[str, dict[str, Field]]] = {
    CLIENT_TO_BROKER: {
        # Run one operation. `stream` asks for "token" messages before the final reply.
        "request": {
            "id": REQUEST_ID,
            "op": Field(text(64, min_len=1)),
            "params": Field(plain_map(64)),
            "stream": Field(boolean, required=False, default=False),
            "timeout_s": Field(optional(number_in(0.0, MAX_TIMEOUT_S, lo_open=True)), required=False),
            # Lazy Pirate re-send (the client lost its broker connection): the token ids of this request the
            # client already holds. Present (even empty) marks a re-send, which is never run twice.
            "received": Field(token_list(1 << 16), required=False),
        },
        # Stop a request: queued ones end with error "cancelled", running ones stop decoding
        # and end with "done" (stop_reason "cancelled").
        "cancel": {"id": REQUEST_ID},
        # Ask for the broker's view of workers, queue and handles.
        "status": {"id": REQUEST_ID},
    },
    BROKER_TO_CLIENT: {
        "token": TOKEN_FIELDS,
        # Streamed tokens of several requests, [id, token, pos, text] each, sent only to a client whose socket
        # identity starts with TOKENS_CLIENT (it says the client reads them; others get one "token" each).
        "tokens": {"items": Field(token_items(4096))},
        "done": DONE_FIELDS,
        "error": {
            "id": Field(optional(text(128)), required=False),
            "code": Field(text(64, min_len=1)),
            "message": Field(text(1 << 14)),
        },
        "status_reply": {"id": REQUEST_ID, "status": Field(plain_map(64))},
    },
    WORKER_TO_BROKER: {
        # Sent once the model is loaded and the memory plan fits: only then is the worker routed to.
        "ready": {
            "name": Field(text(128, min_len=1)),
            "pid": Field(int_in(0, 2**31)),
            "ops": Field(list_of(text(64, min_len=1), 64)),
            "plan_bytes": Field(int_in(0, 2**62)),
            "max_handles": Field(int_in(0, 1 << 20)),
            "device": Field(text(64)),
            "model": Field(text(1024)),
            # Requests it runs at once (its continuous batch's lanes); the broker sends it up to this many.
            "slots": Field(int_in(1, 4096), required=False),
        },
        # Load and cache state for routing (docs/service.md "Routing"): free KV blocks, requests running, and
        # digests of the prompt prefixes its prefix cache holds (prefix_digests). Optional: older workers omit them.
        "heartbeat": {
            "handles": Field(int_in(0, 1 << 20)),
            "free_blocks": Field(int_in(0, 2**62), required=False),
            "lanes": Field(int_in(0, 1 << 20), required=False),
            "prefixes": Field(list_of(int_in(0, DIGEST_MAX), MAX_ANNOUNCED_PREFIXES), required=False),
            # its KV block pool and the blocks running requests and handles hold (cached-only blocks count as free):
            # the KV usage cluster routers read (vllm:kv_cache_usage_perc, broker/metrics.py)
            "total_blocks": Field(int_in(0, 2**62), required=False),
            "used_blocks": Field(int_in(0, 2**62), required=False),
        },
        "token": TOKEN_FIELDS,
        # The tokens one step of a worker's batch produced, one per request ([id, token, pos, text] each): one
        # message per step instead of one per token (streaming cost per token: docs/engine.md).
        "tokens": {"items": Field(token_items(4096))},
        "done": DONE_FIELDS,
        "error": {
            "id": REQUEST_ID,
            "code": Field(text(64, min_len=1)),
            "message": Field(text(1 << 14)),
        },
        # Clean shutdown: the broker stops routing to this worker at once.
        "goodbye": {},
    },
    BROKER_TO_WORKER: {
        "request": {
            "id": REQUEST_ID,
            "op": Field(text(64, min_len=1)),
            "params": Field(plain_map(64)),
            "stream": Field(boolean),
            "timeout_s": Field(optional(number_in(0.0, MAX_TIMEOUT_S))),
            # A continuation: these tokens were already delivered to the client; generate what follows them.
            "delivered": Field(token_list(1 << 16), required=False),
            # Seconds it waited in the broker's queue before this dispatch (elastic depth's controller counts it
            # in a request's time to first token: docs/engine.md, "Elastic depth").
            "queued_s": Field(number_in(0.0, MAX_TIMEOUT_S), required=False),
            # The age of the oldest request still waiting in the broker's queue after this dispatch (0: none): the
            # queue lives in the broker, and elastic depth's controller counts it as load (docs/engine.md)
            "backlog_s": Field(number_in(0.0, MAX_TIMEOUT_S), required=False),
        },
        "cancel": {"id": REQUEST_ID},
        "heartbeat": {},
        # The broker will not use this worker (its plan or handle cap breaks the broker's limits).
        "refused": {"reason": Field(text(1 << 14))},
        # The broker does not know this worker (e.g. the broker restarted): announce again.
        "reconnect": {},
    },
}

# ---------------------------------------------------------------------------
# Operations and their parameters.
# ---------------------------------------------------------------------------

PROMPT = Field(one_of(text(1 << 20), token_list(1 << 18)))

# The GenerateConfig fields a request may set, with the runtime's own rules (tinyloop/fields.py); rules that need
# the model (loops <= its max_loops) are the worker's, answered with "config_error" / "mode_error".
GENERATE_CONFIG_FIELDS: dict[str, Field] = {name: Field(check, required=False) for name, check in GENERATE_FIELDS.items()}
SPECULATIVE_CONFIG_FIELDS: dict[str, Field] = {name: Field(check, required=False)
                                               for name, check in SPECULATIVE_FIELDS.items()}

HANDLE_ID = Field(text(128, min_len=1))

OPS: dict[str, dict[str, Field]] = {
    # Plain generation (streamed or not).
    "generate": {"prompt": PROMPT, **GENERATE_CONFIG_FIELDS},
    # Generation through the worker's prefix pool (scaffolds registered at worker startup).
    "generate_pool": {"prompt": PROMPT, **GENERATE_CONFIG_FIELDS},
    # Warm start: prefill `prompt` for `l_used` loops and keep it as a handle on the worker.
    # (cache_window: the window later resumes will use; a handle serves one window only.)
    "build_handle": {"prompt": PROMPT, "l_used": Field(int_in(1, MAX_LOOPS)), "cache_window": GENERATE_CONFIG_FIELDS["cache_window"]},
    # Warm start: continue a handle to `loops` loops and generate (routed to the handle's worker).
    "resume": {"handle": HANDLE_ID, **GENERATE_CONFIG_FIELDS, "loops": Field(int_in(1, MAX_LOOPS))},
    # Free a handle before the LRU cap would.
    "release_handle": {"handle": HANDLE_ID},
    # Self-speculative decode.
    "speculative": {
        "prompt": PROMPT,
        **GENERATE_CONFIG_FIELDS,
        **SPECULATIVE_CONFIG_FIELDS,  # omitted fields take the runtime's defaults (verify_loops: the request's loops)
    },
    # Round trip through a worker without touching the model: liveness checks and
    # measuring the broker's routing rate.
    "ping": {"payload": Field(text(1 << 16), required=False)},
}

# --- Log-probabilities and chat (the OpenAI-compatible gateway, docs/gateway.md) ----------------
# Scoring asks: "logprobs" adds result["logprobs"] for the generated tokens (with "top_logprobs"
# alternatives each), "echo" adds the prompt's under result["prompt_logprobs"] and its text as
# result["prompt_text"]. The worker takes them from the step's own logits: the output's from the logits each
# token was chosen from, the prompt's from its prefill's rows (GenerateConfig.logprobs, prompt_logprobs).
SCORING_FIELDS: dict[str, Field] = {
    "logprobs": Field(boolean, required=False),
    "top_logprobs": Field(int_in(0, 20), required=False),
    "echo": Field(boolean, required=False),
}
for _op in ("generate", "speculative"):
    OPS[_op].update(SCORING_FIELDS)
# Chat: the worker renders `messages` with the model's chat template (tinyloop.chat), then
# generates (speculatively when any SpeculativeConfig field is set).
CHAT_MESSAGE = plain_map(8)
OPS["chat"] = {
    "messages": Field(list_of(CHAT_MESSAGE, 1024)),
    # the chat template's options: an open assistant turn (default true), and the template's own variables
    "add_generation_prompt": Field(boolean, required=False),
    "chat_template_kwargs": Field(template_variables(16), required=False),
    **{k: v for k, v in OPS["speculative"].items() if k != "prompt"},
}

# Ops whose requests must go to the worker that holds params["handle"].
HANDLE_OPS = frozenset({"resume", "release_handle"})


def _validate_fields(values: dict, schema: dict[str, Field], where: str, request_id: str | None) -> dict:
    unknown = sorted(set(values) - set(schema))
    if unknown:
        raise ProtocolError(Codes.INVALID_FIELD, f"{where}: unknown field(s) {unknown}", request_id)
    clean: dict[str, Any] = {}
    for name, spec in schema.items():
        if name not in values:
            if spec.required:
                raise ProtocolError(Codes.INVALID_FIELD, f"{where}: missing field '{name}'", request_id)
            if spec.default is not None:
                clean[name] = spec.default
            continue
        error = spec.check(values[name])
        if error:
            raise ProtocolError(Codes.INVALID_FIELD, f"{where}: field '{name}' {error}", request_id)
        clean[name] = values[name]
    return clean


def validate_params(op: str, params: dict, request_id: str | None = None) -> dict:
    """Check the params of an operation; unknown ops raise ProtocolError(UNKNOWN_OP)."""
    schema = OPS.get(op)
    if schema is None:
        raise ProtocolError(Codes.UNKNOWN_OP, f"unknown op {op!r}; known ops: {sorted(OPS)}", request_id)
    return _validate_fields(params, schema, f"op '{op}'", request_id)


@dataclass
class Message:
    """A decoded, validated message. `fields` never contains "type"."""

    type: str
    fields: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


def unbatch(msg: Message) -> list[Message]:
    """A "tokens" message as the "token" messages it carries; any other message as itself."""
    if msg.type != "tokens":
        return [msg]
    return [Message("token", dict(zip(TOKEN_FIELDS, item))) for item in msg["items"]]


def validate(direction: str, msg_type: str, fields: dict, request_id: str | None = None) -> dict:
    schemas = MESSAGES[direction]
    schema = schemas.get(msg_type)
    if schema is None:
        raise ProtocolError(
            Codes.BAD_MESSAGE, f"unknown message type {msg_type!r} for {direction}", request_id
        )
    clean = _validate_fields(fields, schema, f"message '{msg_type}'", request_id)
    if msg_type == "request":
        clean["params"] = validate_params(clean["op"], clean["params"], clean["id"])
    return clean


def encode(direction: str, msg_type: str, **fields: Any) -> list[bytes]:
    """Validate and pack one message into its two frames. Raises ProtocolError on a bad field."""
    clean = validate(direction, msg_type, fields)
    try:
        body = msgpack.packb({"type": msg_type, **clean}, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        # What the field checks do not look into (a grammar's JSON schema, a chat message) may still hold a value
        # msgpack cannot write: a lone surrogate (UnicodeEncodeError is a ValueError), an integer past 64 bits,
        # nesting past msgpack's limit, a type it does not know.
        raise ProtocolError(Codes.INVALID_FIELD, f"message '{msg_type}' cannot be encoded: {type(exc).__name__}: "
                                                 f"{str(exc)[:200]}", fields.get("id")) from None
    return [PROTOCOL_TAG, body]


def decode(
    direction: str, frames: list[bytes], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> Message:
    """Unpack and validate two frames. Raises ProtocolError (never anything else)."""
    if len(frames) != 2:
        raise ProtocolError(Codes.BAD_FRAME, f"expected 2 frames (tag, body), got {len(frames)}")
    tag, body = frames
    if tag != PROTOCOL_TAG:
        if bytes(tag).startswith(PROTOCOL_NAME):
            raise ProtocolError(
                Codes.BAD_VERSION,
                f"protocol version {bytes(tag)[len(PROTOCOL_NAME):]!r} is not supported; "
                f"this peer speaks {PROTOCOL_TAG.decode()}",
            )
        raise ProtocolError(Codes.BAD_FRAME, f"first frame must be the protocol tag {PROTOCOL_TAG!r}")
    if len(body) > max_bytes:
        raise ProtocolError(Codes.TOO_LARGE, f"message body is {len(body)} bytes; the limit is {max_bytes}")
    try:
        # strict_map_key keeps keys hashable str/bytes; raw=False gives str for msgpack str.
        data = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 (msgpack raises many types for garbage input)
        raise ProtocolError(Codes.BAD_MESSAGE, f"body is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(data, dict):
        raise ProtocolError(Codes.BAD_MESSAGE, f"body must be a msgpack map, got {type(data).__name__}")
    # Echo the id in error replies only when it is itself valid, so the reply encodes.
    rid = data.get("id")
    request_id = rid if isinstance(rid, str) and 1 <= len(rid) <= 128 else None
    msg_type = data.pop("type", None)
    if not isinstance(msg_type, str):
        raise ProtocolError(Codes.BAD_MESSAGE, "body has no string field 'type'", request_id)
    if not all(isinstance(k, str) for k in data):
        raise ProtocolError(Codes.BAD_MESSAGE, "all field names must be strings", request_id)
    return Message(msg_type, validate(direction, msg_type, data, request_id))
