"""`tinyloop bench --peers`: TinyLoop's decode against the runtimes a user would pick instead, side by side in one
run, on the same random weights, and against the machine's measured memory bandwidth (docs/kernels.md, "Peers").

For each config (the looped models of issue 15, or a small one with --quick) it builds a looped model with random
weights and runs greedy decode at batch 1, 4, 16 and 64 (--quick: 1 and 16) through:
  * TinyLoop (`generate` at batch 1, `generate_batch` up to its 32 lanes, a Scheduler of 64 lanes at 64: a worker
    run with --max-lanes 64, whose decode steps' products take the tiled GEMM) in each weight format
    (tinyloop/formats.py), as load_model gives it (on the CPU int8 and int4 quantise activations), and int8 / int4
    weight-only beside them;
  * transformers' eager `generate` of the dense twin (scripts/bench/twin.py) in fp32 and bf16, when transformers is
    installed;
  * llama.cpp (llama-cpp-python) on the twin written as GGUF in F32, F16 and Q8_0, at batch 1, when
    llama-cpp-python and gguf are installed.
A peer that is not installed is named with the command that installs it. Every run is timed the same way: from
the first generated token to the last (decode only, prefill excluded), on wall clock, best of interleaved
rounds. Greedy tokens of each row are compared with TinyLoop's fp32 row at the same batch.

Against the matmul peak (issue 34): the bench measures the machine's fp32 and bf16 matmul rates (the best of a large
torch.mm and, for fp32, of TinyLoop's own tiled GEMM) and gives each row's multiply-add rate (2 flops per weight of
the step's matrices per token; attention and the elementwise work not counted) as a fraction of the fp32 peak, and
bf16 rows also of the bf16 peak. Decode at small batches is bound by memory, not by these.

Prefill (issue 34), in the same run on the same models: tok/s of a 40- and a 512-token prompt (a fresh random prompt
per round, so no prefix is reused): TinyLoop from the call to its first token (`generate_stream`, one token), with
the tiled many-row GEMM (cpu_gemv.c: tl_gemm) and without it (TINYLOOP_CPU_GEMM=0: the products past the lanes run
through torch, as before issue 34); transformers a forward of the prompt; llama.cpp `eval` of it after `reset`.
`python -m scripts.bench.peers --prefill [--quick] [--json out.json]` runs only this part.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tinyloop.artifact import DEFAULT_ARTIFACT, read_artifact, save_artifact
from tinyloop.batch import Scheduler, generate_batch
from tinyloop.engine.calls import BATCH_LANES
from tinyloop.config import ModelConfig
from tinyloop.generation import generate_stream
from tinyloop.formats import FORMATS, quantize
from tinyloop.model import LoopedLM
from tinyloop.loader import free_model, load_model
from scripts.bench.llama_peer import LlamaPeer, PeerCrashed
from scripts.bench.twin import GGUF_BYTES, GGUF_TYPES, head, hf_twin, matrix_numel, write_gguf

_COMMON = dict(injection="none", state_init="embed", tie_embeddings=True, bos_id=1, eos_id=2)
CONFIGS = {  # issue 15's configs: 2 + 4 x 4 + 2 layer passes per token
    "d768": ModelConfig(vocab_size=8192, d_model=768, n_heads=12, n_kv_heads=4, ffn_hidden=2048, n_prelude=2,
                        n_core=4, n_coda=2, max_loops=4, default_loops=4, **_COMMON),
    "d1024": ModelConfig(vocab_size=8192, d_model=1024, n_heads=16, n_kv_heads=8, ffn_hidden=2816, n_prelude=2,
                         n_core=4, n_coda=2, max_loops=4, default_loops=4, **_COMMON),
}
QUICK = {"d128": ModelConfig(vocab_size=4096, d_model=128, n_heads=4, n_kv_heads=2, ffn_hidden=352, n_prelude=1,
                             n_core=2, n_coda=1, max_loops=2, default_loops=2, **_COMMON)}
# bytes a step reads per weight in each format (int8: a per-row fp32 scale, negligible; int4: a scale per 32)
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 32}
# TinyLoop's rows: each format as load_model gives it (int8 / int4 with integer activations on the CPU), and int8 /
# int4 weight-only beside them (load_model(act_quant=False))
VARIANTS = {**{fmt: {"weights": fmt} for fmt in FORMATS},
            **{f"{fmt} weight-only": {"weights": fmt, "act_quant": False} for fmt in ("int8", "int4")}}
BATCHES = (1, 4, 16, 64)
QUICK_BATCHES = (1, 16)
PREFILL_LENS = (40, 512)
PREFILL_VARIANTS = ("fp32", "bf16", "int8", "int4")  # as load_model gives them; each with the tiles on and off
INSTALL = {
    "transformers": "pip install 'transformers==4.56.2'   (or: pip install -e '.[peers]')",
    "llama.cpp": "nice pip install llama-cpp-python gguf   (compiles llama.cpp from source, ~8 minutes; "
                 "use a venv of its own)",
    "gguf": "pip install gguf",
}


class Report(list):
    """A section's printed lines, with its measurements as `data` (JSON-serialisable) for --json and --plot."""

    def __init__(self, lines: list[str], data: dict):
        super().__init__(lines)
        self.data = data


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def matmul_peak(n: int = 1024, repeats: int = 5) -> dict[str, float]:
    """flop/s of the machine's fastest measured square products with torch's threads, best of `repeats`: fp32
    (torch.mm, and the tiled GEMM of tinyloop/kernels/cpu.py where it runs) and bf16 (torch.mm in bf16, and the tiled
    GEMM over bf16 weights), each the faster of the two; what "of peak" in the tables divides by. (Without the CPU's
    bf16 instructions torch's bf16 product can be far slower than fp32: 1.4 GFLOP/s against 66 on a 2-core Zen 1.)"""
    from tinyloop.kernels import cpu

    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)

    def rate(f) -> float:
        f()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t)
        return 2 * n ** 3 / best
    a16, b16 = a.bfloat16(), b.bfloat16()
    peak = {"fp32_torch": rate(lambda: torch.mm(a, b)), "bf16_torch": rate(lambda: torch.mm(a16, b16))}
    if cpu.gemm_available():
        bt = b.T.contiguous()  # cpu.linear multiplies by W^T: the same product
        bt16 = quantize(bt, "bf16")
        peak["fp32_tiled"] = rate(lambda: cpu.linear(a, bt, tiled=True))
        peak["bf16_tiled"] = rate(lambda: cpu.linear(a, bt16, tiled=True))
    for fmt in ("fp32", "bf16"):
        peak[fmt] = max(v for k, v in peak.items() if k.startswith(f"{fmt}_"))
    return peak


# Below this ratio of torch's bf16 to fp32 product rate, transformers' bf16 decode rows are left out: on a CPU without
# bf16 instructions they run ~100x slower than fp32 (0.9 against 87 GFLOP/s on a 2-core Zen 3), over an hour for
# the section. Its prefill rows (a few seconds each) stay.
SLOW_BF16 = 0.1


def memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of a streaming read: the best of `repeats` sums over an fp32 array of `nbytes` with torch's threads,
    by the CPU kernels' own read loop (tinyloop/kernels/cpu.py) where they build, else torch's sum. The array is
    written first, so its pages exist and the reads come from memory, not from the zero page."""
    from tinyloop.kernels import cpu

    if cpu.available():
        return cpu.stream_bandwidth(nbytes, repeats=repeats) * 1e9
    x = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


@torch.no_grad()
def randomize(net: LoopedLM, seed: int) -> None:
    """Random weights that make every layer matter: matrices N(0, 1/fan_in), embedding N(0, 1), norm weights
    around 1 (so a misplaced norm shows). The EOS row of the tied embedding is zero, so its logit is exactly 0
    and greedy decode never stops early: every runtime decodes the same number of tokens."""
    g = torch.Generator().manual_seed(seed)
    for name, p in net.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        elif name == "embed.weight":
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    net.embed.weight[net.cfg.eos_id] = 0
    if net.lm_head is not None:
        net.lm_head.weight[net.cfg.eos_id] = 0


def random_artifact(cfg: ModelConfig, path: Path, seed: int = 0) -> Path:
    """A .tinyloop file of `cfg` with random weights (fp32), carrying the bundled model's tokenizer (the bench
    feeds token ids), so TinyLoop loads it the way a user's model is loaded."""
    codec = read_artifact(DEFAULT_ARTIFACT)[0].codec
    net = LoopedLM(cfg, max_seq_len=2)
    randomize(net, seed)
    save_artifact(path, net, codec, dtype=torch.float32, provenance={"made_by": "tinyloop bench --peers (random)"})
    return path


# ----------------------------------------------------------------------------------------------- runners
# Each runner decodes greedily from the prompts and returns (tokens per lane, tokens decoded after the first step,
# seconds from the end of the first step to the last token).
Run = Callable[[], tuple[list[list[int]], int, float]]


def scheduled(model, prompts: list[list[int]], cfg, on_token) -> list:
    """Every prompt at once in a Scheduler with a lane for each (past generate_batch's 32 lanes: a worker's
    --max-lanes); results in prompt order."""
    sched = Scheduler(model, lanes=len(prompts))
    seqs = [sched.submit(p, cfg, lambda tok, i, lane=lane: on_token(lane, tok, i)) for lane, p in enumerate(prompts)]
    while not sched.idle():
        sched.step()
    return [seq.result() for seq in seqs]


def tinyloop_runner(model, prompts: list[list[int]], n: int, loops: int) -> Run:
    from tinyloop.request import GenerateConfig

    cfg = GenerateConfig(max_tokens=n, loops=loops, stop_sequences=())
    B = len(prompts)

    def run():
        stamps: list[tuple[int, float]] = []  # (lane, time) per token
        if B == 1:
            res = [generate_stream(model, prompts[0], cfg, lambda tok, i: stamps.append((0, time.perf_counter())) or True)]
        else:
            many = generate_batch if B <= BATCH_LANES else scheduled
            res = many(model, prompts, cfg, lambda lane, tok, i: stamps.append((lane, time.perf_counter())) or True)
        # Decode starts once every lane has its first token (the engine may prefill lanes one by one between
        # decode steps); every token after that moment is a decoded one.
        seen: set[int] = set()
        start = next(i for i, (lane, _) in enumerate(stamps) if seen.add(lane) or len(seen) == B)
        return [r.tokens for r in res], len(stamps) - 1 - start, stamps[-1][1] - stamps[start][1]
    return run


class _Stamps:
    """transformers' streamer interface: put() once with the prompt, then once per step; end() at the end."""

    def __init__(self):
        self.t: list[float] = []

    def put(self, value) -> None:
        self.t.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_runner(twin, prompts: list[list[int]], n: int) -> Run:
    ids = torch.tensor(prompts)

    @torch.inference_mode()
    def run():
        s = _Stamps()
        out = twin.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, streamer=s)
        return out[:, ids.shape[1]:].tolist(), len(prompts) * (len(s.t) - 2), s.t[-1] - s.t[1]
    return run


def llama_runner(llm: LlamaPeer, prompt: list[int], n: int) -> Run:
    def run():
        toks, stamps = llm.generate(prompt, n)  # (every request prefills the same prompt: no reuse)
        return [toks], n - 1, stamps[-1] - stamps[0]
    return run


# ----------------------------------------------------------------------------------------------- prefill
Prefill = Callable[[list[int]], float]  # seconds to prefill a prompt


def tinyloop_prefill(model, loops: int, tiles: bool) -> Prefill:
    """Seconds to the first token (the prompt's prefill and one head), with the tiled GEMM on or off."""
    from tinyloop.request import GenerateConfig

    cfg = GenerateConfig(max_tokens=1, loops=loops, stop_sequences=())

    def run(prompt: list[int]) -> float:
        old = os.environ.get("TINYLOOP_CPU_GEMM")
        os.environ["TINYLOOP_CPU_GEMM"] = "1" if tiles else "0"  # read on every product (kernels/cpu.py)
        try:
            t0 = time.perf_counter()
            generate_stream(model, prompt, cfg, lambda tok, i: True)
            return time.perf_counter() - t0
        finally:
            if old is None:
                os.environ.pop("TINYLOOP_CPU_GEMM")
            else:
                os.environ["TINYLOOP_CPU_GEMM"] = old
    return run


def hf_prefill(twin) -> Prefill:
    @torch.inference_mode()
    def run(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        twin(torch.tensor([prompt]), use_cache=True)
        return time.perf_counter() - t0
    return run


def llama_prefill(llm: LlamaPeer) -> Prefill:
    return llm.eval


def measured(runs: dict, key: tuple, crashed: dict, *args: object):
    """runs[key](*args), or None where the peer's process died (PeerCrashed): its row is dropped from runs and the
    reason kept in crashed."""
    try:
        return runs[key](*args)
    except PeerCrashed as e:
        crashed[" ".join(map(str, key[:2]))] = str(e)
        del runs[key]
        return None


def prefill_rows(name: str, runs: dict[tuple[str, str], Prefill], vocab: int, rounds: int,
                 progress: Callable[[str], None], crashed: dict) -> list[dict]:
    """tok/s of each prefill row at each prompt length, best of interleaved rounds, a fresh prompt per round."""
    g = torch.Generator().manual_seed(2)
    first = 3 + 256
    best: dict = {}
    for P in PREFILL_LENS:
        for r in range(rounds + 1):  # round 0 warms up
            prompt = torch.randint(first, vocab, (P,), generator=g).tolist()
            for key in list(runs):
                s = measured(runs, key, crashed, prompt)
                if s is not None and r:
                    best[key, P] = min(best.get((key, P), float("inf")), s)
        progress(f"  [{name}] prefill {P} tokens done")
    return [{"config": name, "system": sys_, "format": fmt, "prompt_len": P, "tok_s": P / s}
            for ((sys_, fmt), P), s in best.items()]


def prefill_table(rows: list[dict], peak: float | None = None) -> list[str]:
    """tok/s at each prompt length, and with `peak` (fp32 flop/s) the share of it the prompt's products ran at."""
    head_ = "".join(f"{f'{P} tok/s':>14}" + (f"{'of peak':>9}" if peak else "") for P in PREFILL_LENS)
    lines = [f"  {'runtime':<13}{'format':<22}" + head_]
    for key in dict.fromkeys((r["system"], r["format"]) for r in rows):
        got = {r["prompt_len"]: r for r in rows if (r["system"], r["format"]) == key}
        cells = ""
        for P in PREFILL_LENS:
            r = got.get(P)
            cells += f"{r['tok_s'] if r else float('nan'):>14.1f}"
            if peak:
                cells += f"{r['flop_s'] / peak if r else float('nan'):>9.0%}"
        lines.append(f"  {key[0]:<13}{key[1]:<22}" + cells)
    return lines


# the peer row each TinyLoop format is held against (issue 34: llama.cpp's same-precision format)
PREFILL_PEERS = {"fp32": ("llama.cpp F32", "transformers fp32"), "bf16": ("llama.cpp F16", "transformers bf16"),
                 "int8": ("llama.cpp Q8_0", "transformers fp32"), "int4": ("transformers fp32",)}


def prefill_ratios(rows: list[dict]) -> list[dict]:
    """Each TinyLoop format's prefill tok/s over its own run without the tiles, over fp32's (quantised prefill should
    be no slower), and over its peers' (where measured), at each prompt length of one config."""
    out = []
    tok = {(r["config"], f"{r['system']} {r['format']}", r["prompt_len"]): r["tok_s"] for r in rows}
    for (config, name, P), t in tok.items():
        if not name.startswith("tinyloop ") or name.endswith("(no tiles)"):
            continue
        fmt = name.split()[1]
        against = [f"{name} (no tiles)", "tinyloop fp32", *PREFILL_PEERS.get(fmt, ())]
        for other in against:
            if other != name and (config, other, P) in tok:
                out.append({"config": config, "prompt_len": P, "tinyloop": fmt, "against": other,
                            "ratio": t / tok[config, other, P]})
    return out


def prefill_ratio_lines(rat: list[dict]) -> list[str]:
    lines = []
    for key in dict.fromkeys((r["config"], r["tinyloop"]) for r in rat):
        got = [r for r in rat if (r["config"], r["tinyloop"]) == key]
        for other in dict.fromkeys(r["against"] for r in got):
            cells = {r["prompt_len"]: r["ratio"] for r in got if r["against"] == other}
            lines.append(f"  {key[0]:<7} {key[1]:<6} over {other:<24}" +
                         "".join(f"{f'{cells[P]:.2f}x' if P in cells else '-':>10}" for P in PREFILL_LENS))
    return lines


def prefill_runs(models: dict, loops: int, twin, twin_bf16, llamas: dict) -> dict[tuple[str, str], Prefill]:
    runs: dict[tuple[str, str], Prefill] = {}
    for fmt in PREFILL_VARIANTS:
        runs["tinyloop", fmt] = tinyloop_prefill(models[fmt], loops, tiles=True)
        runs["tinyloop", f"{fmt} (no tiles)"] = tinyloop_prefill(models[fmt], loops, tiles=False)
    if twin is not None:
        runs["transformers", "fp32"], runs["transformers", "bf16"] = hf_prefill(twin), hf_prefill(twin_bf16)
    for qtype, llm in llamas.items():
        runs["llama.cpp", qtype] = llama_prefill(llm)
    return runs


# ----------------------------------------------------------------------------------------------- one config
def agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    """Share of positions where two greedy outputs agree."""
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    return same / max(1, sum(max(len(r), len(g)) for r, g in zip(ref, got)))


def bench_config(name: str, cfg: ModelConfig, *, prompt_len: int, n_tokens: int, rounds: int, tmp: Path,
                 echo: Callable[[str], None], progress: Callable[[str], None], peak: dict[str, float],
                 decode_rounds: int | None = None, batches: tuple[int, ...] = BATCHES) -> tuple[list[dict], dict]:
    """Rows (one per runtime, format and batch) and facts about the config (weights read per step); peak is
    matmul_peak's (its torch rates decide whether transformers' bf16 decode rows run)."""
    loops = cfg.default_loops
    art = random_artifact(cfg, tmp / f"{name}.tinyloop")
    ctx = max(prompt_len + n_tokens, max(PREFILL_LENS)) + 16
    models = {label: load_model(art, ctx, **how) for label, how in VARIANTS.items()}
    model = models["fp32"]
    g = torch.Generator().manual_seed(1)
    first = 3 + 256  # past the control and byte tokens of the GGUF vocabulary (tokens a real prompt would hold)
    prompts = torch.randint(first, cfg.vocab_size, (max(batches), prompt_len), generator=g).tolist()
    numel = matrix_numel(model.net, loops)
    body = numel - head(model.net).numel()  # a prompt token's matrices: the head runs for the last token only
    runs: dict[tuple[str, str, int], Run] = {}
    for fmt, m in models.items():
        for B in batches:
            runs["tinyloop", fmt, B] = tinyloop_runner(m, prompts[:B], n_tokens, loops)
    progress(f"  [{name}] {model.net.num_params() / 1e6:.0f}M parameters loaded; setting up the peers")
    runs["tinyloop", "fp32", 1]()  # fuses the weights, so the twin below shares the tensors TinyLoop runs
    checks: dict = {}
    twin = twin_bf16 = None
    if installed("transformers"):
        twin = hf_twin(model.net, loops).requires_grad_(False)
        with torch.inference_mode():
            ids = torch.tensor(prompts[:2])
            diff = (twin(ids).logits - model.net(ids, loops)).abs().max().item()
        checks["transformers_max_logit_diff"] = diff
        import transformers

        checks["transformers_version"] = transformers.__version__
        echo(f"  [{name}] transformers {transformers.__version__} twin: max |logit difference| from TinyLoop's "
             f"forward on 2 prompts: {diff:.2e}")
        twin_bf16 = copy.deepcopy(twin).to(torch.bfloat16)  # a copy: the fp32 twin shares TinyLoop's tensors
        bf16_rate = peak["bf16_torch"] / peak["fp32_torch"]
        if bf16_rate < SLOW_BF16:
            checks["transformers_bf16_decode"] = (f"not measured: torch's bf16 product runs at {bf16_rate:.3f}x its "
                                                  "fp32 product on this CPU (no bf16 instructions)")
            echo(f"  [{name}] transformers bf16 decode rows {checks['transformers_bf16_decode']}")
        for B in batches:
            runs["transformers", "fp32", B] = hf_runner(twin, prompts[:B], n_tokens)
            if bf16_rate >= SLOW_BF16:
                runs["transformers", "bf16", B] = hf_runner(twin_bf16, prompts[:B], n_tokens)
    llamas, crashed = {}, {}
    if installed("llama_cpp") and installed("gguf"):
        for qtype in GGUF_TYPES:
            path = write_gguf(model.net, loops, tmp / f"{name}-{qtype}.gguf", qtype)
            try:
                llamas[qtype] = llm = LlamaPeer(path, ctx, torch.get_num_threads())
            except PeerCrashed as e:
                crashed[f"llama.cpp {qtype}"] = str(e)
                continue
            runs["llama.cpp", qtype, 1] = llama_runner(llm, prompts[0], n_tokens)
    prefill = prefill_rows(name, prefill_runs(models, loops, twin, twin_bf16, llamas), cfg.vocab_size, rounds,
                           progress, crashed)
    for qtype in GGUF_TYPES:  # a peer that died in its prefill rows has no decode row either
        if f"llama.cpp {qtype}" in crashed:
            runs.pop(("llama.cpp", qtype, 1), None)
    if decode_rounds == 0:
        runs = {}
    decode_rounds = rounds if decode_rounds is None else decode_rounds
    progress(f"  [{name}] warm-up, then {decode_rounds} rounds of {len(runs)} rows")
    for key in list(runs):  # warm-up: compiled kernels, allocator pools, llama.cpp's first-use work
        measured(runs, key, crashed)
    best: dict = {}
    tokens: dict = {}
    for r in range(decode_rounds):
        for key in list(runs):
            got = measured(runs, key, crashed)
            if got is None:
                best.pop(key, None)
                continue
            toks, decoded, seconds = got
            tokens[key] = toks
            best[key] = min(best.get(key, float("inf")), seconds / max(decoded, 1))
        progress(f"  [{name}] round {r + 1}/{rounds} done")
    rows = []
    for (system, fmt, B), s_per_tok in best.items():
        per_weight = GGUF_BYTES[fmt] if system == "llama.cpp" else BYTES_PER_WEIGHT[fmt.split()[0]]
        ref = tokens["tinyloop", "fp32", B]
        rows.append({"config": name, "system": system, "format": fmt, "batch": B, "tok_s": 1.0 / s_per_tok,
                     "weight_bytes_per_step": numel * per_weight, "flop_s": 2 * numel / s_per_tok,
                     "greedy_agreement": agreement(ref, tokens[system, fmt, B]),
                     "tokens": tokens[system, fmt, B]})
    for llm in llamas.values():
        llm.close()
    for m in models.values():
        free_model(m)
    for r in prefill:
        r["flop_s"] = 2 * body * r["tok_s"]
    facts = {"config": cfg.to_dict(), "loops": loops, "layer_passes": cfg.n_prelude + cfg.n_core * loops + cfg.n_coda,
             "weights_read_per_step": numel, "weights_per_prompt_token": body, "prompt_len": prompt_len,
             "new_tokens": n_tokens, "rounds": rounds,
             "prefill": prefill, "crashed_peers": crashed, **checks}
    return rows, facts


# ----------------------------------------------------------------------------------------------- the section
def peak_line(peak: dict[str, float], n: int, threads: int) -> str:
    def one(fmt: str) -> str:
        tiled = f", TinyLoop's tiled GEMM {peak[f'{fmt}_tiled'] / 1e9:.1f}" if f"{fmt}_tiled" in peak else ""
        return f"{fmt} {peak[fmt] / 1e9:.1f} GFLOP/s (torch.mm {peak[f'{fmt}_torch'] / 1e9:.1f}{tiled})"
    return f"matmul peak ({n}^3, {threads} threads, best of 5): {one('fp32')}, {one('bf16')}"


def of_peak(r: dict, peak: dict[str, float]) -> None:
    """The row's share of the fp32 matmul peak; bf16 rows also of the bf16 one."""
    r["peak_fraction"] = r["flop_s"] / peak["fp32"]
    if r["format"].startswith("bf16"):
        r["bf16_peak_fraction"] = r["flop_s"] / peak["bf16"]


def describe(name: str, f: dict) -> str:
    c = f["config"]
    return (f"{name}: {c['n_heads']} heads / {c['n_kv_heads']} kv, FFN {c['ffn_hidden']}, {c['n_prelude']} + "
            f"{c['n_core']} x {f['loops']} + {c['n_coda']} layer passes, vocab {c['vocab_size']}; "
            f"{f['weights_read_per_step'] / 1e6:.1f}M weights read per step; {f['prompt_len']}-token prompts, "
            f"{f['new_tokens']} new tokens, best of {f['rounds']} rounds")


def table(rows: list[dict], bandwidth: float) -> list[str]:
    lines = [f"  {'runtime':<13}{'format':<18}{'batch':>5}{'tok/s':>10}{'weights GB/s':>14}{'of bandwidth':>14}"
             f"{'GFLOP/s':>9}{'of fp32 peak':>14}{'of bf16 peak':>14}{'greedy = TinyLoop fp32':>26}"]
    for r in sorted(rows, key=lambda r: (r["batch"], r["system"] != "tinyloop")):
        bf16 = f"{r['bf16_peak_fraction']:>13.0%}" if "bf16_peak_fraction" in r else f"{'':>13}"
        lines.append(f"  {r['system']:<13}{r['format']:<18}{r['batch']:>5}{r['tok_s']:>10.1f}"
                     f"{r['weights_GBps']:>14.1f}{r['bandwidth_fraction']:>13.0%} {r['flop_s'] / 1e9:>9.1f}"
                     f"{r['peak_fraction']:>13.0%} {bf16} {r['greedy_agreement']:>25.0%}")
    return lines


def ratios(rows: list[dict]) -> list[dict]:
    """Each TinyLoop format against each peer row at the same config and batch."""
    out = []
    for t in (r for r in rows if r["system"] == "tinyloop"):
        for p in (r for r in rows if r["system"] != "tinyloop" and r["config"] == t["config"] and r["batch"] == t["batch"]):
            out.append({"config": t["config"], "batch": t["batch"], "tinyloop": t["format"],
                        "peer": f"{p['system']} {p['format']}", "ratio": t["tok_s"] / p["tok_s"]})
    return out


def bench_peers(model_path: str | None, quick: bool):
    """The section (its model_path is not used: the configs are the issue's, with random weights)."""

    lines: list[str] = []
    echo = lines.append

    def progress(text: str) -> None:  # the section's lines print when it ends; progress goes to stderr now
        print(text, file=sys.stderr, flush=True)
    threads = torch.get_num_threads()
    bandwidth = memory_bandwidth(1 << 28 if quick else 1 << 30, 3 if quick else 5)
    lines.append(f"memory bandwidth (a streaming read of {'256 MiB' if quick else '1 GiB'}, {threads} threads, "
                 f"best of {3 if quick else 5}): {bandwidth / 1e9:.1f} GB/s")
    peak = matmul_peak(512 if quick else 1024)
    lines.append(peak_line(peak, 512 if quick else 1024, threads))
    missing = []
    if not installed("transformers"):
        missing.append({"peer": "transformers", "install": INSTALL["transformers"]})
    if not installed("llama_cpp"):
        missing.append({"peer": "llama.cpp", "install": INSTALL["llama.cpp"]})
    elif not installed("gguf"):
        missing.append({"peer": "llama.cpp (needs gguf to write the twin)", "install": INSTALL["gguf"]})
    for m in missing:
        lines.append(f"peer {m['peer']}: NOT INSTALLED, not measured; install with: {m['install']}")
    rows, configs = [], {}
    with tempfile.TemporaryDirectory(prefix="tinyloop-peers-") as tmp:
        for name, cfg in (QUICK if quick else CONFIGS).items():
            got, facts = bench_config(name, cfg, prompt_len=8 if quick else 32, n_tokens=8 if quick else 32,
                                      rounds=1 if quick else 3, tmp=Path(tmp), echo=echo,
                                      progress=progress, peak=peak, batches=QUICK_BATCHES if quick else BATCHES)
            for r in got:
                steps_per_s = r["tok_s"] / r["batch"]  # a step reads the weights once for all its lanes
                r["weights_GBps"] = r["weight_bytes_per_step"] * steps_per_s / 1e9
                r["bandwidth_fraction"] = r["weight_bytes_per_step"] * steps_per_s / bandwidth
                of_peak(r, peak)
            for r in facts["prefill"]:
                of_peak(r, peak)
            rows += got
            configs[name] = facts
            lines.append("")
            lines.append(describe(name, facts))
            lines += [f"  peer {peer}: CRASHED, not measured: {why}" for peer, why in facts["crashed_peers"].items()]
            lines += table(got, bandwidth)
            lines.append(f"  prefill ({name}, best of {facts['rounds']} rounds, a fresh prompt per round; no tiles: "
                         "TINYLOOP_CPU_GEMM=0):")
            lines += prefill_table(facts["prefill"], peak["fp32"])
            prat = prefill_ratios(facts["prefill"])
            if prat:
                lines.append(f"  prefill ratios ({name}; tok/s over tok/s at {' and '.join(map(str, PREFILL_LENS))} "
                             "tokens):")
                lines += prefill_ratio_lines(prat)
            facts["prefill_ratios"] = prat
    rat = ratios(rows)
    if rat:
        lines.append("")
        lines.append("ratios, TinyLoop tok/s over the peer's (same config, same batch, same run):")
        peers = list(dict.fromkeys(r["peer"] for r in rat))
        lines.append(f"  {'config':<7} {'batch':>5}  {'TinyLoop':<17}" + "".join(f"{p:>20}" for p in peers))
        for key in dict.fromkeys((r["config"], r["batch"], r["tinyloop"]) for r in rat):
            got = {r["peer"]: r["ratio"] for r in rat if (r["config"], r["batch"], r["tinyloop"]) == key}
            lines.append(f"  {key[0]:<7} {key[1]:>5}  {key[2]:<17}" +
                         "".join(f"{got[p]:>19.2f}x" if p in got else f"{'-':>20}" for p in peers))
    lines.append("(weights GB/s: weights read per step x steps per second, a step reading each weight once for all "
                 "its lanes; KV-cache reads not counted. GFLOP/s: 2 flops per weight of the step's matrices per token; "
                 "attention not counted. Timings on a shared machine are noisy: compare rows of one run.)")
    data = {"threads": threads, "bandwidth_Bps": bandwidth, "matmul_peak_flop_s": peak, "configs": configs,
            "rows": rows, "ratios": rat, "missing_peers": missing}
    return Report(lines, data)


def main() -> None:
    """`python -m scripts.bench.peers --prefill [--quick] [--json PATH]`: the prefill rows only."""
    args = sys.argv[1:]
    if "--prefill" not in args:
        raise SystemExit("usage: python -m scripts.bench.peers --prefill [--quick] [--json PATH] "
                         "(the whole section: tinyloop bench --peers)")
    quick = "--quick" in args
    out: dict = {}
    peak = matmul_peak(512 if quick else 1024)
    print(peak_line(peak, 512 if quick else 1024, torch.get_num_threads()), flush=True)
    out["matmul_peak_flop_s"] = peak
    with tempfile.TemporaryDirectory(prefix="tinyloop-prefill-") as tmp:
        for name, cfg in (QUICK if quick else CONFIGS).items():
            _, facts = bench_config(name, cfg, prompt_len=8, n_tokens=8, rounds=1 if quick else 3, tmp=Path(tmp),
                                    echo=print, progress=lambda t: print(t, file=sys.stderr, flush=True),
                                    peak=peak, decode_rounds=0, batches=(1,))
            for r in facts["prefill"]:
                of_peak(r, peak)
            print(f"{name}: prefill tok/s, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f} "
                  "(no tiles: TINYLOOP_CPU_GEMM=0)")
            for peer, why in facts["crashed_peers"].items():
                print(f"  peer {peer}: CRASHED, not measured: {why}")
            print("\n".join(prefill_table(facts["prefill"], peak["fp32"])))
            rat = prefill_ratios(facts["prefill"])
            print("\n".join(prefill_ratio_lines(rat)), flush=True)
            out[name] = facts["prefill"]
            out[f"{name} ratios"] = rat
    if "--json" in args:
        Path(args[args.index("--json") + 1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
