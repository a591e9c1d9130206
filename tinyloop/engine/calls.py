"""What every call does before and after its sequences run, written once: check the config against the mode matrix,
hold the model, encode the prompts, check lengths and the block budget, lend a cache, and give its blocks back."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..cache import KVCache
from ..errors import ConfigError
from ..modes import check_depth_range, check_modes
from ..request import GenerateConfig

# Lanes of an in-process batch: more prompts than this wait for a lane (a list of 1,000 prompts holds 32 lanes of
# block tables, and blocks only for the lanes running).
BATCH_LANES = 32


def checked(model, cfg: GenerateConfig | None, call: str) -> GenerateConfig:
    """The call's config, validated against the model and the mode matrix's column for `call`."""
    cfg = (cfg or GenerateConfig()).validate(model)
    check_modes(call, model.cache_mode, cfg)
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


@contextmanager
def lanes(model, prompts: list[list[int]], cfgs: list[GenerateConfig], *, n_lanes: int | None = None,
          loops: int | None = None, ring: int = 0, what: str = "prompt") -> Iterator[KVCache]:
    """A cache with one lane per prompt (or n_lanes lanes for one prompt: beam hypotheses), once lengths and the
    block budget allow them; its blocks go back to the pool when the call ends. `loops`: the deepest loop count a
    lane runs (default: the configs')."""
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
    # a windowed lane keeps its K/V in a ring of its own (Executor.attach_ring): the lent cache is plain, as long as
    # the other lanes need
    plain = max((len(p) + c.max_tokens for p, c in zip(prompts, cfgs) if not c.cache_window), default=1)
    cache = model.decode_cache if n == 1 else model.new_cache(n, plain)
    cache.reset()
    try:
        yield cache
    finally:
        cache.reset()
