"""Two facts the service once kept apart from the runtime, checked through a real `tinyloop serve` (broker, worker,
gateway), over HTTP and over the msgpack client:

- a chat request is tokenized as `tinyloop.chat.chat_ids` tokenizes it, batched or not: a template that writes its
  own BOS (Huginn's) gets one BOS, not two;
- `TINYLOOP_WEIGHTS` picks the workers' weight format, as it does load_model's: the service answers as the
  in-process model in that format does.
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

import tinyloop
from broker import launcher
from broker.client import Client
from test_gateway import free_port, wait_health
from tinyloop.chat import chat_ids

REPO = Path(__file__).resolve().parent.parent
HUGINN = REPO / "tests" / "data" / "hf" / "huginn-tiny"
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]


class Served:
    """`tinyloop serve --workers 1 --http-port` with extra arguments and environment; stopped on exit."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.tmp = Path(tempfile.mkdtemp(prefix="tlf-", dir="/tmp"))  # ipc paths must stay short
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.frontend = f"ipc://{self.tmp}/f"
        self.proc = subprocess.Popen(
            launcher.service_command("serve", "--workers", "1", "--frontend", self.frontend,
                                     "--backend", f"ipc://{self.tmp}/b", "--log-dir", str(self.tmp / "logs"),
                                     "--max-seq-len", "256", "--threads", "1", "--http-port", str(self.port), *args),
            env={**launcher.child_env(), **(env or {})}, cwd=str(REPO), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)

    def __enter__(self) -> "Served":
        wait_health(self.url, self.proc, 240, workers=1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def post(self, path: str, body: dict) -> dict:
        resp = httpx.post(self.url + path, json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()


def test_chat_is_tokenized_as_chat_ids_with_one_bos():
    model = tinyloop.load_model(str(HUGINN), 256)
    ids = chat_ids(model, MESSAGES)
    bos = model.cfg.bos_id
    assert ids.count(bos) == 1  # the template writes the BOS; nothing adds a second one
    expected = tinyloop.generate(model, ids, tinyloop.GenerateConfig(max_tokens=8))
    with Served(["--model", str(HUGINN)]) as svc:
        with Client(svc.frontend) as client:  # msgpack: the chat op joins the worker's batch
            reply = client.call("chat", messages=MESSAGES, max_tokens=8, temperature=0.0)
        assert reply.stats["prompt_tokens"] == len(ids)
        assert reply.tokens == expected.tokens
        body = svc.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "temperature": 0})
        assert body["usage"]["prompt_tokens"] == len(ids)
        assert body["choices"][0]["message"]["content"] == expected.text


def test_tinyloop_weights_sets_the_workers_format():
    prompt, cfg = "import os\n", tinyloop.GenerateConfig(max_tokens=24)
    fp32 = tinyloop.generate(tinyloop.load_model(None, 256, weights="fp32"), prompt, cfg)
    int4 = tinyloop.generate(tinyloop.load_model(None, 256, weights="int4"), prompt, cfg)
    assert fp32.tokens != int4.tokens  # the prompt tells the two formats apart
    with Served([], env={"TINYLOOP_WEIGHTS": "int4"}) as svc:
        with Client(svc.frontend) as client:
            assert client.generate(prompt, max_tokens=24, temperature=0.0).tokens == int4.tokens
        body = svc.post("/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0})
        assert body["choices"][0]["text"] == int4.text


@pytest.fixture(autouse=True)
def _no_weights_env(monkeypatch):
    """The in-process models above choose their formats by argument; an outer TINYLOOP_WEIGHTS must not leak in."""
    monkeypatch.delenv("TINYLOOP_WEIGHTS", raising=False)
