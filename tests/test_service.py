"""End to end with the real bundled model: broker and worker processes from `workers/`,
real ZeroMQ sockets, real weights. Checks that answers through the service equal the
runtime's own, and that warm-start handles, the prefix pool, mode errors, cancellation
and memory budgets behave as documented.

(TINYLOOP_SERVICE_TEST_MODEL may name another artifact, for developing against a model
that is not yet bundled; by default the bundled model is used.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

import tinyloop  # noqa: E402
from conftest import direct  # noqa: E402
from broker import launcher  # noqa: E402
from broker.client import Client, HandleLost, InvalidRequest  # noqa: E402

MODEL = os.environ.get("TINYLOOP_SERVICE_TEST_MODEL")  # None: the bundled model
MODEL_ARGS = ["--model", MODEL] if MODEL else []
MAX_SEQ_LEN = 256
SCAFFOLD = "import os\nimport sys\n\n\ndef main():\n    "
PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def model():
    import torch

    torch.set_num_threads(1)  # like the workers: on a busy 2-core machine more threads only contend
    m = tinyloop.load_model(MODEL, MAX_SEQ_LEN)
    yield m
    tinyloop.free_model(m)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    prefix_file = tmp_path_factory.mktemp("prefixes") / "scaffolds.json"
    prefix_file.write_text(json.dumps([{"prefix": SCAFFOLD}]))
    worker_args = [*MODEL_ARGS, "--max-seq-len", str(MAX_SEQ_LEN), "--max-handles", "3", "--threads", "1",
                   "--prefix-file", str(prefix_file)]
    with launcher.LocalService(2, worker_args, heartbeat_interval=0.3, startup_timeout=300) as svc:
        yield svc


def test_generate_equals_the_runtime(service, model):
    with Client(service.frontend, timeout=60) as client:
        reply = client.generate(PROMPT, max_tokens=12)
        with client.stream(PROMPT, max_tokens=12, loops=3) as stream:
            pieces = [event.text for event in stream]
        streamed = stream.result()
    expected = direct(model, PROMPT, max_tokens=12)
    assert reply.tokens == expected.tokens and reply.text == expected.text
    assert reply.stats["generated_tokens"] == len(expected.tokens)
    assert {"prefill_ms", "first_token_ms", "decode_ms", "stop_reason", "loops_mean"} <= set(reply.stats)
    at3 = direct(model, PROMPT, max_tokens=12, loops=3)
    assert streamed.tokens == at3.tokens and "".join(pieces) == at3.text
    assert streamed.stats["loops_mean"] == 3


def test_warm_start_handles_route_refine_and_evict(service, model):
    with Client(service.frontend, timeout=60) as client:
        built = client.call("build_handle", prompt=PROMPT, l_used=2)
        draft = client.call("resume", handle=built.handle, loops=2, max_tokens=8)
        refined = client.call("resume", handle=built.handle, loops=6, max_tokens=8)
        assert draft.worker == refined.worker == built.worker  # routed to the holder
        assert draft.tokens == direct(model, PROMPT, max_tokens=8, loops=2).tokens
        assert refined.tokens == direct(model, PROMPT, max_tokens=8, loops=6).tokens
        assert refined.stats["skipped_loops"] > 0
        with pytest.raises(InvalidRequest) as err:  # warm start x beam search is rejected by the mode matrix
            client.call("resume", handle=built.handle, loops=4, beam_size=2)
        assert err.value.code == "mode_error"
        # Cap is 3 per worker, one taken by the pool scaffold: a third handle on that worker evicts the first.
        mine = [built]
        while len(mine) < 3:
            reply = client.call("build_handle", prompt=f"x = {len(mine)}\n", l_used=1)
            if reply.worker == built.worker:
                mine.append(reply)
        with pytest.raises(HandleLost) as err:
            client.call("resume", handle=built.handle, loops=2)
        assert err.value.code == "handle_evicted"
        assert client.call("resume", handle=mine[-1].handle, loops=2, max_tokens=2).worker == built.worker
        client.call("release_handle", handle=mine[-1].handle)
        with pytest.raises(HandleLost) as err:
            client.call("resume", handle=mine[-1].handle, loops=2)
        assert err.value.code == "handle_unknown"
        status = client.status()
        assert all(w["handles"] <= w["max_handles"] == 3 for w in status["workers"])


def test_prefix_pool_and_mode_errors(service, model):
    # Token ids, so the scaffold's tokens are exactly a prefix (text could merge across the boundary).
    prompt = model.codec.encode(SCAFFOLD) + model.codec.encode("print(")
    with Client(service.frontend, timeout=60) as client:
        replies = [client.call("generate_pool", prompt=prompt, max_tokens=6) for _ in range(2)]
        with pytest.raises(InvalidRequest) as err:  # prefix reuse x beam search: rejected
            client.call("generate_pool", prompt=prompt, max_tokens=4, beam_size=2)
        assert err.value.code == "mode_error" and "Beam" in str(err.value)
        with pytest.raises(InvalidRequest) as err:  # wire-valid, but above the model's max_loops
            client.generate(PROMPT, loops=4000)
        assert err.value.code == "config_error" and "loops" in str(err.value)
    expected = direct(model, prompt, max_tokens=6)
    for reply in replies:
        assert reply.tokens == expected.tokens
        assert reply.stats["prefix_hit_tokens"] > 0


def test_cancel_stops_a_real_decode(service):
    with Client(service.frontend, timeout=60) as client:
        stream = client.stream(PROMPT, max_tokens=200, stop_sequences=[], temperature=1.0, seed=1)
        for i, _event in enumerate(stream):
            if i == 1:
                stream.cancel()
        reply = stream.result()
    assert reply.stats["stop_reason"] == "cancelled"
    assert len(reply.tokens) < 200


def test_worker_refuses_to_start_over_budget(tmp_path):
    proc = subprocess.run(
        launcher.service_command("worker", "--connect", f"ipc://{tmp_path}/none", *MODEL_ARGS, "--max-seq-len",
                                 str(MAX_SEQ_LEN), "--vram-budget", "64KiB", "--threads", "1"),
        env=launcher.child_env(), cwd=str(REPO), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 3, proc.stderr
    assert "exceeds the budget (--vram-budget: 0.1 MiB)" in proc.stderr
    assert "weights" in proc.stderr and "KV block pool" in proc.stderr and "total" in proc.stderr
    # the verdict is the last line: what `serve` quotes as the reason a worker stopped (not the table's total)
    assert proc.stderr.strip().splitlines()[-1].startswith("worker ") and "refusing to start" in \
        proc.stderr.strip().splitlines()[-1]


def test_submit_and_status_commands(service):
    env, cwd = launcher.child_env(), str(REPO)
    out = subprocess.run(launcher.service_command("submit", "--connect", service.frontend, PROMPT, "--max-tokens", "4"),
                         env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(PROMPT) and "tokens, stop=" in out.stderr
    out = subprocess.run(launcher.service_command("status", "--connect", service.frontend),
                         env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "2 worker(s)" in out.stdout and " w1 " in out.stdout and " w2 " in out.stdout


def test_speculative_equals_plain_decode(service, model):
    with Client(service.frontend, timeout=60) as client:
        assert "speculative" in client.status()["workers"][0]["ops"]
        with client.stream(PROMPT, op="speculative", draft_loops=2, verify_loops=6, draft_ahead=3,
                           max_tokens=10) as stream:
            streamed = [event.token for event in stream]
        reply = stream.result()
        with pytest.raises(InvalidRequest) as err:  # more beams than the worker's block pool can ever hold
            client.call("generate", prompt=PROMPT, beam_size=64, max_tokens=200)
        assert err.value.code == "budget" and "can never fit" in str(err.value)
        with pytest.raises(InvalidRequest) as err:  # speculative x grammar: rejected by the mode matrix
            client.call("speculative", prompt=PROMPT, draft_loops=2, verify_loops=6, grammar="[a-z]+")
        assert err.value.code == "mode_error"
    assert reply.tokens == streamed == direct(model, PROMPT, max_tokens=10, loops=6).tokens
    assert 0.0 <= reply.stats["draft_accept_rate"] <= 1.0


def test_loadtest_concurrency_sweep_json_and_plot(service, tmp_path):
    """`loadtest --concurrency 1,2`: one closed-loop load per level, all in the JSON, drawn as throughput and
    latency percentiles versus concurrency."""
    out, png = tmp_path / "load.json", tmp_path / "load.png"
    run = subprocess.run(launcher.service_command("loadtest", "--connect", service.frontend, "--concurrency", "1,2",
                                                  "--requests", "4", "--max-tokens", "2", "--json", str(out),
                                                  "--plot", str(png)),
                         env=launcher.child_env(), cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    sweep = json.loads(out.read_text())["sweep"]
    assert [r["concurrency"] for r in sweep] == [1, 2] and all(r["ok"] == 4 and 4 <= r["output_tokens"] <= 8 for r in sweep)
    assert all(r["latency_ms"]["p99"] >= r["latency_ms"]["p50"] > 0 for r in sweep)
    assert run.stdout.count("closed loop, concurrency") == 2
    import matplotlib.image

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and matplotlib.image.imread(str(png)).ndim == 3


def test_the_samplers_further_controls_over_the_wire(service, model):
    """ignore_eos, min_tokens, stop_token_ids, logit_bias (integer keys from Python), min_p and the presence /
    frequency penalties travel in a request and act as in process."""
    eos = model.eos_id
    with Client(service.frontend, timeout=60) as client:
        kept = client.generate(PROMPT, max_tokens=8, logit_bias={eos: 100.0}, ignore_eos=True)
        held = client.generate(PROMPT, max_tokens=8, logit_bias={eos: 100.0}, min_tokens=5)
        free = client.generate(PROMPT, max_tokens=12)
        cut = client.generate(PROMPT, max_tokens=12, stop_token_ids=[free.tokens[3]])
        shaped = client.generate(PROMPT, max_tokens=12, temperature=0.9, seed=3, min_p=0.1, presence_penalty=0.5,
                                 frequency_penalty=0.3)
    assert len(kept.tokens) == 8 and kept.stats["stop_reason"] == "max_tokens"
    assert len(held.tokens) == 5 and held.stats["stop_reason"] == "eos"
    assert cut.tokens == free.tokens[:free.tokens.index(free.tokens[3])]
    local = tinyloop.GenerateConfig(max_tokens=12, temperature=0.9, seed=3, min_p=0.1, presence_penalty=0.5,
                                    frequency_penalty=0.3)
    assert shaped.tokens == tinyloop.generate(model, PROMPT, local).tokens
