"""One iteration-level step: rows at different (position, loop) points in one forward (continuous-depth batching).

The unit a step schedules is a loop iteration, not a token (docs/engine.md, issue 31). Row b of a step is one lane
at one position, at its own loop index k_b; the step runs, for every row, the next piece of its token's path:

    token given  the embedding, the prelude (into e) and the initial state: the row starts a token (k_b = 0)
    always       one pass of the shared core at loop k_b, writing and attending KV slots core_slot(k_b, j) of its lane
    finish       the coda, final norm and head: the row's token exits after this pass (logits for those rows only)

so a token at L loops takes L steps (start and finish ride on its first and last pass), and a lane whose token
exits samples and starts its next token at the next step while deeper lanes keep looping. Every row shares each
product of the core pass: the weights stream once per step, whatever the rows' depths.

Backends: on the CPU, where `cpu_block.supported` and the C step fits the model, one C call
(kernels/cpu_block.py: DecodeStep.iterate), whose rows have the bits of the same tokens decoded alone. Otherwise the
model's pieces (model.encode / init_state / loop / decode_head) over the cached context (engine/forward.py:
Cached): the starting rows' prelude in one context, the core pass of all rows through one product per matrix with
rotation and attention per group of rows at one loop index (`_Mixed`), the finishing rows' head in one context.
"""
from __future__ import annotations

import torch

from ..cache import KVCache
from ..kernels import cpu_block
from ..model import LoopedLM
from .forward import Cached, Latent, c_step, torch_threads, context, decode_threads


def iterate(net: LoopedLM, cache: KVCache, positions: list[int], loop: list[int], tokens: list[int | None],
            finish: list[bool], latent: Latent, lanes: list[int] | None = None,
            looping: list[int] | None = None) -> torch.Tensor:
    """One iteration-level step over rows b = 0..B-1: row b is lane lanes[b] of `cache` (default lane b; one row per
    lane) at position positions[b], running one core pass at loop index loop[b] (0-based), preceded by its token's
    embedding, prelude and initial state when tokens[b] is not None (then loop[b] must be 0), followed by the coda,
    final norm and head when finish[b]. latent: the rows' e and s ([B, 1, d] each, Latent.empty(B, 1, net)), read
    and written in place: s[b] holds the state after loop[b] + 1 loops. looping: every row's token, for a model whose
    layers read it at every loop (value embeddings; the torch path). Returns the finishing rows' logits
    [n finishing, V], in row order."""
    B, cfg = len(positions), net.cfg
    lanes = list(range(B)) if lanes is None else list(lanes)
    _check(cfg, cache, positions, loop, tokens, finish, latent, lanes)
    if cache.device.type == "cpu" and cpu_block.supported(cfg, cache, B, net.embed.weight.dtype):
        plan = c_step(net, cache)
        if plan is not None:
            with torch_threads(decode_threads(B, cfg, c_blocks=True)):
                return plan.iterate(cache, positions, loop, tokens, finish, latent.e, latent.s, lanes=lanes)
    with torch_threads(decode_threads(B, cfg, c_blocks=False) if cache.device.type == "cpu" else 0):
        return _torch(net, cache, positions, loop, tokens, finish, latent, lanes, looping)


def _check(cfg, cache: KVCache, positions: list[int], loop: list[int], tokens: list[int | None], finish: list[bool],
           latent: Latent, lanes: list[int]) -> None:
    """The step's rows, checked once at the edge (both backends)."""
    B = len(positions)
    if not B or not len(loop) == len(tokens) == len(finish) == len(lanes) == B:
        raise ValueError(f"an iteration step takes one or more rows with a position, loop index, token (or None), "
                         f"finish flag and lane each; got {B} positions, {len(loop)} loop indices, {len(tokens)} "
                         f"tokens, {len(finish)} finish flags, {len(lanes)} lanes")
    if len(set(lanes)) != B or min(lanes) < 0 or max(lanes) >= cache.lanes:
        raise ValueError(f"lanes {lanes}: one row per lane, each of 0..{cache.lanes - 1}")
    for b, (k, token) in enumerate(zip(loop, tokens)):
        if not 0 <= k < cfg.max_loops:
            raise ValueError(f"row {b}: loop index {k} is outside 0..{cfg.max_loops - 1}")
        if token is not None and k:
            raise ValueError(f"row {b} starts a token at loop index {k}: a token starts at loop 0")
    for name, t in (("e", latent.e), ("s", latent.s)):
        if t.shape[0] != B or t.numel() != B * cfg.d_model:
            raise ValueError(f"latent.{name} must hold {B} rows of {cfg.d_model}, got {list(t.shape)}")


def _torch(net: LoopedLM, cache: KVCache, positions: list[int], loop: list[int], tokens: list[int | None],
           finish: list[bool], latent: Latent, lanes: list[int], looping: list[int] | None) -> torch.Tensor:
    """The step through the model's pieces. Each context runs over a selection of the cache's lanes, created after
    the previous one committed its block tables (a selection copies them)."""
    B, dev = len(positions), cache.device
    if net.cfg.value_embeds and looping is None:
        raise ValueError("this model's layers read every row's token at every loop (value embeddings): pass `looping`")
    ids = None if looping is None else torch.tensor(looping, device=dev)

    def rows(chosen: list[int]) -> Cached:
        ctx = _rows(net, cache, positions, lanes, chosen)
        ctx.ids = None if ids is None else ids[chosen]
        return ctx

    e, s = latent.e.view(B, 1, -1), latent.s.view(B, 1, -1)
    starts = [b for b in range(B) if tokens[b] is not None]
    if starts:
        ctx = rows(starts)
        x = net.encode(torch.tensor([[tokens[b]] for b in starts], device=dev), ctx)
        e[starts] = x
        s[starts] = net.init_state(x, ctx.step)
        ctx.commit()
    groups: dict[int, list[int]] = {}
    for b, k in enumerate(loop):
        groups.setdefault(k, []).append(b)
    ctxs = {k: rows(group) for k, group in groups.items()}
    if len(groups) == 1:  # every row at one loop: the plain pass
        (k, ctx), = ctxs.items()
        s.copy_(net.run_loops(s, e, ctx, k, k + 1))
    elif all(ctx.native is None for ctx in ctxs.values()):
        index = [(torch.tensor(groups[k], device=dev), k, ctx) for k, ctx in ctxs.items()]
        s.copy_(net.run_loops(s, e, _Mixed(net, B, index, ids), 0, 1))
    else:  # C blocks run a group's whole pass themselves (a model the C step does not fit): one pass per group
        for k, ctx in ctxs.items():
            s[groups[k]] = net.run_loops(s[groups[k]], e[groups[k]], ctx, k, k + 1)
    for ctx in ctxs.values():
        ctx.commit()
    ends = [b for b in range(B) if finish[b]]
    if not ends:
        return torch.empty(0, net.cfg.vocab_size, device=dev, dtype=latent.s.dtype)
    ctx = rows(ends)
    logits = net.decode_head(s[ends], ctx)[:, 0]
    ctx.commit()
    return logits


def _rows(net: LoopedLM, cache: KVCache, positions: list[int], lanes: list[int], rows: list[int]) -> Cached:
    """The cached context of some rows of the step (one token each), over a selection of their lanes."""
    pos = torch.tensor([[positions[b]] for b in rows], device=cache.device)
    step = net.make_step(pos, max(positions[b] for b in rows) + 1)
    return context(net, step, cache.select([lanes[b] for b in rows]))


class _Mixed:
    """The context of one core pass over rows at different loop indices, given to model.loop at loop 0: the blocks'
    products and norms run over every row at once (its weights are the groups'); rotation and attention run per
    group of rows at one loop index, through that group's Cached context, in its own loop's slots
    (core_slot(k, j) = core_slot(0, j) + k * n_core)."""

    native = None  # model.blocks then runs model.block, which asks rope and attend of this context

    def __init__(self, net: LoopedLM, B: int, groups: list[tuple[torch.Tensor, int, Cached]],
                 ids: torch.Tensor | None):
        self.B, self.T, self.groups, self.n_core = B, 1, groups, net.cfg.n_core
        self.ids = ids  # every row's token (value embeddings)
        self.weights = groups[0][2].weights

    def rope(self, qk: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(qk)
        for idx, _, ctx in self.groups:
            out[idx] = ctx.rope(qk[idx])
        return out

    def attend(self, w, slot: int, q, h, k, v) -> torch.Tensor:
        out = None
        for idx, loop, ctx in self.groups:
            o = ctx.attend(w, slot + loop * self.n_core, q[idx], h[idx], k[idx], v[idx])  # [rows, H, 1, hd]
            if out is None:
                out = o.new_empty(self.B, *o.shape[1:])
            out[idx] = o
        assert out is not None  # (every row is in some group)
        return out
