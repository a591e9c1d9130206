"""What every call does before and after its sequences run, written once: check the config against the mode matrix,
check lengths and the block budget, and run the sequences through the model's one engine (`engine_of`)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..errors import BudgetError, ConfigError, ModeError
from ..modes import check_depth_range, check_modes
from ..request import GenerateConfig
from .options import EngineOptions
from .runner import Runner
from .sequence import Client

# Lanes of an in-process batch: more prompts than this wait for a lane (a list of 1,000 prompts holds 32 lanes of
# block tables, and blocks only for the lanes running).
BATCH_LANES = 32


def checked(model, cfg: GenerateConfig | None, call: str) -> GenerateConfig:
    """The call's config, validated against the model and the mode matrix's column for `call`."""
    cfg = (cfg or GenerateConfig()).validate(model)
    check_modes(call, model.cache_mode, cfg)
    if call in ("prefix", "warm_start") and cfg.prompt_logprobs is not None:
        # a handle or scaffold holds the prompt's first tokens: no forward of this call gives their rows' logits
        raise ModeError("GenerateConfig.prompt_logprobs cannot be combined with prefix reuse or a warm start: the "
                        "prompt's cached tokens run no forward here, so their logits are not there to score; use "
                        "generate or generate_batch (a request asking reuses no cached prefix)")
    if call in ("speculative", "tree_speculative") and cfg.depth_range_asked(model):
        check_depth_range(model, cfg, speculative=True)
    if cfg.beam_size > 1 and (cfg.temperature != 0 or cfg.top_k != 0 or cfg.top_p != 1.0):
        raise ConfigError("beam search is deterministic: GenerateConfig.temperature must be 0 and top_k/top_p off "
                          f"when beam_size > 1 (got temperature={cfg.temperature}, top_k={cfg.top_k}, top_p={cfg.top_p})")
    return cfg


def check_length(model, prompt_len: int, cfg: GenerateConfig, what: str = "prompt") -> None:
    """max_seq_len bounds a sequence's cells; a sliding window holds only `cache_window` of them, so a windowed
    sequence may run longer (the position tables grow)."""
    if cfg.cache_window == 0 and prompt_len + cfg.max_tokens > model.max_seq_len:
        raise ConfigError(f"{what} length {prompt_len} + max_tokens {cfg.max_tokens} exceeds max_seq_len "
                          f"{model.max_seq_len} (GenerateConfig.max_tokens, or max_seq_len when loading the model)")


def engine_of(model, lanes: int = 1) -> Runner:
    """The model's one engine (a Runner over a cache of the model's pool), with at least `lanes` lanes: every call,
    the worker's scheduler and the benches run through it. It is built at first use, and built again while it runs
    nothing when more lanes are asked than it has or the engine's environment switches changed (EngineOptions)."""
    runner, options = model.engine, EngineOptions.from_env()
    if runner is None:
        with torch.inference_mode(False):  # (its block tables are changed outside steps too: reset, free_model)
            cache = model.new_cache(max(lanes, BATCH_LANES), model.max_seq_len)
        model.engine = Runner(model, cache, options=options)
        return model.engine
    if runner.cache.lanes >= lanes and (runner.options == options or not runner.idle):
        return runner  # (switches changed under a running batch apply from its next idle moment)
    if not runner.idle:
        raise BudgetError(f"{lanes} lanes at once: the model's engine has {runner.cache.lanes} and runs requests now "
                          f"(it grows only while idle); lower beam_size or the scheduler's lanes, or retry")
    with torch.inference_mode(False):
        cache = runner.cache if runner.cache.lanes >= lanes else model.new_cache(lanes, model.max_seq_len)
    runner.configure(cache, options)
    return runner


@contextmanager
def engine(model, prompts: list[list[int]], cfgs: list[GenerateConfig], *, n_lanes: int | None = None,
           loops: int | None = None, ring: int = 0, what: str = "prompt") -> Iterator[tuple[Runner, Client]]:
    """The model's engine and a client of it with one lane per prompt (or n_lanes lanes for one prompt: beam
    hypotheses), once lengths and the block budget allow them; whatever of the client's is left in the engine when
    the call ends (it raised) is given up, its blocks back to the pool. `loops`: the deepest loop count a lane runs
    (default: the configs')."""
    for i, (ids, c) in enumerate(zip(prompts, cfgs)):
        check_length(model, len(ids), c, what if len(prompts) == 1 else f"lane {i}: {what}")
    longest = max(len(p) + c.max_tokens for p, c in zip(prompts, cfgs))
    loops = loops or max(c.resolved_loops(model) for c in cfgs)
    model.net.ensure_positions(longest + ring + 1)
    widest = max(c.beam_size for c in cfgs)  # a beam request holds beam_size lanes
    n = n_lanes or max(widest, min(sum(c.beam_size for c in cfgs), BATCH_LANES))
    # (a windowed lane holds its ring's cells: the window, or `ring` where a speculative lane's drafts need more)
    cells = [max(c.cache_window, ring) if c.cache_window else 0 for c in cfgs]
    if n_lanes or len(prompts) == 1:  # beam hypotheses run together, so they must fit together
        model.admit(n, longest, loops, cells[0], what=f"{n} x {what}" if n > 1 else what)
    else:  # batch lanes wait for blocks or are preempted (Runner.run): each request must fit on its own
        for p, c, ring_cells in zip(prompts, cfgs, cells):
            model.admit(c.beam_size, len(p) + c.max_tokens, loops, ring_cells, what=what, now=False)
    runner, client = engine_of(model, n), Client(n)
    try:
        yield runner, client
    finally:
        runner.drop(client)
