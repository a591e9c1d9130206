"""What one iteration-level step costs (tinyloop/engine/iteration.py), against today's token-level decode step.

    python scripts/bench/depth_step.py [--lanes 16] [--loops 8] [--prompt 64] [--tokens 16] [--rounds 3]
        [--d-model D] [--threads N]

Side by side, in one process, alternating rounds, best of them:
  fixed    today's decode step (engine.forward.decode_rows): every lane one token at `loops` loops; its ms / loops is
           the cost of one core pass of all lanes (with a loops-th of the prelude and head)
  uniform  an iteration step of core passes only, every lane at the same loop index
  pass     the same at mixed loop indices (lane i at loop i % loops), no row starting or finishing
  aligned  the same token-level work in iteration steps, every lane at the same loop index: all rows start together
           and finish together (a fixed decode step cut into `loops` calls)
  stagger  the steady state of continuous-depth batching: lane i's tokens run `loops` passes offset by i, so each
           step some rows start a token and some finish one: the same work per token as `fixed`
The claim to check: pass and stagger cost what fixed / loops costs (the weights stream once per step, whatever the
rows' depths). --d-model builds a random model of that width (bundled shape otherwise) for the memory-bound regime.
"""
from __future__ import annotations

import argparse
from functools import partial

import torch

import tinyloop
from tinyloop.cache import KVCache
from tinyloop.config import ModelConfig
from tinyloop.engine import forward as paged
from tinyloop.engine.iteration import iterate
from tinyloop.model import LoopedLM

from scripts.bench.timing import timed


def model(d_model: int) -> LoopedLM:
    """The bundled model, or a random one of its shape at width d_model."""
    net = tinyloop.load_model().net
    if not d_model:
        return net
    cfg = ModelConfig(**{**net.cfg.__dict__, "d_model": d_model, "n_heads": d_model // 64, "n_kv_heads": d_model // 128,
                         "ffn_hidden": d_model * 8 // 3 // 16 * 16})
    return LoopedLM(cfg, 1024).eval().requires_grad_(False)


def lanes_at(net: LoopedLM, lanes: int, loops: int, prompt: int) -> tuple[KVCache, list[int]]:
    """A cache of `lanes` lanes, each holding a prompt of `prompt` tokens at `loops` loops, and its next positions."""
    cache = KVCache(net.cfg, lanes, prompt + 512, "fp16").reserve_all()
    gen = torch.Generator().manual_seed(0)
    for lane in range(lanes):
        ids = torch.randint(0, net.cfg.vocab_size, (1, prompt), generator=gen)
        paged.forward(net, ids, loops, net.make_step(torch.arange(prompt).unsqueeze(0)), cache.lane_view(lane))
    return cache, [prompt] * lanes


def fixed(net: LoopedLM, cache: KVCache, pos: list[int], loops: int, tokens: int) -> None:
    for _ in range(tokens):
        paged.decode_rows(net, [7] * len(pos), pos, loops, cache)
        pos[:] = [p + 1 for p in pos]


def iteration(net: LoopedLM, cache: KVCache, pos: list[int], loop: list[int], loops: int, steps: int,
              latent: paged.Latent, turn: bool) -> None:
    """`steps` iteration steps; turn: rows finishing at loops - 1 start their next token (else the loop indices
    just wrap, no row starting or finishing)."""
    B = len(pos)
    for _ in range(steps):
        tokens = [7 if turn and k == 0 else None for k in loop]
        finish = [turn and k == loops - 1 for k in loop]
        iterate(net, cache, pos, loop, tokens, finish, latent)
        for b in range(B):
            if loop[b] == loops - 1:
                pos[b] += 1 if turn else 0
            loop[b] = (loop[b] + 1) % loops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lanes", type=int, default=16)
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch's (and the C step's) threads; 0: as they are")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    net = model(a.d_model)  # (outside inference mode: the fused weights keep version counters)
    with torch.inference_mode():
        L, B = a.loops, a.lanes
        best = dict.fromkeys(("fixed", "uniform", "pass", "aligned", "stagger"), float("inf"))
        for _ in range(a.rounds):
            cache, pos = lanes_at(net, B, L, a.prompt)
            best["fixed"] = min(best["fixed"], timed(partial(fixed, net, cache, pos, L, a.tokens)) / a.tokens)
            for name, turn in (("uniform", False), ("pass", False), ("aligned", True), ("stagger", True)):
                cache, pos = lanes_at(net, B, L, a.prompt)
                latent = paged.Latent(torch.randn(B, 1, net.cfg.d_model), torch.randn(B, 1, net.cfg.d_model))
                loop = [0 if name in ("uniform", "aligned") else b % L for b in range(B)]
                steps = a.tokens * L
                best[name] = min(best[name], timed(partial(iteration, net, cache, pos, loop, L, steps, latent, turn))
                                 / steps)
    cfg = net.cfg
    print(f"model d_model={cfg.d_model} prelude/core/coda={cfg.n_prelude}/{cfg.n_core}/{cfg.n_coda}, {B} lanes, "
          f"{L} loops, prompts of {a.prompt} tokens, {a.tokens} tokens per lane, {torch.get_num_threads()} threads, "
          f"best of {a.rounds}")
    print(f"  fixed decode step        {best['fixed'] * 1e3:8.3f} ms   / {L} loops = {best['fixed'] / L * 1e3:.3f} ms "
          f"per core pass")
    for name, what in (("uniform", "iteration step, core pass only, one loop index"),
                       ("pass", "iteration step, core pass only, mixed loop indices"),
                       ("aligned", "iteration step, aligned starts and finishes"),
                       ("stagger", "iteration step, staggered starts and finishes")):
        print(f"  {what:50s} {best[name] * 1e3:8.3f} ms   ({best[name] / (best['fixed'] / L):.2f}x fixed / loops)")


if __name__ == "__main__":
    main()
