"""`tinyloop bench kernels`: the decode step's thread policy and weight formats, side by side in one run.

  1. the model (bundled by default): greedy lockstep decode tokens/s at batch 1 and 16: fp32 weights with torch's
     thread setting, with one thread, and with the step's thread policy (what generate runs), and the model's
     matrices in bf16, int8 and int4 (tinyloop/formats.py); the tokens each gives, compared with fp32's
  2. a random ~100M-parameter config at batch 16: decode FLOP/s as a fraction of the machine's fp32 matmul
     peak, measured in the same run (fp32)
Variants run interleaved, round after round, and each keeps its best round: the machines are noisy.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

from tinyloop.cache import KVCache
from tinyloop.config import ModelConfig
from tinyloop.model import LoopedLM
from tinyloop.loader import load_model
from scripts.bench.timing import timed
from tinyloop.engine import forward as paged

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n"
BIG = ModelConfig(vocab_size=8192, d_model=768, n_heads=12, n_kv_heads=4, ffn_hidden=2048, n_prelude=2, n_core=12,
                  n_coda=2, max_loops=2, default_loops=2)


@contextmanager
def variant(threads: str | None, torch_n: int = 0):
    """The decode step with TINYLOOP_DECODE_THREADS (and torch's threads) set for the duration."""
    old = os.environ.get("TINYLOOP_DECODE_THREADS")
    before = torch.get_num_threads()
    if torch_n:
        torch.set_num_threads(torch_n)
    if threads is not None:
        os.environ["TINYLOOP_DECODE_THREADS"] = threads
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if threads is not None:
            if old is None:
                os.environ.pop("TINYLOOP_DECODE_THREADS")
            else:
                os.environ["TINYLOOP_DECODE_THREADS"] = old


@torch.inference_mode()
def prefill(net: LoopedLM, cache: KVCache, prompt: torch.Tensor, loops: int) -> torch.Tensor:
    """Fill the cache with `prompt` [B, T]; the last position's logits [B, 1, V]. Decode runs after it only
    write positions >= T, so one prefill serves every timed run."""
    B, T = prompt.shape
    cache.reset()
    cache.reserve_all()  # (the forwards take no block: a standalone cache holds every cell's before them)
    return paged.forward(net, prompt, loops, net.make_step(torch.arange(T, device=prompt.device).expand(B, T), T),
                          cache, last_only=True)


@torch.inference_mode()
def decode_run(net: LoopedLM, cache: KVCache, logits: torch.Tensor, T: int, n_tokens: int, loops: int
               ) -> tuple[float, list]:
    """n_tokens greedy lockstep steps after a prefill of T tokens; (seconds, tokens)."""
    B, dev = logits.shape[0], logits.device
    tokens = []
    t0 = time.perf_counter()
    for i in range(n_tokens):
        tok = logits.argmax(-1)
        tokens.append(tok)
        pos = torch.full((B, 1), T + i, device=dev)
        logits = paged.forward(net, tok, loops, net.make_step(pos, T + i + 1), cache)
    tokens = torch.cat(tokens, dim=1).tolist()  # the host sync a sampler makes anyway
    return time.perf_counter() - t0, tokens


def side_by_side(nets, caches, prompts, n_tokens, loops, variants, rounds) -> dict:
    """Best seconds per (variant, batch) over interleaved rounds, and the tokens each produced. variants:
    name -> (weight format, TINYLOOP_DECODE_THREADS, torch threads); nets and caches by format (and batch)."""
    best, toks = {}, {}
    first = {(f, B): prefill(net, caches[f, B], prompts[B], loops) for f, net in nets.items() for B in prompts}
    for _ in range(rounds):
        for B in prompts:
            for name, (fmt, *spec) in variants.items():
                with variant(*spec):
                    s, t = decode_run(nets[fmt], caches[fmt, B], first[fmt, B], prompts[B].shape[1], n_tokens, loops)
                best[name, B] = min(best.get((name, B), float("inf")), s)
                toks[name, B] = t
    return {"best": best, "tokens": toks}


@torch.inference_mode()
def arithmetic_floor(net: LoopedLM, B: int, loops: int, context: int, repeats: int = 3) -> float:
    """Seconds of one decode step's matmuls and attention kernels alone, back to back on the model's own
    weights in step order: what is left when every other operation (and Python) is gone."""
    import torch.nn.functional as F
    cfg = net.cfg
    blocks = list(net.prelude) + [b for _ in range(loops) for b in net.core] + list(net.coda)
    x, hid = torch.randn(B, 1, cfg.d_model), torch.randn(B, 1, cfg.ffn_hidden)
    q = torch.randn(B, cfg.n_heads, 1, cfg.head_dim)
    kv = torch.randn(B, cfg.n_kv_heads, context, cfg.head_dim)

    def run():
        for blk in blocks:
            a, m = blk.attn, blk.mlp
            for w in (a.wq, a.wk, a.wv, a.wo, m.w_gate, m.w_up):
                F.linear(x, w.weight)
            F.linear(hid, m.w_down.weight)
            F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        if net.adapter is not None:
            for _ in range(loops):
                F.linear(torch.cat((x, x), -1), net.adapter.weight)
        F.linear(x, net.embed.weight)
    run()  # warm up
    return timed(run, repeats)


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """Best fp32 GFLOP/s of one n x n x n matmul with torch's threads: the machine's measured peak."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up
    return 2 * n ** 3 / timed(lambda: a @ b, repeats) / 1e9


def flops_per_token(cfg: ModelConfig, loops: int, context: int) -> float:
    """Multiply-adds x 2 of one decoded token: projections, MLP, adapter, head, and attention over `context` keys."""
    d, kv, f = cfg.d_model, cfg.kv_dim, cfg.ffn_hidden
    block = d * (d + 2 * kv) + d * d + 3 * d * f + 2 * cfg.n_heads * cfg.head_dim * context
    blocks = cfg.n_prelude + cfg.n_core * loops + cfg.n_coda
    adapter = 2 * d * d * loops if cfg.injection == "adapter" else 0
    return 2.0 * (block * blocks + adapter + cfg.vocab_size * d)


def same_share(tokens: list, reference: list) -> float:
    """Share of lanes whose greedy tokens equal the reference's (quantised formats may drift: a share, not a flag)."""
    return sum(a == b for a, b in zip(tokens, reference)) / len(reference)


@contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def bench_kernels(model_path: str | None, quick: bool) -> list[str]:
    n_tokens, rounds = (8, 2) if quick else (32, 3)
    model = load_model(model_path, 512, device="cpu", cache_mode="fp16", weights="fp32")
    net, cfg, loops = model.net, model.cfg, model.cfg.default_loops
    ids = torch.tensor([model.encode_prompt(PROMPT)])
    prompts = {B: ids.expand(B, -1).contiguous() for B in (1, 16)}
    nets = {"fp32": net, **{f: load_model(model_path, 512, device="cpu", weights=f).net for f in ("bf16", "int8", "int4")}}
    caches = {(f, B): KVCache(cfg, B, 512, "fp16", dtype=model.dtype) for f in nets for B in prompts}
    # name: (weight format, TINYLOOP_DECODE_THREADS, torch threads (0: as set))
    variants = {"torch threads": ("fp32", "0"), "1 thread": ("fp32", "0", 1), "fp32": ("fp32", None),
                "bf16": ("bf16", None), "int8": ("int8", None), "int4": ("int4", None)}
    r = side_by_side(nets, caches, prompts, n_tokens, loops, variants, rounds)
    best, toks = r["best"], r["tokens"]
    n_threads = torch.get_num_threads()
    policy = {B: paged.decode_threads(B, cfg) or n_threads for B in prompts}
    threads = {"torch threads": n_threads, "1 thread": 1}
    lines = [f"decode on the model ({net.num_params() / 1e6:.1f}M params, {loops} loops, fp16 cache, CPU, torch threads "
             f"{n_threads}): {n_tokens} greedy tokens per lane after a {ids.shape[1]}-token prompt, best of {rounds} "
             f"interleaved rounds. fp32 = the model's weights with the step's thread policy (what generate runs); "
             f"torch threads / 1 thread = the same with those threads; bf16/int8/int4 = load_model(weights=...)",
             f"  {'batch':>5} {'variant':>18} {'threads':>7} {'tok/s':>8} {'vs torch threads':>16} {'vs 1 thread':>11}"
             f"  greedy tokens = fp32's"]
    for B in prompts:
        plain, one = B * n_tokens / best["torch threads", B], B * n_tokens / best["1 thread", B]
        for name in variants:
            rate = B * n_tokens / best[name, B]
            lines.append(f"  {B:>5} {name:>18} {threads.get(name, policy[B]):>7} {rate:>8.1f} {rate / plain:>15.2f}x "
                         f"{rate / one:>10.2f}x  {same_share(toks[name, B], toks['fp32', B]):.0%}")
    floors = {}
    for _ in range(rounds):
        for B in prompts:
            for t in {n_threads, policy[B], 1}:
                with torch_threads(t):
                    f = arithmetic_floor(net, B, loops, ids.shape[1] + n_tokens // 2, repeats=1)
                floors[t, B] = min(floors.get((t, B), float("inf")), f)
    lines.append("  where a step's time goes (ms per step; floor = the step's fp32 matmuls (torch) + attention kernels "
                 "alone, back to back, at the same threads):")
    for B in prompts:
        for name in ("torch threads", "1 thread", "fp32"):
            step, floor = best[name, B] / n_tokens, floors[threads.get(name, policy[B]), B]
            lines.append(f"  {B:>5} {name:>18}: step {step * 1e3:7.2f}, floor {floor * 1e3:6.2f}, "
                         f"everything else {max(0.0, step - floor) * 1e3:6.2f} ({max(0.0, 1 - floor / step):4.0%})")

    torch.manual_seed(0)
    big = LoopedLM(BIG, 256).eval().requires_grad_(False)
    B, n_big, loops_big = 16, (4 if quick else 8), BIG.default_loops
    prompt = torch.randint(0, BIG.vocab_size, (B, 16))
    cache = KVCache(BIG, B, 256, "fp16")
    first = prefill(big, cache, prompt, loops_big)
    fpt = flops_per_token(BIG, loops_big, 16 + n_big // 2)
    lines.append(f"random {big.num_params() / 1e6:.0f}M config (d {BIG.d_model}, {BIG.n_prelude}+{BIG.n_core}x{loops_big}+"
                 f"{BIG.n_coda} blocks, {fpt / 1e9:.2f} GFLOP/token), batch {B}, {n_big} tokens: decode FLOP/s against the "
                 f"fp32 matmul peak (MKL, 2048^3) at the same threads, same run, best of {rounds}")
    big_variants = {"fp32": ("0",)}
    for t in sorted({n_threads, 1}, reverse=True):
        big_best, big_toks, peak = {}, {}, 0.0
        with torch_threads(t):
            for _ in range(rounds):
                peak = max(peak, matmul_peak(repeats=2))
                for name, spec in big_variants.items():
                    with variant(*spec):
                        s, big_toks[name] = decode_run(big, cache, first, 16, n_big, loops_big)
                    big_best[name] = min(big_best.get(name, float("inf")), s)
        for name in big_variants:
            rate = B * n_big / big_best[name]
            lines.append(f"  {t} thread(s), peak {peak:6.1f} GFLOP/s, {name:>11}: {rate:7.1f} tok/s = "
                         f"{rate * fpt / 1e9:6.1f} GFLOP/s = {rate * fpt / 1e9 / peak:5.1%} of peak")
    return lines
