"""`tinyloop bench --section gguf`: TinyLoop and llama.cpp on the same GGUF file, side by side in one run.

The file is `--model` when it is a GGUF file, else SmolLM2-135M-Instruct (data/, fetched by the set-up script). Both
runtimes get the same token ids and torch's thread count; llama.cpp runs in a process of its own
(scripts/bench/llama_peer.py; TINYLOOP_LLAMA_PYTHON names an interpreter that has llama-cpp-python).

- parity: 8 chat prompts, 64 greedy tokens each: prompts tokenized alike (TinyLoop's tokenizer against llama.cpp's),
  continuations identical, and the largest |logit difference| at the positions that choose the 64 tokens (both
  given the prompt and llama.cpp's continuation, so a first differing token does not change what is compared).
- speed: batch-1 greedy decode (tokens after the first / the time from the first to the last) and a 128-token
  prefill (the prompt's forward and the first token's logits), best of interleaved rounds. TinyLoop runs the file's
  values in fp32 (its default for Q4_1, which no TinyLoop format holds exactly; docs/gguf.md) and in int4 (quantised
  again from those values); llama.cpp runs the file as it is.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from scripts.bench.llama_peer import LlamaPeer, PeerCrashed, llama_installed

REPO = Path(__file__).resolve().parents[2]
DEFAULT_GGUF = REPO / "data" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["What is a recurrent neural network? Answer in two sentences.", "Write a haiku about the sea.",
           "What is the capital of France?", "Explain photosynthesis to a child.",
           "Write a Python function that reverses a string.", "Give me three tips for a good night's sleep.",
           "What is 12 times 7?", "Translate 'good morning' into Spanish and German."]
N_TOKENS = 64
PREFILL_TOKENS = 128


def chat_ids(model, question: str) -> tuple[str, list[int]]:
    from tinyloop.chat import chat_prompt

    return chat_prompt(model, [{"role": "user", "content": question}])


def full_logits(model, ids: list[int]) -> np.ndarray:
    """TinyLoop's logits at every position of ids (one forward without a cache), fp32 [T, vocab]."""
    with torch.inference_mode():
        return model.net(torch.tensor([ids]), 1)[0].float().numpy()


def parity(model, path, threads: int, n: int = N_TOKENS, prompts: list[str] = PROMPTS) -> dict:
    """Greedy continuations and logits of TinyLoop's model and llama.cpp on the same file (module doc)."""
    import tinyloop

    rows = []
    cfg = tinyloop.GenerateConfig(max_tokens=n, temperature=0.0, ignore_eos=True)
    llm = LlamaPeer(path, 1024, threads, logits=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for q in prompts:
                text, ids = chat_ids(model, q)
                theirs, _ = llm.generate(ids, n)
                ours = tinyloop.generate(model, ids, cfg).tokens
                seq = ids + theirs
                llm.logits(seq, Path(tmp) / "l.npy")
                a, b = np.load(Path(tmp) / "l.npy"), full_logits(model, seq)
                chosen = slice(len(ids) - 1, len(seq) - 1)  # the positions whose logits pick the n tokens
                diff = np.abs(a[chosen] - b[chosen])
                first = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), None)
                rows.append({"prompt": q, "prompt_tokens": len(ids), "same_prompt_tokens": llm.tokenize(text) == ids,
                             "identical": ours == theirs, "first_difference": first,
                             "max_logit_diff": float(diff.max()), "logit_range": float(np.abs(a[chosen]).max()),
                             "text": model.codec.decode(ours)})
    finally:
        llm.close()
    return {"rows": rows, "identical": sum(r["identical"] for r in rows), "prompts": len(rows),
            "max_logit_diff": max(r["max_logit_diff"] for r in rows),
            "same_prompt_tokens": sum(r["same_prompt_tokens"] for r in rows)}


def speed(path, threads: int, rounds: int, n: int = N_TOKENS) -> dict:
    """Decode and prefill tok/s of TinyLoop (fp32 and int4) and llama.cpp, interleaved rounds, best kept."""
    import tinyloop

    models = {f"TinyLoop {fmt}": tinyloop.load_model(str(path), 1024, weights=fmt) for fmt in ("fp32", "int4")}
    some = next(iter(models.values()))
    _, prompt = chat_ids(some, PROMPTS[0])
    g = torch.Generator().manual_seed(0)
    long = torch.randint(100, some.cfg.vocab_size, (PREFILL_TOKENS,), generator=g).tolist()
    cfg = tinyloop.GenerateConfig(max_tokens=n, temperature=0.0, ignore_eos=True)
    first = tinyloop.GenerateConfig(max_tokens=1, temperature=0.0, ignore_eos=True)

    def tinyloop_decode(model):
        stamps: list[float] = []
        tinyloop.generate_stream(model, prompt, cfg, lambda tok, i: stamps.append(time.perf_counter()) or True)
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def tinyloop_prefill(model):
        t0 = time.perf_counter()
        tinyloop.generate(model, long, first)
        return PREFILL_TOKENS / (time.perf_counter() - t0)

    llm = LlamaPeer(path, 1024, threads)
    runs = {name: (lambda m=m: tinyloop_decode(m), lambda m=m: tinyloop_prefill(m)) for name, m in models.items()}

    def llama_decode():
        _, stamps = llm.generate(prompt, n)
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    runs["llama.cpp"] = (llama_decode, lambda: PREFILL_TOKENS / llm.eval(long))
    best = {name: [0.0, 0.0] for name in runs}
    try:
        for r in range(rounds + 1):  # round 0 warms up
            for name, (decode, prefill) in runs.items():
                d, p = decode(), prefill()
                if r:
                    best[name] = [max(best[name][0], d), max(best[name][1], p)]
    finally:
        llm.close()
    return {"decode": {k: v[0] for k, v in best.items()}, "prefill": {k: v[1] for k, v in best.items()},
            "threads": threads, "tokens": n, "prefill_tokens": PREFILL_TOKENS}


def gguf_lines(par: dict, spd: dict, path, load_s: float, rss: float) -> list[str]:
    lines = [f"file: {path} (loaded by TinyLoop in {load_s:.1f} s, fp32 values; process RSS {rss:.0f} MiB)",
             f"parity over {par['prompts']} chat prompts x {N_TOKENS} greedy tokens: identical {par['identical']}/"
             f"{par['prompts']}, prompts tokenized alike {par['same_prompt_tokens']}/{par['prompts']}, "
             f"max |logit difference| {par['max_logit_diff']:.4f} (logits up to "
             f"{max(r['logit_range'] for r in par['rows']):.1f})"]
    for r in par["rows"]:
        lines.append(f"  {r['prompt'][:48]:<48} {'identical' if r['identical'] else 'differs at ' + str(r['first_difference']):<14}"
                     f" max diff {r['max_logit_diff']:.4f}")
    base = spd["decode"]["llama.cpp"], spd["prefill"]["llama.cpp"]
    lines.append(f"speed, batch 1, {spd['threads']} threads (tok/s; ratio to llama.cpp on the same file):")
    lines.append(f"  {'runtime':<16} {'decode':>9} {'ratio':>7} {'prefill ' + str(spd['prefill_tokens']):>12} {'ratio':>7}")
    for name in spd["decode"]:
        d, p = spd["decode"][name], spd["prefill"][name]
        lines.append(f"  {name:<16} {d:>9.1f} {d / base[0]:>6.2f}x {p:>12.1f} {p / base[1]:>6.2f}x")
    return lines


class Report(list):
    """The section's printed lines, with its measurements as data (--json)."""

    def __init__(self, lines: list[str], data: dict):
        super().__init__(lines)
        self.data = data


def bench_gguf(model_path: str | None, quick: bool) -> list[str]:
    import resource

    import tinyloop
    from tinyloop.gguf import is_gguf

    path = Path(model_path) if model_path and is_gguf(model_path) else DEFAULT_GGUF
    if not path.is_file():
        return [f"NO GGUF FILE: {path} is absent (bash scripts/get_smollm2.sh fetches it)"]
    if not llama_installed():
        return ["llama.cpp: NOT INSTALLED (nice pip install llama-cpp-python in a venv of its own, then "
                "TINYLOOP_LLAMA_PYTHON=/that/venv/bin/python; docs/kernels.md, Peers)"]
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    model = tinyloop.load_model(str(path), 1024)
    load_s = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:
        par = parity(model, path, threads, prompts=PROMPTS[:2] if quick else PROMPTS)
        spd = speed(path, threads, 1 if quick else 3, 16 if quick else N_TOKENS)
    except PeerCrashed as e:
        return [f"llama.cpp: CRASHED ({e})"]
    return Report(gguf_lines(par, spd, path, load_s, rss),
                  {"parity": par, "speed": spd, "load_s": load_s, "rss_mib": rss, "path": str(path)})
