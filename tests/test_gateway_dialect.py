"""The dialect real clients speak, through a real `tinyloop serve --http-port` (one worker, the bundled model): the
request shapes of a serving benchmark, an OpenAI proxy and an eval harness, with vLLM's extra fields, checked for
status, streamed chunks, usage and what each field does to the tokens. One service for the module."""
from __future__ import annotations

import json

import httpx
import pytest

import tinyloop
from broker.gateway import Gateway
from broker.openai_schema import APIError
from test_service_model_facts import Served
from tinyloop.chat import chat_ids

MODEL = "tinyloop-default"
PROMPT = "def fibonacci(n):\n"
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "import os"}]}]  # content as text parts


@pytest.fixture(scope="module")
def svc():
    with Served([]) as service:
        yield service


@pytest.fixture(scope="module")
def model():
    return tinyloop.load_model(None, 256)


def stream(svc: Served, path: str, body: dict) -> list[dict]:
    """The `data:` events of a streamed answer, [DONE] last."""
    with httpx.stream("POST", svc.url + path, json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def refused(svc: Served, path: str, body: dict) -> dict:
    resp = httpx.post(svc.url + path, json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def test_models_are_stable_from_the_first_answer(svc):
    assert [m["id"] for m in httpx.get(svc.url + "/v1/models").json()["data"]] == [MODEL]
    assert httpx.get(f"{svc.url}/v1/models/{MODEL}").json()["id"] == MODEL
    assert httpx.get(svc.url + "/v1/models/other").status_code == 404
    # Before any worker has said what it serves: 503, not a guess that later changes; --model-name is known at once.
    with pytest.raises(APIError) as err:
        Gateway("ipc:///nonexistent").known_models()
    assert err.value.status == 503
    assert Gateway("ipc:///nonexistent", model_name="mine").known_models() == ["mine"]


def test_a_benchmarks_streaming_chat_request(svc, model):
    """vLLM benchmark_serving's chat shape: text parts, max_completion_tokens, ignore_eos, usage in every chunk."""
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0.0, "max_completion_tokens": 24, "max_tokens": 24,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "ignore_eos": True, "repetition_penalty": 1.0, "top_k": -1}
    chunks = stream(svc, "/v1/chat/completions", body)
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 24
    prompt_ids = chat_ids(model, [{"role": "user", "content": "import os"}])
    assert last["usage"]["prompt_tokens"] == len(prompt_ids)  # the rendered template's tokens (docs/gateway.md)
    counts = [c["usage"]["completion_tokens"] for c in choice_chunks]
    assert all("usage" in c for c in choice_chunks) and counts == sorted(counts) and counts[-1] == 24
    assert choice_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert choice_chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in choice_chunks)
    expected = tinyloop.generate(model, prompt_ids, tinyloop.GenerateConfig(max_tokens=24, ignore_eos=True))
    assert text == expected.text


def test_a_benchmarks_completion_request_and_ignore_eos(svc, model):
    """vLLM benchmark_serving's completions shape; with EOS made near certain, ignore_eos still gives max_tokens."""
    eos = str(model.eos_id)
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 12,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "ignore_eos": True, "logit_bias": {eos: 100}}
    last = stream(svc, "/v1/completions", body)[-1]
    assert last["usage"]["completion_tokens"] == 12
    plain = svc.post("/v1/completions", {**body, "stream": False, "stream_options": None, "ignore_eos": False})
    assert plain["usage"]["completion_tokens"] == 0 and plain["choices"][0]["finish_reason"] == "stop"


def test_min_tokens_holds_back_eos_and_stops(svc, model):
    eos = str(model.eos_id)
    ask = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 12}
    held = svc.post("/v1/completions", {**ask, "logit_bias": {eos: 100}, "min_tokens": 5})
    assert held["usage"]["completion_tokens"] == 5 and held["choices"][0]["finish_reason"] == "stop"
    free = tinyloop.generate(model, PROMPT, tinyloop.GenerateConfig(max_tokens=12))
    first = free.tokens[0]
    stopped = svc.post("/v1/completions", {**ask, "stop_token_ids": [first], "min_tokens": 3})
    assert stopped["usage"]["completion_tokens"] >= 3  # the stop token was banned for the first three
    stop_text = model.codec.decode(free.tokens[:3])
    text = svc.post("/v1/completions", {**ask, "stop": [stop_text], "min_tokens": 6})["choices"][0]["text"]
    assert text.startswith(stop_text)  # the stop text came before min_tokens: held, not matched


def test_stop_token_ids_stop(svc, model):
    free = tinyloop.generate(model, PROMPT, tinyloop.GenerateConfig(max_tokens=12))
    stop = free.tokens[3]
    cut = free.tokens[:free.tokens.index(stop)]
    res = svc.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 12,
                                       "stop_token_ids": [stop]})
    assert res["usage"]["completion_tokens"] == len(cut) and res["choices"][0]["finish_reason"] == "stop"
    assert res["choices"][0]["text"] == model.codec.decode(cut)


def test_a_proxys_request_with_logit_bias_and_n(svc, model):
    """A LiteLLM-style proxy's chat request: n choices, logit_bias, the penalties and `user`, not streamed."""
    body = {"model": MODEL, "messages": [{"role": "system", "content": "You write Python."},
                                         {"role": "user", "content": "def add(a, b):"}],
            "n": 2, "temperature": 0.8, "seed": 11, "max_tokens": 8, "presence_penalty": 0.5,
            "frequency_penalty": 0.3, "logit_bias": {str(model.eos_id): 100}, "user": "someone"}
    res = svc.post("/v1/chat/completions", body)
    assert [c["index"] for c in res["choices"]] == [0, 1]
    assert all(c["message"]["content"] == "" and c["finish_reason"] == "stop" for c in res["choices"])
    assert res["usage"]["completion_tokens"] == 0
    unbiased = svc.post("/v1/chat/completions", {**body, "logit_bias": {}})
    assert unbiased["usage"]["completion_tokens"] > 0
    prompt = chat_ids(model, body["messages"])
    assert unbiased["usage"]["prompt_tokens"] == len(prompt)  # counted once, not per choice


def test_an_eval_harness_echo_and_logprobs_request(svc):
    """lm-eval's local-completions log-likelihood request: token ids, echo, logprobs, max_tokens 1, a seed."""
    res = svc.post("/v1/completions", {"model": MODEL, "prompt": "x = 1\ny = ", "max_tokens": 1, "temperature": 0,
                                       "logprobs": 1, "echo": True, "seed": 1234})
    choice = res["choices"][0]
    assert choice["text"].startswith("x = 1\ny = ")
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == res["usage"]["total_tokens"]
    assert res["usage"]["completion_tokens"] == 1


def test_vllm_fields_that_cannot_be_honoured_are_refused_by_name(svc):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for body, param in [({"best_of": 3}, "best_of"), ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
                        ({"chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs"),
                        ({"continue_final_message": True}, "continue_final_message"),
                        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
                        ({"guided_regex": "a+", "guided_json": {}}, "guided_regex"),
                        ({"min_p": 2}, "min_p"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
                        ({"frobnicate": 1}, "frobnicate")]:
        assert refused(svc, "/v1/chat/completions", {**chat, **body})["param"] == param, body


def test_guided_choice_and_chat_echo(svc):
    res = svc.post("/v1/completions", {"model": MODEL, "prompt": "answer = ", "max_tokens": 8, "temperature": 0,
                                       "guided_choice": ["yes", "no (maybe)"]})
    assert res["choices"][0]["text"] in ("yes", "no (maybe)")
    msgs = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "    return"}]
    res = svc.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0,
                                            "echo": True})
    assert res["choices"][0]["message"]["content"].startswith("    return")


def test_chat_template_options_reach_the_template(svc, model):
    """add_generation_prompt and chat_template_kwargs travel to the worker, which renders the chat with them."""
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    closed = svc.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2, "temperature": 0,
                                               "add_generation_prompt": False,
                                               "chat_template_kwargs": {"enable_thinking": False}})
    assert closed["usage"]["prompt_tokens"] == len(chat_ids(model, msgs, add_generation_prompt=False))
    assert len(chat_ids(model, msgs, add_generation_prompt=False)) != len(chat_ids(model, msgs))
