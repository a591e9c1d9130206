"""Parcae and Nanbeige4.2 served like the others: `tinyloop serve --model DIR` answers over msgpack what the model
answers in process, and the gateway's chat endpoint renders the family's chat template."""
from __future__ import annotations

from pathlib import Path

import pytest

import tinyloop
from broker.client import Client
from test_service_model_facts import Served
from tinyloop.chat import chat_ids

HF = Path(__file__).resolve().parent / "data" / "hf"
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


@pytest.mark.parametrize("family", ["parcae-tiny", "nanbeige-tiny"])
def test_a_family_is_served_over_msgpack_and_the_gateway(family):
    path = HF / family
    model = tinyloop.load_model(str(path), 256)
    plain = tinyloop.generate(model, "import os\n", tinyloop.GenerateConfig(max_tokens=8))
    chat = tinyloop.generate(model, chat_ids(model, MESSAGES), tinyloop.GenerateConfig(max_tokens=6))
    with Served(["--model", str(path)]) as svc:
        with Client(svc.frontend, timeout=120) as client:
            assert client.generate("import os\n", max_tokens=8, temperature=0.0).tokens == plain.tokens
        body = svc.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6, "temperature": 0})
    assert body["usage"]["prompt_tokens"] == len(chat_ids(model, MESSAGES))
    assert body["choices"][0]["message"]["content"] == chat.text
