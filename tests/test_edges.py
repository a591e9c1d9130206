"""Clean errors at the edges (issue 17), each tried the way a user meets it: the CLI as a subprocess, the
runtime API in-process, the service through `tinyloop submit` against real broker and worker processes
with the bundled model, and `bash scripts/run.sh` itself (whose service log must also match the docs)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import tinyloop
from broker import launcher

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO), env=launcher.child_env())


# ---------------------------------------------------------------------------- tinyloop generate


@pytest.mark.parametrize("args,needle", [
    (["--loops", "99"], "--loops must be in [1, 16] (this model's max_loops), got 99"),
    (["--max-tokens", "60", "--max-seq-len", "64"], "exceeds --max-seq-len 64; raise --max-seq-len or lower --max-tokens"),
    (["--grammar", "[a-"], "invalid regex: Regex parsing error at position 4"),
    (["--speculative", "2:8"], "--speculative='2:8' must be draft:verify:ahead"),
])
def test_generate_validates_before_printing_anything(args, needle):
    out = cli("generate", "def add(a, b):" * 3, *args)
    assert out.returncode == 2 and needle in out.stderr, out.stderr
    assert out.stdout == "", "the prompt must not be printed before the request is known to be valid"
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr


def test_generate_max_seq_len_option_and_clean_streams():
    out = cli("generate", "import os", "--max-tokens", "6", "--max-seq-len", "64")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("import os") and out.stdout.endswith("\n") and "[" not in out.stdout
    assert "stop=max_tokens" in out.stderr and "6 tokens" in out.stderr


# (--speculative's acceptance-rate line: test_cli.py's speculative test, on the run it compares with greedy.)


def test_model_path_that_is_not_a_tinyloop_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is not a model\n")
    out = cli("generate", "x", "--model", str(text))
    assert out.returncode == 2 and out.stdout == ""
    assert "not a readable safetensors file" in out.stderr and "not a TinyLoop model" in out.stderr
    assert "expected a .tinyloop model file" in out.stderr and "header claims" not in out.stderr
    out = cli("generate", "x", "--model", str(tmp_path))
    assert out.returncode == 2 and "is a directory; expected a .tinyloop model file" in out.stderr


# ---------------------------------------------------------------------------- the runtime API


def test_load_model_device_and_dtype_errors_name_the_argument():
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(tinyloop.ConfigError, match=r"load_model\(device='cuda'\): CUDA is not available"):
            tinyloop.load_model(device="cuda")
    with pytest.raises(tinyloop.ConfigError, match=r"load_model\(device='tpu'\): not a device"):
        tinyloop.load_model(device="tpu")
    with pytest.raises(tinyloop.ConfigError, match=r"load_model\(dtype='bfloat16'\): expected a torch floating dtype"):
        tinyloop.load_model(dtype="bfloat16")
    with pytest.raises(tinyloop.ConfigError, match=r"load_model\(dtype=torch.int8\)"):
        tinyloop.load_model(dtype=torch.int8)


def test_free_model_twice_is_a_no_op():
    model = tinyloop.load_model(max_seq_len=32)
    tinyloop.free_model(model)
    tinyloop.free_model(model)
    with pytest.raises(tinyloop.HandleError):  # but using it still fails clearly
        tinyloop.generate(model, "x", tinyloop.GenerateConfig(max_tokens=1))


@pytest.mark.parametrize("grammar,needle", [
    ("[a-", "Unclosed '['"),
    ({"ebnf": "root ::= foo"}, 'Rule "foo" is not defined'),
    ({"type": "object", "properties": 5}, "properties must be an object"),
])
def test_grammar_errors_show_the_users_mistake_not_library_paths(grammar, needle):
    model = tinyloop.load_model(max_seq_len=32)
    with pytest.raises(tinyloop.ConfigError) as err:
        tinyloop.generate(model, "x", tinyloop.GenerateConfig(max_tokens=2, grammar=grammar))
    assert needle in str(err.value)
    assert not re.search(r"\.(cc|cpp|h):\d+|/project/|\[\d\d:\d\d:\d\d\]", str(err.value)), str(err.value)


# ---------------------------------------------------------------------------- tinyloop submit


@pytest.fixture(scope="module")
def service():
    with launcher.LocalService(1, ["--max-seq-len", "256", "--threads", "1"], heartbeat_interval=0.3) as svc:
        yield svc


def submit(service, *args: str) -> subprocess.CompletedProcess:
    return cli("submit", "--connect", service.frontend, *args, timeout=120)


def direct(prompt: str, **config) -> str:
    model = tinyloop.load_model(max_seq_len=256)
    try:
        return prompt + tinyloop.generate(model, prompt, tinyloop.GenerateConfig(**config)).text
    finally:
        tinyloop.free_model(model)


def test_submit_validates_before_printing_anything(service):
    for args, needle in [(["--loops", "99"], "--loops must be in [1, 16] (this model's max_loops), got 99"),
                         (["--max-tokens", "0"], "--max-tokens must be in [1, 65536], got 0"),
                         (["--max-tokens", "250"], "--max-seq-len"),
                         (["--grammar", "[a-"], "Unclosed '['")]:
        out = submit(service, "def add(a, b):", *args)
        assert out.returncode == 2 and needle in out.stderr, (args, out.stderr)  # bad input, as for generate
        assert out.stdout == "" and out.stderr.startswith("error: ") and "/project/" not in out.stderr


def test_submit_takes_every_generation_option(service):
    out = submit(service, "x = ", "--max-tokens", "12", "--grammar", "[0-9]{3}", "--beam-size", "2")
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"x = [0-9]{3}\n", out.stdout) and "stop=grammar_complete" in out.stderr
    for args, config in [(["--repetition-penalty", "1.3"], {"repetition_penalty": 1.3}),
                         (["--cache-window", "8"], {"cache_window": 8}),
                         (["--early-exit", "0.05"], {"early_exit_threshold": 0.05})]:
        out = submit(service, "def add(a, b):", "--max-tokens", "10", *args)
        assert out.returncode == 0, out.stderr
        assert out.stdout == direct("def add(a, b):", max_tokens=10, **config) + "\n", args
    out = submit(service, "import os", "--max-tokens", "12", "--speculative", "2:8:3")
    assert out.returncode == 0, out.stderr
    assert out.stdout == direct("import os", max_tokens=12) + "\n"  # greedy speculative = plain greedy
    assert re.search(r"speculative \d+/\d+ drafted tokens accepted \(\d+%\)", out.stderr), out.stderr
    bad = submit(service, "x", "--speculative", "2:x:3")
    assert bad.returncode == 2 and "draft:verify:ahead" in bad.stderr and bad.stdout == ""


# ---------------------------------------------------------------------------- scripts/run.sh and the docs


def documented_serve_lines() -> list[str]:
    text = (REPO / "docs" / "service.md").read_text()
    return [line[2:] for line in text.splitlines() if line.startswith("# tinyloop serve: ")]


def normalised(line: str) -> str:
    """Machine-dependent parts (endpoints, the RAM available right now, the plan: it counts the process baseline the
    worker measured) as placeholders."""
    line = re.sub(r"(tcp|ipc)://\S+?(?=[,\s\"]|$)", "<endpoint>", line)
    line = re.sub(r"memory plan: (\d+) x [0-9.]+ MiB", r"memory plan: \1 x <plan> MiB", line)
    return re.sub(r"fits in [0-9.]+ MiB", "fits in <available> MiB", line)


def test_run_sh_prints_the_answer_in_one_piece_and_matches_the_docs():
    tmp = Path(tempfile.mkdtemp(prefix="tlr-", dir="/tmp"))
    try:
        env = {**os.environ, "TINYLOOP_FRONTEND": f"ipc://{tmp}/f", "TINYLOOP_BACKEND": f"ipc://{tmp}/b",
               "TINYLOOP_LOG_DIR": str(tmp / "logs")}
        out = subprocess.run(["bash", "scripts/run.sh"], cwd=str(REPO), env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr
        # stdout: the question and a real model's readable answer (SmolLM2-135M-Instruct, which the set-up fetched),
        # then the bundled looped model on one prompt at 1 and 8 loops; nothing of the service's logs.
        if not (REPO / "data" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file():  # the set-up was offline: the bundled
            assert out.stdout.startswith("def fibonacci(n):") and "-- loops 8:" in out.stdout  # model answered
            return
        question = "What is a recurrent neural network? Answer in two sentences.\n"
        assert out.stdout.startswith(question), out.stdout
        answer = out.stdout[len(question):].split("\n")[0]
        assert "neural network" in answer and answer.endswith(".") and len(answer.split()) > 8, answer
        loops = out.stdout.index("-- loops 1:\ndef fibonacci(n):")
        assert loops < out.stdout.index("-- loops 8:\ndef fibonacci(n):")
        assert "tinyloop serve" not in out.stdout and " INFO " not in out.stdout
        # stderr: the stats line (loops 1: a dense model), then the service log as a block of its own.
        stats = out.stderr.index("[worker w")
        assert "stop=eos" in out.stderr[stats:].splitlines()[0]
        block = out.stderr.index("---- service log")
        assert stats < block
        serve_lines = [line for line in out.stderr[block:].splitlines() if line.startswith("tinyloop serve: ")]
        # docs/service.md shows exactly what serve prints (up to endpoints and free RAM).
        assert [normalised(line) for line in serve_lines] == [normalised(line) for line in documented_serve_lines()]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
