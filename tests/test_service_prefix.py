"""Prefix caching in the workers and cache-aware routing in the broker, end to end: a real broker and two real worker
processes with the bundled model over real ZeroMQ. Answers equal the runtime's own `generate` on the whole text; a
request goes to the worker whose prefix cache holds its prompt's prefix, and to the other one while that worker is
busy."""

from __future__ import annotations

import json
import time

import pytest

import tinyloop
from conftest import direct
from broker import launcher
from broker.client import Client

MAX_SEQ_LEN = 512
# Registered through --prefix-file; ends in whitespace, so a continuation tokenizes differently at the seam.
SCAFFOLD = "# You are a careful Python programmer.\n# Answer with code only.\n\n"
# Not registered: cached by the first request that uses them.
FRESH = ["import os\nimport sys\nimport json\n\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n",
         "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        "]


@pytest.fixture(scope="module")
def model():
    import torch

    torch.set_num_threads(1)  # like the workers
    m = tinyloop.load_model(None, MAX_SEQ_LEN)  # prefix caching off: generate's own answer
    yield m
    tinyloop.free_model(m)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    prefix_file = tmp_path_factory.mktemp("prefixes") / "scaffolds.json"
    prefix_file.write_text(json.dumps([SCAFFOLD]))
    # one lane per worker: a worker running a request is busy, so the fallback below is observable (with more lanes
    # the holder would batch the follower beside its long answer)
    worker_args = ["--max-seq-len", str(MAX_SEQ_LEN), "--max-handles", "2", "--threads", "1", "--max-lanes", "1",
                   "--prefix-file", str(prefix_file)]
    with launcher.LocalService(2, worker_args, heartbeat_interval=1.0, startup_timeout=300) as svc:
        yield svc


def test_registered_scaffold_continuations_hit_and_equal_generate(service, model):
    seam = len(model.codec.encode(SCAFFOLD))
    with Client(service.frontend, timeout=120) as client:
        for op in ("generate_pool", "generate"):
            for suffix in ("def add(a, b):", "    return 1", "print(", "\n# note"):
                reply = client.call(op, prompt=SCAFFOLD + suffix, max_tokens=6)
                expected = direct(model, SCAFFOLD + suffix, max_tokens=6)
                assert reply.tokens == expected.tokens and reply.text == expected.text, (op, suffix)
                assert reply.stats["prefix_hit_tokens"] >= seam - 2, (op, suffix)  # all but the merged seam
        # workers report their blocks and prefixes with their heartbeats (every second): wait for one of each
        deadline = time.monotonic() + 10
        while True:
            status = client.status()
            if all(w["free_blocks"] is not None for w in status["workers"]) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    for worker in status["workers"]:
        assert worker["free_blocks"] > 0 and worker["cached_prefixes"] > 0 and worker["handles"] == 1  # the scaffold


def test_routing_follows_the_prefix_and_falls_back_while_its_holder_is_busy(service, model):
    with Client(service.frontend, timeout=120) as client, Client(service.frontend, timeout=120) as other_client:
        holder = client.generate(FRESH[0] + "x = 1", max_tokens=4).worker
        # without affinity the least recently used worker would alternate; each follower goes to the holder instead
        for suffix in ("y = 2", "def g():", "z = [", "print("):
            reply = client.generate(FRESH[0] + suffix, max_tokens=4)
            assert reply.worker == holder and reply.stats["prefix_hit_tokens"] >= 32, suffix  # its whole blocks
            assert reply.tokens == direct(model, FRESH[0] + suffix, max_tokens=4).tokens
        second = client.generate(FRESH[1] + "pass", max_tokens=4).worker
        assert second != holder  # nobody held it: the least recently used worker
        for prefix, owner in ((FRESH[1], second), (FRESH[0], holder), (FRESH[1], second), (FRESH[0], holder)):
            assert client.generate(prefix + "return", max_tokens=2).worker == owner
        # the holder is busy with a long answer (a grammar that cannot end early): the next request for its prefix
        # goes to the free worker rather than waiting
        # (at the deepest loop count: seconds of work at any decode speed, against the fallback's few tokens)
        with client.stream(FRESH[0] + "# a long one\n", max_tokens=400, loops=16,
                           grammar={"regex": "[a-z]{400}"}) as stream:
            next(iter(stream))
            fallback = other_client.generate(FRESH[0] + "w = 3", max_tokens=4)
            stream.cancel()
        long = stream.result()
    assert long.worker == holder and long.stats["stop_reason"] == "cancelled"  # it was still running
    assert fallback.worker == second
    assert fallback.tokens == direct(model, FRESH[0] + "w = 3", max_tokens=4).tokens
