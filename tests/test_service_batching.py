"""Continuous batching in the worker, end to end: a real broker and real worker processes (bundled model, ZeroMQ).

Requests join a worker's running batch at step boundaries and leave when done; every answer equals the runtime's
own for that request alone, whatever ran beside it; cancellation, deadlines and streaming stay per request; a
request the batch cannot take (speculative) runs around it; the client's generate_batch feeds many prompts through.
"""

from __future__ import annotations

import threading
import time

import pytest

import tinyloop
from conftest import direct
from broker import launcher
from broker.client import Client, RequestTimeout

MAX_SEQ_LEN = 256
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n    ", "x = [i * i for i in", "while True:\n    line = f.readline()\n"]


@pytest.fixture(scope="module")
def model():
    import torch

    torch.set_num_threads(1)
    m = tinyloop.load_model(None, MAX_SEQ_LEN)
    yield m
    tinyloop.free_model(m)


@pytest.fixture(scope="module")
def service():
    """One worker, so concurrent requests must share its batch; a short heartbeat, so a stalled one would show."""
    args = ["--max-seq-len", str(MAX_SEQ_LEN), "--threads", "1", "--max-lanes", "8", "--prefill-chunk", "32"]
    with launcher.LocalService(1, args, heartbeat_interval=0.3, startup_timeout=300) as svc:
        yield svc


def watch_running(frontend: str, stop: threading.Event, seen: list[int]) -> None:
    """The most requests the broker saw running on one worker at once."""
    with Client(frontend, timeout=10) as client:
        while not stop.is_set():
            seen.append(max([w["running"] for w in client.status()["workers"]] or [0]))
            time.sleep(0.02)


def test_concurrent_requests_share_one_batch_and_stay_exact(service, model):
    """Different loops, temperatures, seeds, stops, grammars and lengths in one worker's batch; requests join while
    others run (staggered) and each answer equals generate of that request alone."""
    # the first runs longest (96 tokens at 16 loops), so the others join it however fast the model decodes
    configs = [dict(max_tokens=96, loops=16), dict(max_tokens=10, loops=4), dict(max_tokens=16, loops=12, temperature=0.8, seed=7),
               dict(max_tokens=20, stop_sequences=["\n"]), dict(max_tokens=12, temperature=1.0, top_k=20, seed=3),
               dict(max_tokens=14, grammar={"regex": "[a-z_]+\\(.*\\)"}, loops=6)]
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=watch_running, args=(service.frontend, stop, seen))
    watcher.start()
    try:
        with Client(service.frontend, timeout=120) as client:
            pending = []
            for prompt, cfg in zip(PROMPTS, configs):
                pending.append(client.submit("generate", {"prompt": prompt, **cfg}, stream=True))
                time.sleep(0.02)  # later requests join a batch that is already running
            replies = [p.result() for p in pending]
    finally:
        stop.set()
        watcher.join()
    assert max(seen) >= 3  # they ran together, not one after another
    for prompt, cfg, reply in zip(PROMPTS, configs, replies):
        alone = direct(model, prompt, **cfg)
        assert reply.tokens == alone.tokens and reply.text == alone.text
        assert reply.stats["stop_reason"] == alone.stats.stop_reason


def test_cancel_and_deadline_stop_only_their_request(service, model):
    with Client(service.frontend, timeout=120) as client:
        others = [client.submit("generate", {"prompt": p, "max_tokens": 40}) for p in PROMPTS[:3]]
        # 200 tokens at 16 loops beside four other requests on one thread: well past its 0.2 s deadline (200 at the
        # default 8 loops took ~0.35 s alone on two threads once decode ran as one C call per step)
        late = client.submit("generate", {"prompt": PROMPTS[3], "max_tokens": 200, "loops": 16}, timeout=0.2)
        with client.stream(PROMPTS[4], max_tokens=200) as stream:
            got = [event.token for _, event in zip(range(3), stream)]
        # leaving the block cancelled it; its final reply still came (a done with stop_reason cancelled)
        with pytest.raises(RequestTimeout):
            late.result()
        for prompt, p in zip(PROMPTS, others):
            assert p.result().tokens == direct(model, prompt, max_tokens=40).tokens
    assert got == direct(model, PROMPTS[4], max_tokens=3).tokens


def test_speculative_runs_around_the_batch(service, model):
    with Client(service.frontend, timeout=120) as client:
        plain = [client.submit("generate", {"prompt": p, "max_tokens": 16}) for p in PROMPTS[:3]]
        spec = client.submit("speculative", {"prompt": PROMPTS[3], "max_tokens": 16, "draft_loops": 2, "verify_loops": 8})
        after = client.submit("generate", {"prompt": PROMPTS[4], "max_tokens": 16})
        assert spec.result().tokens == direct(model, PROMPTS[3], max_tokens=16, loops=8).tokens
        for prompt, p in zip(PROMPTS[:3] + [PROMPTS[4]], plain + [after]):
            assert p.result().tokens == direct(model, prompt, max_tokens=16).tokens


def test_long_prompts_interleave_and_heartbeats_flow(service, model):
    """A prompt of ~200 tokens is prefilled in 32-token pieces between decode steps of a running stream; the worker
    keeps heartbeating (3 missed beats of 0.3 s would drop it) and every answer is exact."""
    long_prompt = "".join(PROMPTS) * 3
    with Client(service.frontend, timeout=120) as client:
        before = {w["name"]: w["pid"] for w in client.status()["workers"]}
        with client.stream(PROMPTS[0], max_tokens=60) as stream:
            first = next(iter(stream))
            joined = client.submit("generate", {"prompt": long_prompt, "max_tokens": 8})
            rest = [e.token for e in stream]
        assert [first.token] + rest == direct(model, PROMPTS[0], max_tokens=60).tokens
        assert joined.result().tokens == direct(model, long_prompt, max_tokens=8).tokens
        assert {w["name"]: w["pid"] for w in client.status()["workers"]} == before


def test_client_generate_batch_feeds_many_prompts(service, model):
    prompts = [p + str(i) for i in range(5) for p in PROMPTS]  # 30 prompts, more than the worker's 8 lanes
    with Client(service.frontend, timeout=300) as client:
        replies = client.generate_batch(prompts, window=12, max_tokens=6)
    assert [r.tokens for r in replies] == [direct(model, p, max_tokens=6).tokens for p in prompts]


def raw_streams(frontend: str, identity: bytes, prompts: list[str], max_tokens: int) -> tuple[list, dict, dict]:
    """Streaming requests from a bare DEALER socket under `identity`, all sent at once: (the types of the messages it
    got, the tokens streamed per request, the final message per request)."""
    import zmq

    from broker import protocol

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(frontend)
    try:
        for i, prompt in enumerate(prompts):
            sock.send_multipart(protocol.encode(protocol.CLIENT_TO_BROKER, "request", id=f"r{i}", op="generate",
                                                params={"prompt": prompt, "max_tokens": max_tokens}, stream=True))
        types, streamed, final = [], {f"r{i}": [] for i in range(len(prompts))}, {}
        while len(final) < len(prompts):
            assert sock.poll(120_000), "no reply from the service"
            msg = protocol.decode(protocol.BROKER_TO_CLIENT, sock.recv_multipart())
            types.append(msg.type)
            for one in protocol.unbatch(msg):
                if one.type == "token":
                    streamed[one["id"]].append(one["token"])
                else:
                    final[one["id"]] = one
    finally:
        sock.close(linger=0)
    return types, streamed, final


def test_a_step_streams_its_tokens_in_one_message_to_clients_that_read_them(service):
    """A worker sends a step's tokens in one message; the broker passes a client its share in one `tokens` message
    when its identity says it reads them (this library's clients), else one `token` message each (older clients).
    Either way each request streams exactly its final tokens, in order."""
    for identity, batched in ((b"cb-test-reads-tokens", True), (b"c-test-older-client", False)):
        types, streamed, final = raw_streams(service.frontend, identity, PROMPTS[:3], 12)
        for request_id, msg in final.items():
            assert msg.type == "done" and streamed[request_id] == msg["result"]["tokens"]
        assert ("tokens" in types) == batched, types
    with Client(service.frontend, timeout=120) as client:  # the library's client reads them
        pending = [client.submit("generate", {"prompt": p, "max_tokens": 12}, stream=True) for p in PROMPTS[:3]]
        for p in pending:
            assert [event.token for event in p] == p.result().tokens
