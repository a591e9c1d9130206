"""A service fuzz test: random requests over every field (valid, edge, invalid, non-finite, huge, wrong type, invalid
Unicode) sent concurrently, through HTTP and msgpack, beside fixed greedy requests. Every request gets exactly one
final answer (never a 500, never a timeout), the greedy ones equal their solo answers, no worker restarts, and the
service stays ready."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tinyloop
from broker.client import Client, ServiceError
from test_service_model_facts import Served
from tinyloop.fields import GENERATE_FIELDS

GREEDY = ["def fibonacci(n):\n", "import os\n", "class Stack:\n", "for i in range(10):\n"]
junk = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=20), st.just("\ud800"), st.lists(st.integers(-5, 70000), max_size=4),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
sane = {  # values a request may reasonably send, edges included
    "max_tokens": st.integers(1, 12), "loops": st.integers(1, 16), "temperature": st.sampled_from([0.0, 1e-38, 0.7, 2.0]),
    "top_k": st.integers(0, 50), "top_p": st.sampled_from([1e-9, 0.5, 1.0]), "seed": st.integers(0, 2**63 - 1),
    "repetition_penalty": st.sampled_from([1e-45, 1.0, 100.0]), "min_p": st.sampled_from([0.0, 0.5, 1.0]),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2), "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 12), "stop_token_ids": st.lists(st.integers(0, 100), max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, 100).map(str), st.floats(-100, 100), max_size=3),
    "stop_sequences": st.lists(st.text(min_size=1, max_size=3), max_size=2), "early_exit_threshold": st.floats(0, 1),
    "exit_rule": st.sampled_from(["latent", "cdf", "entropy", "kl", "argmax"]), "min_loops": st.integers(1, 16),
}
field_value = st.sampled_from(sorted(GENERATE_FIELDS)).flatmap(
    lambda name: st.tuples(st.just(name), st.one_of(sane.get(name, junk), junk) if name in sane else junk))
request = st.tuples(st.sampled_from(["http", "msgpack"]), st.one_of(st.text(max_size=30), st.just("\ud800x")),
                    st.lists(field_value, max_size=4))


@pytest.fixture(scope="module")
def service():
    with Served(["--max-lanes", "8"]) as svc:
        with Client(svc.frontend) as client:
            svc.pids = sorted(w["pid"] for w in client.status()["workers"])
        yield svc


@pytest.fixture(scope="module")
def solo():
    model = tinyloop.load_model(None, 256)
    return [tinyloop.generate(model, p, tinyloop.GenerateConfig(max_tokens=12)).tokens for p in GREEDY]


def send(svc: Served, kind: str, prompt, fields: dict) -> str:
    """One request; what its one final answer was ("ok", "refused" or "error: ...")."""
    if kind == "http":
        body = {"prompt": prompt, **{("stop" if k == "stop_sequences" else k): v for k, v in fields.items()}}
        try:
            content = httpx.Request("POST", "/", json=body).content  # a lone surrogate cannot even be written as JSON
        except (UnicodeEncodeError, ValueError):
            content = b'{"prompt": "\\ud800"}'
        resp = httpx.post(svc.url + "/v1/completions", content=content, headers={"content-type": "application/json"},
                          timeout=120)
        return "ok" if resp.status_code == 200 else "refused" if resp.status_code < 500 else f"error: {resp.text}"
    with Client(svc.frontend, timeout=120) as client:
        try:
            client.generate(prompt, **fields)
            return "ok"
        except ServiceError as exc:
            return f"error: {exc}" if exc.code in ("timeout", "runtime_error", "worker_lost") else "refused"


def greedy_tokens(svc: Served, prompt: str) -> list[int]:
    with Client(svc.frontend, timeout=120) as client:
        return client.generate(prompt, max_tokens=12).tokens


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(request, min_size=16, max_size=16))
def test_random_requests_beside_greedy_ones(service, solo, batch):
    with ThreadPoolExecutor(8) as pool:
        greedy = [pool.submit(greedy_tokens, service, p) for p in GREEDY]
        answers = [pool.submit(send, service, kind, prompt, dict(fields)) for kind, prompt, fields in batch]
        outcomes = [a.result() for a in answers]
        assert [g.result() for g in greedy] == solo
    assert not [o for o in outcomes if o.startswith("error")], [o for o in outcomes if o.startswith("error")]
    with Client(service.frontend) as client:
        assert sorted(w["pid"] for w in client.status()["workers"]) == service.pids  # no worker restarted
    assert httpx.get(service.url + "/health", timeout=10).json()["ready_workers"] == 1
