"""Shared fixtures: small randomly initialised artifacts (fast, any architecture) and the bundled model."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

# OpenMP threads that sleep while they wait instead of spinning, for this process and every process a test starts
# (they inherit the environment), set before torch loads libgomp. This 2-core machine is shared: a spinning thread
# is descheduled for whole time slices whenever another job runs (tinyloop/kernels/cpu.py, scripts/run.sh), and
# test_engine.py with test_scheduler.py measured 590 s spinning against 36 s passive at load 3-4. The runtime's
# results do not depend on it (it changes how idle threads wait, not what they compute).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

import tinyloop
from tinyloop.kernels.cpu import _cache_dir
from tinyloop.model import LoopedLM
from tinyloop.tokenizer import TextCodec, train_tokenizer

# Three architectures of the family: Huginn-style (the default below), Ouro-style, and the remaining options.
ARCHS = {
    "huginn": dict(),
    "ouro": dict(n_prelude=0, n_coda=0, injection="none", exit_gate=True),
    "add-normal-sandwich": dict(injection="add", state_init="normal", sandwich_norm=True, n_prelude=2, n_coda=2),
}


def direct(model, prompt, **config):
    """The runtime's own answer to a prompt, what a service reply must equal."""
    return tinyloop.generate(model, prompt, tinyloop.GenerateConfig(**config))


def ids(n: int, seed: int) -> list[int]:
    """n random token ids of the tiny vocabulary, reproducible by seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 320, (n,), generator=g).tolist()


TINY_TEXT = ["def add(a, b):\n    return a + b\n" * 40, "import os\nprint(os.getcwd())\n" * 30,
             "class Point:\n    x: int = 0\n    y: int = 0\n" * 30]


@pytest.fixture
def one_thread():
    """Tiny models are overhead-bound: one intra-op thread is faster and immune to a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_codec() -> TextCodec:
    return TextCodec(train_tokenizer(TINY_TEXT, 320))


@pytest.fixture(scope="session")
def make_artifact(tmp_path_factory, tiny_codec):
    """make_artifact(**config overrides) -> path of a random tiny .tinyloop (cached per config)."""
    made: dict = {}

    def make(**overrides) -> str:
        key = tuple(sorted(overrides.items()))
        if key not in made:
            base = dict(vocab_size=320, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, n_prelude=1, n_core=2,
                        n_coda=1, max_loops=16, default_loops=4, injection="adapter", state_init="zeros",
                        bos_id=tiny_codec.eos_id, eos_id=tiny_codec.eos_id)
            cfg = tinyloop.ModelConfig(**{**base, **overrides}).validate()
            torch.manual_seed(zlib.crc32(repr(key).encode()))  # same model for a config, whatever the test order
            net = LoopedLM(cfg, max_seq_len=8)
            path = str(tmp_path_factory.mktemp("art") / "tiny.tinyloop")
            tinyloop.save_artifact(path, net, tiny_codec)
            made[key] = path
        return made[key]

    return make


@pytest.fixture
def tiny_model(make_artifact):
    """A freshly loaded tiny model (fp16 cache, max_seq_len 256)."""
    model = tinyloop.load_model(make_artifact(), 256)
    yield model
    if not model.freed:
        tinyloop.free_model(model)


@pytest.fixture(scope="session")
def bundled_model():
    """The shipped default model, loaded once per test session (fp16 cache)."""
    return tinyloop.load_model(None, 1024, cache_mode="fp16")


REPO = Path(__file__).resolve().parent.parent


def fresh_interpreter(code: str) -> str:
    """The standard output of `code` run by a fresh interpreter in a clean environment: the repository on the path,
    none of this shell's settings, except this process's OMP_WAIT_POLICY (see above) and compiled-kernel cache (one
    of its own would compile the C kernels again, ~30 s)."""
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": "/tmp", "OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"],
           "TINYLOOP_CACHE_DIR": str(_cache_dir())}
    out = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="session")
def fresh_modules() -> dict[str, set[str]]:
    """The modules a fresh interpreter holds after each step: "generate" (the bundled model loaded and a generate
    call), then "quantised" (the model loaded again in int4 weights, and a generate call), then "grammar" (a request
    under a grammar). One interpreter for the import checks of test_layout.py and test_artifact.py: each costs
    seconds (torch's import, a model's load)."""
    code = """if True:
        import json, sys
        import tinyloop
        seen = {}
        model = tinyloop.load_model(None, 64)
        tinyloop.generate(model, "def f(x):", tinyloop.GenerateConfig(max_tokens=4))
        seen["generate"] = sorted(sys.modules)
        int4 = tinyloop.load_model(None, 64, weights="int4")
        tinyloop.generate(int4, "def f(x):", tinyloop.GenerateConfig(max_tokens=4))
        seen["quantised"] = sorted(sys.modules)
        tinyloop.generate(model, "x", tinyloop.GenerateConfig(max_tokens=4, grammar={"regex": "[0-9]+"}))
        seen["grammar"] = sorted(sys.modules)
        print(json.dumps(seen))
    """
    return {step: set(names) for step, names in json.loads(fresh_interpreter(code)).items()}
