"""The client library: sync and asyncio, streaming, cancellation, timeouts and typed errors.

Runs against a real broker process and echo worker processes (see test_broker.py); the
real-model path is covered in test_service.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

from broker.client import (  # noqa: E402
    AsyncClient,
    Client,
    HandleLost,
    InvalidRequest,
    RequestTimeout,
    ServerBusy,
    ServiceError,
    wait_within,
)
from test_broker import Service  # noqa: E402


@pytest.fixture(scope="module")
def service():
    svc = Service("--max-queue", "6")
    svc.start_broker()
    svc.start_worker("w1", delay=0.01)
    svc.start_worker("w2", delay=0.01)
    yield svc
    svc.close()


def wait_idle(client: Client, timeout: float = 5.0) -> float:
    """Seconds until both workers are idle again (so a cancelled decode really stopped)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(w["state"] == "idle" for w in client.status()["workers"]):
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError("workers stayed busy")


def test_sync_many_outstanding_requests_get_their_own_replies(service):
    with service.client() as client:
        prompts = [f"req{i}" for i in range(6)]
        pendings = [client.submit("generate", {"prompt": p}, stream=(i % 2 == 0)) for i, p in enumerate(prompts)]
        # Collect in reverse order: replies for others arrive meanwhile and must be kept for them.
        texts = {p.id: p.result().text for p in reversed(pendings)}
        assert [texts[p.id] for p in pendings] == prompts
        assert not client.inbox and not client.open


def test_sync_stream_and_early_exit_cancels_on_the_worker(service):
    with service.client() as client:
        with client.stream("s" * 300, max_tokens=300) as stream:
            seen = []
            for event in stream:
                seen.append(event.text)
                if len(seen) == 3:
                    break  # leaving the block cancels the request
        assert seen == ["s", "s", "s"]
        assert stream.final is not None and stream.final.stats["stop_reason"] == "cancelled"
        assert wait_idle(client) < 1.0  # it did not run all 300 tokens (3 s)


def test_sync_typed_errors(service):
    with service.client() as client:
        with pytest.raises(InvalidRequest) as err:
            client.generate("x", top_p=2.0)  # rejected locally, before any round trip
        assert "top_p" in str(err.value)
        with pytest.raises(HandleLost) as err:
            client.call("resume", handle="gone-1:1", loops=2)
        assert isinstance(err.value, KeyError) and err.value.code == "handle_unknown"
        with pytest.raises(RequestTimeout) as err:
            client.generate("t" * 100, timeout=0.2)
        assert isinstance(err.value, TimeoutError)


def test_busy_is_a_retryable_server_busy(service):
    with service.client() as client:
        wait_idle(client)
        pendings = [client.submit("generate", {"prompt": "b" * 30}) for _ in range(12)]
        outcomes = []
        for p in pendings:
            try:
                p.result()
                outcomes.append("done")
            except ServerBusy as err:
                assert err.retryable
                outcomes.append("busy")
        # 2 running + 6 queued fit; the rest are told busy.
        assert outcomes.count("busy") == 4 and outcomes.count("done") == 8


def test_client_timeout_when_no_broker_answers(tmp_path):
    with Client(f"ipc://{tmp_path}/nobody", timeout=0.2, grace=0.3) as client:
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            client.generate("x")
        assert 0.4 < time.monotonic() - t0 < 2.0


def test_async_generate_stream_and_concurrency(service):
    async def main():
        async with AsyncClient(service.frontend, timeout=20) as client:
            reply = await client.generate("async")
            assert reply.text == "async" and reply.worker in ("w1", "w2")
            final: list = []
            pieces = [e.text async for e in client.stream("tokens", result=final)]
            assert "".join(pieces) == "tokens" and final[0].tokens == [ord(c) for c in "tokens"]
            replies = await asyncio.gather(*(client.generate(f"c{i}") for i in range(6)))
            assert [r.text for r in replies] == [f"c{i}" for i in range(6)]
            assert {r.worker for r in replies} == {"w1", "w2"}
            status = await client.status()
            assert len(status["workers"]) == 2

    asyncio.run(main())


def test_async_task_cancel_and_timeout_stop_the_work(service):
    async def main():
        async with AsyncClient(service.frontend, timeout=20) as client:
            task = asyncio.ensure_future(client.generate("z" * 300, max_tokens=300))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            with pytest.raises(RequestTimeout):
                await client.generate("y" * 300, max_tokens=300, timeout=0.2)
            # Breaking out of a stream also cancels.
            async for event in client.stream("q" * 300, max_tokens=300):
                break
            with pytest.raises(ServiceError):
                await client.call("teleport")

    t0 = time.monotonic()
    asyncio.run(main())
    with Client(service.frontend) as client:
        assert wait_idle(client) < 1.0
    assert time.monotonic() - t0 < 3.0  # nothing ran its full 3 s


def test_a_cancel_that_comes_as_a_message_arrives_is_not_lost():
    """The gateway cancels its pump when the HTTP client hangs up; if a token had just arrived, Python 3.11's
    asyncio.wait_for handed it over and dropped the cancel, and the request ran on to max_tokens."""
    async def cancelled_as_the_message_arrives():
        box: asyncio.Queue = asyncio.Queue()
        waiter = asyncio.ensure_future(wait_within(box.get(), 10))
        await asyncio.sleep(0)  # the waiter is parked on the queue
        box.put_nowait("token")
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    async def times_out():
        with pytest.raises(asyncio.TimeoutError):
            await wait_within(asyncio.Queue().get(), 0.05)
        assert await wait_within(asyncio.sleep(0, "ready"), 1) == "ready"

    asyncio.run(cancelled_as_the_message_arrives())
    asyncio.run(times_out())
