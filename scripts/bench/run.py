"""`tinyloop bench`: side-by-side measurements printed as ratios from one run.

Each section is a function (model, quick) -> list of printed lines, registered in SECTIONS. Sections that
other parts of the runtime add (batching, cache reuse, speculative, kernels) register here too. A section may
return a Report: its lines plus its measurements as data, which `--json` writes and `--plot` draws.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from scripts.bench.batch import bench_batch
from scripts.bench.core import bench_core
from scripts.bench.depth import bench_depth
from scripts.bench.detokenize import bench_detokenize
from scripts.bench.elastic import bench_elastic
from scripts.bench.gguf import bench_gguf
from scripts.bench.reuse import bench_cache_reuse, bench_prefix_cache, bench_warm_start
from tinyloop.cache import CACHE_MODES
from scripts.bench.engine import bench_engine
from scripts.bench.peers import Report, bench_peers
from tinyloop.generation import GenerateConfig, generate
from scripts.bench.kernels import bench_kernels
from scripts.bench.logprobs import bench_logprobs
from tinyloop.loader import Model, load_model
from scripts.bench.timing import timed
from scripts.bench.speculative import bench_speculative

PROMPT = "def fibonacci(n):\n    "


@torch.inference_mode()
def naive_decode(model: Model, prompt_ids: list[int], n_tokens: int, loops: int) -> list[int]:
    """Baseline without a KV cache: every new token recomputes the whole sequence at full depth."""
    ids = list(prompt_ids)
    for _ in range(n_tokens):
        logits = model.net(torch.tensor([ids], device=model.device), loops)
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def bench_decode(model_path: str | None, quick: bool) -> list[str]:
    """Batch-1 decode tokens/s per cache mode at loops 1, 4, 8 against the no-cache baseline."""
    n_tokens = 16 if quick else 64
    models = {mode: load_model(model_path, 1024, cache_mode=mode) for mode in CACHE_MODES}
    base = models["fp16"]
    ids = base.encode_prompt(PROMPT * 4)
    lines = [f"decode, batch 1, {n_tokens} tokens after a {len(ids)}-token prompt (tokens/s; ratio = cached / naive recompute)"]
    lines.append(f"  {'loops':>5} {'naive':>9} " + " ".join(f"{m:>9} {'ratio':>6}" for m in CACHE_MODES))
    for loops in (1, 4, 8):
        cfg = GenerateConfig(max_tokens=n_tokens, loops=loops, stop_sequences=())
        naive_s = timed(lambda: naive_decode(base, ids, n_tokens, loops))
        row = f"  {loops:>5} {n_tokens / naive_s:>9.1f} "
        for mode in CACHE_MODES:
            res = None

            def run():
                nonlocal res
                res = generate(models[mode], ids, cfg)
            s = timed(run, 2)
            tps = res.stats.generated_tokens / s
            row += f"{tps:>9.1f} {tps / (n_tokens / naive_s):>5.1f}x "
        lines.append(row)
    return lines


AGREEMENT_PROMPTS = [
    "def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
    "    for i in range(len(items)):\n", "def read_config(path):\n    with open(path) as f:\n",
    "    raise ValueError(", "# Copyright", "    return self._", "if __name__ == '__main__':\n",
    "def __repr__(self):\n        return ",
]


def bench_cache_agreement(model_path: str | None, quick: bool) -> list[str]:
    """Greedy agreement of int8 / int4 caches with fp16 over 64 tokens on 10 prompts (quality, not speed; --quick: 16
    tokens on 4 of them)."""
    n, prompts = (16, AGREEMENT_PROMPTS[:4]) if quick else (64, AGREEMENT_PROMPTS)
    models = {mode: load_model(model_path, 512, cache_mode=mode) for mode in CACHE_MODES}
    outs = {mode: [generate(m, p, GenerateConfig(max_tokens=n)).tokens for p in prompts]
            for mode, m in models.items()}
    lines = [f"greedy agreement with the fp16 cache, {len(prompts)} prompts x {n} tokens"]
    for mode in ("int8", "int4"):
        same = total = prefix = 0
        for ref, got in zip(outs["fp16"], outs[mode]):
            same += sum(a == b for a, b in zip(ref, got))
            total += max(len(ref), len(got))
            prefix += next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        lines.append(f"  {mode}: {same / total:6.1%} of positions equal, identical for the first "
                     f"{prefix / len(prompts):.1f} tokens on average")
    return lines


def bench_service(model_path: str | None, quick: bool) -> Report:
    """Batch-1 decode through a 1-worker service against the same generate in process, same threads, interleaved
    (the worker's own cost: its threads and I/O; issue 29's target is within 1.15x)."""
    from scripts.load.loadtest import decode_side_by_side

    lines = ["service decode at batch 1: a 1-worker service against generate in process (decode_ms medians)"]
    data = decode_side_by_side(model_path=model_path, reps=5 if quick else 12, max_tokens=32 if quick else 64,
                               echo=lines.append)
    return Report(lines, data)


SECTIONS: dict[str, Callable[[str | None, bool], list[str]]] = {
    "decode": bench_decode,
    "cache_agreement": bench_cache_agreement,
    "batch": bench_batch,
    "cache_reuse": bench_cache_reuse,
    "warm_start": bench_warm_start,
    "prefix_cache": bench_prefix_cache,
    "kernels": bench_kernels,
    "speculative": bench_speculative,
    "detokenize": bench_detokenize,
    "engine": bench_engine,
    "logprobs": bench_logprobs,
    "depth": bench_depth,
    "service": bench_service,
    "peers": bench_peers,
    "gguf": bench_gguf,
    "elastic": bench_elastic,
    "core": bench_core,
}
# minutes long (peers and gguf need the optional peers; elastic starts four services; core runs two trees): run
# only when asked for (--peers or --section)
OPT_IN = ("peers", "gguf", "elastic", "core")


def run_bench(model_path: str | None = None, sections: list[str] | None = None, quick: bool = False,
              echo: Callable[[str], None] = print) -> dict:
    """Run the sections, printing as they finish; returns every section's lines and data (for --json)."""
    torch.manual_seed(0)
    device = "CUDA" if torch.cuda.is_available() else "CPU"
    echo(f"tinyloop bench: torch {torch.__version__}, {torch.get_num_threads()} threads, {device}")
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "device": device, "quick": quick,
               "sections": {}}
    for name in sections or [s for s in SECTIONS if s not in OPT_IN]:
        echo(f"\n== {name} ==")
        out = SECTIONS[name](model_path, quick)
        for line in out:
            echo(line)
        results["sections"][name] = {"lines": list(out), "data": getattr(out, "data", {})}
    return results
