"""The OpenAI-compatible gateway, end to end: a real `tinyloop serve --http-port` (broker, two model
workers and the gateway as processes, the bundled model) driven by the official `openai` client and
by raw HTTP for every error status. One service for the whole module (starting it is the slow part)."""
from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from broker import launcher
from broker.client import Client

REPO = Path(__file__).resolve().parent.parent
KEY = "test-key-1"
MODEL = "tinyloop-default"
PROMPT = "def fibonacci(n):\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, proc: subprocess.Popen, timeout: float, workers: int = 2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"process exited with {proc.returncode}"
        try:
            health = httpx.get(f"{url}/health", timeout=2)
            if health.status_code == 200 and health.json()["ready_workers"] >= workers:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the gateway did not become healthy")


class Service:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.frontend = f"ipc://{tmp}/f"
        (tmp / "keys").write_text(f"# accepted keys\n{KEY}\n")
        self.proc = subprocess.Popen(
            launcher.service_command("serve", "--workers", "2", "--frontend", self.frontend, "--backend", f"ipc://{tmp}/b",
                                     "--log-dir", str(tmp / "logs"), "--max-seq-len", "512", "--threads", "1",
                                     "--heartbeat-interval", "0.5", "--max-queue", "2", "--http-port", str(self.port),
                                     "--max-lanes", "1",  # one request per worker: the 429 test fills the queue
                                     "--api-key-file", str(tmp / "keys")),
            env=launcher.child_env(), cwd=str(REPO), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)

    def post(self, path: str, body: dict | bytes, key: str | None = KEY, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url + path, content=content, headers={**headers, "content-type": "application/json"},
                          timeout=60, **kw)

    def in_flight(self) -> int:
        with Client(self.frontend) as client:
            return client.status()["in_flight"]


@pytest.fixture(scope="module")
def svc():
    tmp = Path(tempfile.mkdtemp(prefix="tlg-", dir="/tmp"))  # ipc paths must stay short
    service = Service(tmp)
    try:
        wait_health(service.url, service.proc, 240)
        yield service
    finally:
        service.proc.send_signal(signal.SIGTERM)
        try:
            service.proc.wait(60)
        except subprocess.TimeoutExpired:
            service.proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def oai(svc):
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_models_health_and_metrics(svc, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    health = httpx.get(svc.url + "/health").json()
    assert health["status"] == "ok" and health["ready_workers"] == 2
    metrics = httpx.get(svc.url + "/metrics").text
    assert "tinyloop_gateway_ready_workers 2.0" in metrics and "tinyloop_gateway_requests_total" in metrics
    assert httpx.get(svc.url + "/livez").json()["status"] == "alive"  # the event loop runs


def test_completion_equals_the_msgpack_client_and_streams_the_same_text(svc, oai):
    res = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    with Client(svc.frontend) as client:
        direct = client.generate(PROMPT, max_tokens=16, temperature=0.0)
    choice = res.choices[0]
    assert choice.text == direct.text and choice.text and choice.finish_reason in ("length", "stop")
    assert res.usage.prompt_tokens == direct.stats["prompt_tokens"]
    assert res.usage.completion_tokens == len(direct.tokens)
    assert res.object == "text_completion" and res.model == MODEL
    pieces, finish, usage = [], None, None
    for chunk in oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                        stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.text)
            finish = c.finish_reason or finish
    assert "".join(pieces) == direct.text and len(pieces) > 3  # token by token, not one blob
    assert finish == choice.finish_reason and usage.completion_tokens == res.usage.completion_tokens


def test_chat_sync_and_async_streaming(svc, oai):
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    res = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    text = res.choices[0].message.content
    assert res.choices[0].message.role == "assistant" and text and res.object == "chat.completion"
    # The worker rendered the bundled template: the same prompt through the msgpack client gives the same text.
    with Client(svc.frontend) as client:
        direct = client.generate("system: You write Python.\nuser: def add(a, b):\nassistant:", max_tokens=12,
                                 temperature=0.0)
    assert text == direct.text and res.usage.prompt_tokens == direct.stats["prompt_tokens"]

    async def run() -> tuple[str, str]:
        aoai = openai.AsyncOpenAI(base_url=svc.url + "/v1", api_key=KEY, max_retries=0)
        whole = await aoai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
        stream = await aoai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                                    stream=True)
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        await aoai.close()
        return whole.choices[0].message.content, "".join(parts)

    whole, streamed = asyncio.run(run())
    assert whole == streamed == text


def test_completion_logprobs_and_echo_match_in_process_scoring(svc, oai):
    import tinyloop
    from tinyloop.scoring import token_logprobs

    res = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, echo=True,
                                 extra_body={"loops": 4})
    lp = res.choices[0].logprobs
    assert res.choices[0].text.startswith(PROMPT)
    model = tinyloop.load_model(max_seq_len=512)
    prompt_ids = model.codec.encode(PROMPT)
    n_prompt = len(prompt_ids)
    assert len(lp.tokens) == n_prompt + res.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    gen_ids = model.codec.encode(res.choices[0].text[len(PROMPT):])
    expect = token_logprobs(model, prompt_ids, gen_ids, loops=4, score_context=True)
    assert lp.token_logprobs[1:n_prompt] == pytest.approx(expect["context"]["logprobs"][1:], abs=1e-4)
    assert lp.token_logprobs[n_prompt:] == pytest.approx(expect["logprobs"], abs=1e-4)
    for value, top in zip(lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert len(top) == 3 and value == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the top one
    # max_tokens 0 with echo: only the prompt's log-probabilities (what log-likelihood evaluation asks).
    res0 = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, temperature=0, logprobs=1, echo=True,
                                  extra_body={"loops": 4})
    assert res0.choices[0].text == PROMPT and res0.usage.completion_tokens == 0
    assert res0.choices[0].logprobs.token_logprobs[0] is None
    assert res0.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n_prompt], abs=1e-4)


@pytest.mark.parametrize("exits", [{"exit_rule": "entropy", "early_exit_threshold": 0.05, "min_loops": 3},
                                   {"exit_rule": "argmax", "early_exit_threshold": 2, "max_loops": 12},
                                   {"early_exit_threshold": 0.1, "min_loops": 2, "loops": 10}])
def test_exit_rules_ride_along_as_extra_body_fields_and_equal_the_runtime(svc, oai, exits):
    """Issue 31: a request's exit rule, threshold and min/max loops reach the worker's batch; the text and the
    loops each token ran equal the same call in process."""
    import tinyloop

    res = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=exits)
    model = tinyloop.load_model(max_seq_len=512)
    fields = {("loops" if k == "max_loops" else k): v for k, v in exits.items()}
    alone = tinyloop.generate(model, PROMPT, tinyloop.GenerateConfig(max_tokens=12, **fields))
    assert res.choices[0].text == alone.text
    assert min(alone.loops_used[1:]) < (fields.get("loops") or model.cfg.default_loops)  # it exits early
    assert min(alone.loops_used) >= exits.get("min_loops", 1)


def test_a_bad_exit_rule_is_a_400_naming_it(svc):
    ok = {"model": MODEL, "prompt": "x = ", "max_tokens": 2}
    for body, param, needle in [({**ok, "exit_rule": "halting"}, "exit_rule", "one of"),
                                ({**ok, "exit_rule": "kl"}, "exit_rule", "early_exit_threshold > 0"),
                                ({**ok, "min_loops": 0}, "min_loops", "1"),
                                ({**ok, "max_loops": 4, "loops": 6}, "max_loops", "another name for 'loops'")]:
        r = svc.post("/v1/completions", body)
        assert r.status_code == 400 and needle in error_of(r)["message"], (body, r.text)
        assert error_of(r)["param"] == param or param in error_of(r)["message"], r.text


def test_token_id_prompts_batched_as_lm_eval_sends_them(svc):
    """lm-eval's local-completions log-likelihood request: token-id prompts, echo, logprobs 1, max_tokens 1."""
    with Client(svc.frontend) as client:
        ids = [client.generate(p, max_tokens=1, temperature=0.0, echo=True, logprobs=True).result["prompt_logprobs"]["tokens"]
               for p in ("import os\n", "class A:\n    pass\n")]
    r = svc.post("/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                                     "echo": True, "seed": 1234})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for c, prompt in zip(choices, ids):
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
        assert c["text"].startswith("import os\n" if prompt is ids[0] else "class A:")
    assert r.json()["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])


def test_chat_logprobs_streamed_with_their_tokens(svc, oai):
    msgs = [{"role": "user", "content": "import os"}]
    chunks = list(oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                              top_logprobs=2, stream=True))
    content = [c for chunk in chunks for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
    text = "".join(ch.delta.content or "" for chunk in chunks for ch in chunk.choices)
    assert len(content) == 6 and "".join(c.token for c in content) == text
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert bytes(c.bytes).decode() == c.token


def test_structured_output_parses(svc, oai):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    res = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a person as JSON"}],
                                      max_tokens=48, temperature=0.7, seed=3,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "person", "schema": schema}})
    value = json.loads(res.choices[0].message.content)
    assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool) and res.choices[0].finish_reason == "stop"
    res = oai.completions.create(model=MODEL, prompt="config = ", max_tokens=48, temperature=0,
                                 extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(res.choices[0].text), dict)


def test_n_seed_stop_and_looped_model_knobs(svc, oai):
    kw = dict(model=MODEL, prompt="import ", max_tokens=10, temperature=1.0, seed=7, n=2)
    a, b = oai.completions.create(**kw), oai.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1] and [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # choice j samples with seed + j
    one = oai.completions.create(**{**kw, "n": 1})
    assert one.choices[0].text == a.choices[0].text  # choice 0 is the plain seeded request
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once, not once per choice
    # stop: cut before the stop string, finish_reason "stop".
    full = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    cut = full.strip()[:3]
    res = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[cut])
    assert res.choices[0].finish_reason == "stop" and cut not in res.choices[0].text
    assert full.startswith(res.choices[0].text)
    # Speculative decode (draft 2 loops, verify 8) gives greedy output equal to plain decode at 8 loops.
    plain = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"loops": 8})
    spec = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                  extra_body={"loops": 8, "draft_loops": 2, "verify_loops": 8, "draft_ahead": 4})
    assert spec.choices[0].text == plain.choices[0].text
    two = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                 extra_body={"loops": 1, "early_exit_threshold": 0.0, "cache_window": 0})
    assert two.choices[0].text != plain.choices[0].text  # the loop count reaches the model


def error_of(resp: httpx.Response) -> dict:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_error_statuses(svc, oai):
    ok = {"model": MODEL, "prompt": "x = ", "max_tokens": 2}
    # 401: missing or wrong key.
    assert svc.post("/v1/completions", ok, key=None).status_code == 401
    r = svc.post("/v1/completions", ok, key="wrong")
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    assert httpx.get(svc.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=svc.url + "/v1", api_key="wrong", max_retries=0).models.list()
    # 400 naming the field: gateway rules, wire rules, runtime rules.
    for body, param in [({**ok, "temperature": 5}, "temperature"), ({**ok, "prompt": []}, "prompt"),
                        ({**ok, "loopz": 3}, "loopz"), ({**ok, "loops": 99}, "loops"), ({**ok, "top_k": -2}, "top_k"),
                        ({**ok, "presence_penalty": 2.5}, "presence_penalty"), ({**ok, "max_tokens": 0}, "max_tokens"),
                        ({**ok, "best_of": 3}, "best_of"), ({**ok, "logit_bias": {"x": 1}}, "logit_bias")]:
        r = svc.post("/v1/completions", body)
        assert r.status_code == 400 and error_of(r)["param"] == param, (body, r.text)
    r = svc.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and error_of(r)["param"] == "messages[0].role"
    assert error_of(svc.post("/v1/completions", {**ok, "prompt": ""}))["param"] == "prompt"
    # One dialect for a field, whoever refuses it (the wire's range, the model's max_loops): "'loops' must be in".
    for loops, limit in ((0, "[1, 4096]"), (99, "[1, 16]")):
        r = svc.post("/v1/completions", {**ok, "loops": loops})
        assert error_of(r)["message"].startswith(f"'loops' must be in {limit}") and f"got {loops}" in r.text, r.text
    # The renderer's own template variables are the client's mistake: a 400 naming the variable, never a 500.
    for name in ("messages", "add_generation_prompt", "raise_exception"):
        r = svc.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                              "chat_template_kwargs": {name: 1}})
        assert r.status_code == 400 and error_of(r)["param"] == "chat_template_kwargs" and f"'{name}'" in r.text, r.text
    # A trailing slash is the same endpoint (not a 307 with an empty body that POST clients do not follow).
    r = svc.post("/v1/completions/", ok)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text
    r = svc.post("/v1/completions", b"{not json")
    assert r.status_code == 400 and "JSON" in error_of(r)["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.completions.create(model=MODEL, prompt="x", temperature=3)
    # 404 unknown model.
    r = svc.post("/v1/completions", {**ok, "model": "gpt-4"})
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert httpx.get(svc.url + "/v1/models/nope", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    # 413 body too large (the default limit is 1 MiB).
    r = svc.post("/v1/completions", {**ok, "prompt": "x" * (1 << 20)})
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    # 504: the request's deadline passes while it decodes.
    r = svc.post("/v1/completions", {**ok, "max_tokens": 400, "temperature": 0, "loops": 16, "timeout": 0.2})
    assert r.status_code == 504 and error_of(r)["code"] == "timeout"
    wait_idle(svc)
    # 429 with Retry-After: 2 workers of one lane each + a queue of 2, and 8 long requests at once.
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as client:
            body = {**ok, "max_tokens": 30, "temperature": 0}
            return await asyncio.gather(*[client.post(svc.url + "/v1/completions", json=body) for _ in range(8)])

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
    r429 = next(r for r in responses if r.status_code == 429)
    assert r429.headers["retry-after"] == "1" and error_of(r429)["code"] == "busy"
    wait_idle(svc)


def wait_idle(svc: Service, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while svc.in_flight() and time.monotonic() < deadline:
        time.sleep(0.1)


def test_client_disconnect_cancels_the_request_on_the_worker(svc):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 450, "temperature": 0, "loops": 16}
    closed = '_requests_total{endpoint="/v1/completions",status="499"}'
    before = sum(float(l.split()[-1]) for l in httpx.get(svc.url + "/metrics").text.splitlines() if closed in l)
    for stream in (True, False):
        wait_idle(svc)
        if stream:
            with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
                with client.stream("POST", svc.url + "/v1/completions", json={**body, "stream": True}) as resp:
                    assert resp.status_code == 200
                    next(resp.iter_lines())  # the first token arrived: it is decoding
        else:  # a plain request: the client hangs up while it waits for the whole answer
            payload = json.dumps(body).encode()
            with socket.create_connection(("127.0.0.1", svc.port)) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: "
                             + str(len(payload)).encode() + b"\r\n\r\n" + payload)
                time.sleep(1.0)
                assert svc.in_flight() == 1
        # The connection is closed: the worker stops long before 450 tokens at 16 loops could finish.
        deadline = time.monotonic() + 5
        while svc.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert svc.in_flight() == 0, f"stream={stream}: still running"
    metrics = httpx.get(svc.url + "/metrics").text
    assert "tinyloop_gateway_client_disconnects_total 2.0" in metrics
    # Each request hung up on is counted once, under 499, streamed or not: the series sum to the requests.
    assert sum(float(l.split()[-1]) for l in metrics.splitlines() if closed in l) == before + 2
    # The broker's request log: both ended as "cancelled" on the worker, far short of 450 tokens.
    lines = [json.loads(l[l.index("{"):]) for l in (svc.tmp / "logs" / "broker.log").read_text().splitlines()
             if '"event": "request"' in l]
    cancelled = [l["stats"] for l in lines if l.get("stats", {}).get("stop_reason") == "cancelled"]
    assert len(cancelled) == 2 and all(s["generated_tokens"] < 450 for s in cancelled), cancelled


def test_no_worker_ready_is_503():
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="tlg-", dir="/tmp"))
    proc = subprocess.Popen([launcher.sys.executable, "-m", "scripts.gateway_cli", "--connect", f"ipc://{tmp}/nobroker",
                             "--port", str(port)], env=launcher.child_env(), cwd=str(REPO),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(url + "/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        assert health.status_code == 503 and health.json()["ready_workers"] == 0
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert error_of(r)["code"] == "no_worker_ready"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
