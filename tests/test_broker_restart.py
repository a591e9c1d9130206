"""Lazy Pirate: clients survive a broker restart and a lost connection without losing or repeating anything.

A real broker process and echo worker processes (test_broker.py's Service) on ipc sockets. The echo
engine streams the prompt back one character every `delay` seconds and continues a stream from the
tokens already delivered, so these tests see exactly which tokens a client got and how often a request
ran. The real-model version, with `tinyloop serve` restarting the broker, is tests/test_chaos.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from broker import protocol
from broker.client import AsyncClient, WorkerLost
from test_broker import Service, raw_reply  # noqa: E402

TEXT = "abcdefghijklmnopqrstuvwxyz0123456789"


@pytest.fixture
def service():
    svc = Service()
    svc.start_broker()
    svc.start_worker("w1", delay=0.05)
    svc.start_worker("w2", delay=0.05)
    yield svc
    svc.close()


def restart_broker(svc: Service) -> None:
    svc.broker.kill()
    svc.broker.wait(5)
    time.sleep(0.3)  # the clients notice the dropped connection meanwhile
    svc.start_broker()  # same endpoints


def served(svc: Service) -> int:
    return sum(w["served"] for w in svc.wait_workers(lambda ws: len(ws) == 2, timeout=20))


def test_sync_client_rides_out_a_broker_restart(service):
    with service.client(timeout=60) as client:
        streams = [client.submit("generate", {"prompt": TEXT}, stream=True) for _ in range(2)]
        plain = [client.submit("generate", {"prompt": TEXT[:8]}) for _ in range(3)]
        first = [next(iter(p)) for p in streams]  # both streams are running on the workers
        restart_broker(service)
        events = {p.id: [(e.pos, e.token)] for p, e in zip(streams, first)}
        for p in streams:
            events[p.id] += [(e.pos, e.token) for e in p]
        for p in streams:
            reply = p.result()
            assert reply.text == TEXT and reply.tokens == [ord(c) for c in TEXT]
            # Every token exactly once, in order, across two brokers.
            assert events[p.id] == [(i, ord(c)) for i, c in enumerate(TEXT)]
        assert [p.result().text for p in plain] == [TEXT[:8]] * 3
        assert client.reconnects >= 1
        assert not client.socket.poll(300), "a request got a second final reply"


def test_async_client_rides_out_a_broker_restart(service):
    async def scenario() -> tuple[list, list, int]:
        async with AsyncClient(service.frontend, timeout=60) as client:
            got: list = []
            result: list = []

            async def consume() -> None:
                async for event in client.stream(TEXT, result=result):
                    got.append((event.pos, event.token))

            task = asyncio.create_task(consume())
            plain = asyncio.create_task(client.generate(TEXT[:6]))
            while not got:
                await asyncio.sleep(0.02)
            await asyncio.get_running_loop().run_in_executor(None, restart_broker, service)
            await task
            return got, [result[0].text, (await plain).text], client.reconnects

    got, texts, reconnects = asyncio.run(scenario())
    assert got == [(i, ord(c)) for i, c in enumerate(TEXT)]
    assert texts == [TEXT, TEXT[:6]]
    assert reconnects >= 1


def test_resend_to_a_live_broker_is_not_run_twice(service):
    """A client that wrongly thinks the broker is gone re-sends; the broker attaches instead of re-running."""
    before = served(service)
    with service.client(timeout=60) as client:
        stream = client.submit("generate", {"prompt": TEXT}, stream=True)
        plain = client.submit("generate", {"prompt": TEXT[:10]})
        it = iter(stream)
        tokens = [next(it).token for _ in range(3)]
        client._reconnect("test: pretend the connection dropped")  # fresh socket, same identity, re-send all
        tokens += [e.token for e in it]
        assert tokens == [ord(c) for c in TEXT] and stream.result().text == TEXT
        assert plain.result().text == TEXT[:10]
    assert served(service) - before == 2  # each request ran once


def test_resend_after_the_final_reply_was_lost_replays_it(service):
    """The final reply left the broker but never reached the client (its socket closed): a re-send under the
    same identity and id gets the kept reply, tokens included, without running the request again."""
    before = served(service)
    identity = b"c-lost-reply"
    ctx = zmq.Context.instance()

    def dealer() -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.connect(service.frontend)
        return sock

    sock = dealer()
    sock.send_multipart(protocol.encode(protocol.CLIENT_TO_BROKER, "request", id="r1", op="generate",
                                        params={"prompt": "hello"}, stream=True))
    time.sleep(0.2)
    sock.close()  # gone before any reply arrived
    time.sleep(0.6)  # the request finishes meanwhile; its tokens and reply go nowhere
    sock = dealer()
    try:
        sock.send_multipart(protocol.encode(protocol.CLIENT_TO_BROKER, "request", id="r1", op="generate",
                                            params={"prompt": "hello"}, stream=True, received=[ord("h")]))
        replies = [raw_reply(sock) for _ in range(5)]
        assert [r["type"] for r in replies] == ["token"] * 4 + ["done"]
        assert [r["pos"] for r in replies[:4]] == [1, 2, 3, 4]  # from where the client was
        assert replies[-1]["result"]["text"] == "hello"
        assert not sock.poll(300)
    finally:
        sock.close()
    assert served(service) - before == 1


def test_resent_stream_that_cannot_be_continued_says_so(service):
    """A new broker gets a re-send holding tokens of a request it cannot continue exactly (beam search)."""
    with service.client(timeout=30) as client:
        stream = client.submit("generate", {"prompt": TEXT, "beam_size": 2}, stream=True)
        next(iter(stream))
        restart_broker(service)
        with pytest.raises(WorkerLost) as err:
            stream.result()
        assert "beam search" in str(err.value) and "cannot be continued" in str(err.value)
        assert client.generate("after").text == "after"


def test_submit_cli_rides_out_a_broker_restart(service):
    import subprocess
    import sys

    from broker import launcher
    from test_broker import REPO

    proc = subprocess.Popen([sys.executable, "-m", "scripts.cli", "submit", "--connect", service.frontend, TEXT * 2,
                             "--max-tokens", str(len(TEXT) * 2)], cwd=str(REPO), env=launcher.child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Wait until its request is streaming on a worker, then take the broker down under it.
    service.wait_workers(lambda ws: any(w["state"] == "busy" for w in ws), timeout=30)
    time.sleep(0.5)
    restart_broker(service)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out == TEXT * 2 + TEXT * 2 + "\n"  # the prompt, then the echoed answer once, in one piece
    assert "72 tokens" in err
