"""llama.cpp as a peer of `tinyloop bench --peers`, in a process of its own.

Inside the bench's process (torch, its OpenMP threads and TinyLoop's kernels loaded) llama-cpp-python 0.3.36
segfaulted in `llama_decode` on a Sapphire Rapids machine, taking the whole bench with it; alone in a process its
F32 and F16 models ran (docs/kernels.md, session 20). So each GGUF model is served by a child process
(`python -m scripts.bench.llama_peer GGUF N_CTX THREADS`) over a pipe, one JSON line per request and per answer, and
a child that dies fails only that peer's row (`PeerCrashed`), which the bench reports as crashed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class PeerCrashed(RuntimeError):
    """The peer's process died or answered with an error; the bench drops its row and says why."""


class LlamaPeer:
    """One GGUF model in a llama.cpp child process: `eval` a prompt (seconds), `generate` greedily (tokens, stamps)."""

    def __init__(self, path: str | Path, n_ctx: int, threads: int, python: str | None = None, logits: bool = False):
        """python: the interpreter that has llama-cpp-python (default: this one, or TINYLOOP_LLAMA_PYTHON: a venv of
        its own, docs/kernels.md). logits: keep every position's logits (the `logits` op)."""
        python = python or llama_python()
        self.proc = subprocess.Popen([python, "-m", "scripts.bench.llama_peer", str(path), str(n_ctx),
                                      str(threads), "1" if logits else "0"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     cwd=str(Path(__file__).resolve().parents[2]))
        self.ask(None)  # its first line: loaded, or why not

    def ask(self, request: dict | None) -> dict:
        try:
            if request is not None:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            code = self.proc.wait()
            why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
            raise PeerCrashed(f"llama.cpp's process died ({why})")
        answer = json.loads(line)
        if "error" in answer:
            raise PeerCrashed(answer["error"])
        return answer

    def eval(self, prompt: list[int]) -> float:
        return self.ask({"op": "eval", "prompt": prompt})["s"]

    def generate(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        got = self.ask({"op": "generate", "prompt": prompt, "n": n})
        return got["tokens"], got["stamps"]

    def logits(self, tokens: list[int], path: str | Path) -> None:
        """Every position's logits of `tokens` (one forward from an empty cache), saved as a .npy [T, vocab] at path."""
        self.ask({"op": "logits", "prompt": tokens, "path": str(path)})

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's tokens of text, special tokens parsed, no BOS added."""
        return self.ask({"op": "tokenize", "text": text})["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def llama_python() -> str:
    """The interpreter that runs llama.cpp: TINYLOOP_LLAMA_PYTHON, else this one."""
    return os.environ.get("TINYLOOP_LLAMA_PYTHON") or sys.executable


def llama_installed() -> bool:
    """Whether llama_python() can import llama_cpp (asked in a child: it may be another venv's interpreter)."""
    try:
        return subprocess.run([llama_python(), "-c", "import llama_cpp"], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def serve(path: str, n_ctx: int, threads: int, logits_all: bool = False) -> None:
    """The child: load the model, then answer requests until stdin closes."""
    out = os.fdopen(os.dup(1), "w")  # the answers' pipe; llama.cpp's own prints go to stderr
    os.dup2(2, 1)

    def say(answer: dict) -> None:
        out.write(json.dumps(answer) + "\n")
        out.flush()
    try:
        from llama_cpp import Llama

        llm = Llama(path, n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False,
                    logits_all=logits_all)
    except Exception as e:  # noqa: BLE001 - any reason is the peer's, reported to the bench
        say({"error": f"llama.cpp could not load {path}: {type(e).__name__}: {e}"})
        return
    say({"ok": True})
    for line in sys.stdin:
        req = json.loads(line)
        llm.reset()  # no reuse of the last request's cache: every request prefills its prompt
        if req["op"] == "eval":
            t0 = time.perf_counter()
            llm.eval(req["prompt"])
            say({"s": time.perf_counter() - t0})
            continue
        if req["op"] == "logits":
            import numpy as np

            llm.eval(req["prompt"])
            np.save(req["path"], np.asarray(llm.scores[:len(req["prompt"])], dtype=np.float32))
            say({"ok": True})
            continue
        if req["op"] == "tokenize":
            say({"tokens": [int(t) for t in llm.tokenize(req["text"].encode(), add_bos=False, special=True)]})
            continue
        tokens, stamps = [], []
        for tok in llm.generate(req["prompt"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                reset=True):
            stamps.append(time.perf_counter())
            tokens.append(int(tok))
            if len(tokens) == req["n"]:
                break
        say({"tokens": tokens, "stamps": stamps})
    llm.close()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), len(sys.argv) > 4 and sys.argv[4] == "1")
