"""Many prompts at once (the offline batching lane): generate_batch runs them through the scheduler the worker runs.

Every prompt is a Sequence (tinyloop/engine), the same object `generate` uses for one prompt; at most BATCH_LANES
run at once, each in a lane of one cache, and the rest join as lanes free up. Prefill pieces and decode rows are the
forwards `generate` runs, so greedy output equals `generate` on each prompt alone (docs/batching.md).
"""
from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from collections.abc import Sequence as Seq

from .engine.calls import check_length, checked, engine, engine_of
from .engine.sequence import Client, Sequence
from .errors import BudgetError, ConfigError, TinyLoopError
from .prefix import PrefixPool, check_pool
from .resume import check_resume, refine_sequence
from .speculative import SpeculativeConfig, speculative_call, speculative_sequence
from .request import GenerateConfig, GenerateResult, OnToken

# on_token(lane, token, index) -> bool; False cancels that lane only.
OnLaneToken = Callable[[int, int, int], bool]
DEFAULT_LANES = 16  # a Scheduler's lanes (the worker's --max-lanes)

def lane_configs(prompts, cfg) -> list[GenerateConfig]:
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ConfigError("generate_batch: prompts must be a non-empty list of prompts (strings or token-id lists)")
    if cfg is None or isinstance(cfg, GenerateConfig):
        return [cfg or GenerateConfig()] * len(prompts)
    if not isinstance(cfg, (list, tuple)) or len(cfg) != len(prompts) or not all(isinstance(c, GenerateConfig) for c in cfg):
        raise ConfigError(f"generate_batch: cfg must be one GenerateConfig or a list of one per prompt "
                          f"({len(prompts)} prompts)")
    return list(cfg)


def check_batch(model, prompts: Seq, cfgs: list[GenerateConfig], return_exceptions: bool = False) -> list:
    '''Every prompt and its config checked before any runs (the seed table's call-entry constraints, its length, the
    block budget it needs on its own); an error names the prompt's index. Every other setting (loops and early-exit
    thresholds included) may differ per lane: the scheduler groups lanes for the forward. Returns the prompts' token
    ids; with return_exceptions a bad prompt's entry is its error instead of raising it.'''
    ids: list = []
    for i, (prompt, c) in enumerate(zip(prompts, cfgs)):
        try:
            cfgs[i] = c = checked(model, c, "batch")
            ids.append(model.encode_prompt(prompt))
            check_length(model, len(ids[-1]), c)
            model.admit(c.beam_size, len(ids[-1]) + c.max_tokens, c.resolved_loops(model), c.cache_window,
                        what="the prompt", now=False)
        except TinyLoopError as exc:
            error = type(exc)(f"generate_batch prompt {i}: {exc}")
            if not return_exceptions:
                raise error from None
            ids[i:] = [error]
    return ids


def generate_batch(model, prompts: Seq, cfg: GenerateConfig | Seq[GenerateConfig] | None = None,
                   on_token: OnLaneToken | None = None, return_exceptions: bool = False
                   ) -> list[GenerateResult | TinyLoopError]:
    """Generate from every prompt through the scheduler (tinyloop/engine/runner.py); one GenerateResult per prompt,
    in order. At most BATCH_LANES prompts run at once; the rest join as lanes free up (continuous batching).

    cfg: one GenerateConfig for all prompts, or one per prompt (every field may differ). on_token(lane, token,
    index) streams (lane: the prompt's index); returning False cancels that prompt only.
    return_exceptions: a prompt that is refused (its config, length or budget) or fails (a fault of its own, a
    shared forward that broke) gets its error in its place, and the others run; by default the first error raises.
    """
    model.check_alive()
    cfgs = lane_configs(prompts, cfg)
    ids = check_batch(model, prompts, cfgs, return_exceptions)
    good = [i for i, x in enumerate(ids) if not isinstance(x, Exception)]
    out: list = list(ids)
    if not good:
        return out
    with model.busy():
        with engine(model, [ids[i] for i in good], [cfgs[i] for i in good], what="generate_batch prompt") as (runner,
                                                                                                           client):
            t_call = time.perf_counter()
            lane_cb = (lambda i: None) if on_token is None else (lambda i: lambda token, index: on_token(i, token, index))
            seqs = [Sequence(model, ids[i], cfgs[i], lane_cb(i), t_call) for i in good]
            for i, res in zip(good, runner.run(seqs, raise_errors=not return_exceptions, client=client)):
                out[i] = res
    return out


def closed(runner, client: Client, depth_control) -> None:
    """A Scheduler is gone (weakref.finalize, so at any moment: only flags, which the engine's next step reads)."""
    client.closed = True
    if depth_control is not None and runner.depth_control is depth_control:
        runner.depth_control = None


class Scheduler:
    """Continuous batching for a serving loop (the worker's): `submit` requests at any time, `step()` runs one
    scheduling iteration (docs/engine.md) and returns the sequences that finished in it; `seq.result()` is a
    request's GenerateResult, `seq.cancel()` stops one. Up to `lanes` requests run at once, the rest wait.

    A request with a sliding window (cache_window > 0) holds lanes of the batch like any other; its lanes keep their
    K/V in a ring of their own over the same pool (the lane's KV policy, engine/executor.py's attach_ring), so its
    forwards read the ring while the other lanes' share their calls.

    Its requests run in the model's one engine (engine/calls.py's engine_of), as a client with `lanes` lanes: an
    in-process call made between two steps runs through the same engine, and steps this scheduler's requests with
    its own (what finishes then is returned by the next `step`). The model is held (BusyError otherwise) only during
    a step, so other calls may run between steps."""

    def __init__(self, model, lanes: int = DEFAULT_LANES, depth_control=None):
        model.check_alive()
        self.model = model
        # (a lane beyond its quota: a call made between its steps, a handle's build, gets one without waiting for
        # this scheduler's requests to end)
        self.runner = engine_of(model, lanes + 1)
        self.client = Client(lanes)
        # depth_control: elastic depth's controller (tinyloop/engine/elastic.py), None: every lane at its asked depth;
        # the engine's, for every lane with a depth range, from now on
        self.runner.depth_control = depth_control
        # once this scheduler is gone, its requests left in the engine are given up at the engine's next step
        weakref.finalize(self, closed, self.runner, self.client, depth_control)
        self.pools: dict[int, PrefixPool] = {}  # id(seq) -> the pool a request goes through

    def submit(self, prompt, cfg: GenerateConfig | None = None, on_token: OnToken | None = None,
               pool: PrefixPool | None = None, speculative: SpeculativeConfig | None = None) -> Sequence:
        """Queue one request; ConfigError / ModeError / BudgetError (can never fit) at once, as generate would.
        pool: the request goes through a PrefixPool (generate_with_pool): it reuses the pool's scaffolds and counts
        in the pool's stats. speculative: it decodes as generate_speculative does (its rounds when it decodes alone,
        a plain row at its verify loops beside others: the greedy tokens are the same)."""
        model = self.model
        cfg = cfg or GenerateConfig()  # (its window may come from TINYLOOP_CACHE_WINDOW)
        if speculative is not None:
            speculative, cfg = speculative_call(model, speculative, cfg)
        else:
            cfg = checked(model, cfg, "batch" if pool is None else "prefix")  # (the mode matrix's column)
        ids = model.encode_prompt(prompt)
        check_length(model, len(ids), cfg)
        loops = cfg.resolved_loops(model) if speculative is None else speculative.resolved_verify_loops(model, cfg)
        self.check_fits(cfg, len(ids), loops)
        if speculative is not None:
            seq = speculative_sequence(model, ids, speculative, cfg, on_token)
            self.queue(seq)
            return seq
        seq = Sequence(model, ids, cfg, on_token)
        if pool is not None:
            check_pool(pool, model)
            pool.prune()
            seq.prefixes, self.pools[id(seq)] = pool.lookup(model), pool
            self.runner.add(seq, client=self.client)
        else:
            self.queue(seq)
        return seq

    def resume(self, handle, cfg: GenerateConfig | None = None, on_token: OnToken | None = None) -> Sequence:
        """Queue a warm start from a ResumeHandle (resume_generate's checks at once): at its first step the handle
        lends its blocks to the lane and runs only the loops it lacks; then it decodes beside the batch."""
        cfg = check_resume(handle, cfg)
        self.check_fits(cfg, len(handle.ids), cfg.resolved_loops(self.model))
        seq, cached, first = refine_sequence(handle, cfg, on_token)
        self.queue(seq, cached=cached, first=first)
        return seq

    def check_fits(self, cfg: GenerateConfig, prompt_len: int, loops: int) -> None:
        """BudgetError now for a request that can never fit this scheduler's lanes or the pool."""
        width, lanes = cfg.beam_size, self.client.lanes  # a beam request holds beam_size lanes at once
        if width > lanes:
            raise BudgetError(f"beam_size {width} needs {width} lanes at once, and this scheduler has {lanes}: it can "
                              f"never fit; lower beam_size")
        what = f"{width} x beam hypothesis" if width > 1 else "the prompt"
        self.model.admit(width, prompt_len + cfg.max_tokens, loops, cfg.cache_window, what=what, now=False)

    def queue(self, seq: Sequence, cached: int = 0, first=None) -> None:
        cfg = seq.cfg
        if cfg.cache_window:
            self.model.net.ensure_positions(len(seq.prompt) + cfg.max_tokens + 1)  # a ring may run past max_seq_len
        self.runner.add(seq, cached, first, self.client)

    def step(self) -> list[Sequence]:
        """One step of the engine; returns this scheduler's requests that finished since its last step."""
        with self.model.busy():
            self.runner.step()
        done = self.client.take()
        for seq in done:
            pool = self.pools.pop(id(seq), None)
            if pool is not None:
                pool.count(seq.prompt, seq.loops, seq.stats.prefix_hit_tokens)
        return done

    def idle(self) -> bool:
        return self.runner.idle_for(self.client)

    def close(self) -> None:
        """Give up every request of this scheduler's still in the engine (their lanes and blocks back now)."""
        with self.model.busy():
            self.runner.drop(self.client)
