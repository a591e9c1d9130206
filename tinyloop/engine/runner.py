"""Runner: steps a set of sequences through the model, lane i of its KV cache holding sequence i.

One call of `run` takes every sequence from its prompt to its result: each prompt is prefilled into its lane (one
chunk: the same call for a sequence alone or in a batch, so their outputs are equal), then the running lanes decode
together, one token per lane per forward. A finished lane leaves the forward and gives its blocks back; when the
pool runs out, the youngest lane is preempted and recomputed later (`run`).

Forwards: `decode` runs one-token-per-lane rows, `prefill` a chunk, both through the model's one forward over the
paged cache (tinyloop/kernels/step.py); with early exit (a threshold or the model's exit gate) decode rows go
through `forward_adaptive`, which stops each lane's looping on its own.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..cache import KVCache
from ..errors import BudgetError
from ..kernels import step as cached
from ..memory import blocks_for, release_freed_memory
from .sequence import Sequence

# first(sequence) -> logits [V] of the prompt's last position, the prompt's cache already in the lane: how prefix
# reuse and warm starts replace the prefill
Prefill = Callable[[Sequence], torch.Tensor]


class Runner:
    def __init__(self, model, cache: KVCache, loops: int, early_exit: float = 0.0):
        self.model, self.net, self.cache, self.loops, self.early_exit = model, model.net, cache, loops, early_exit
        self.adaptive = self.net.adaptive(early_exit)
        self.hold_back = False  # set by a preemption, cleared when a lane finishes
        self.prefixes = model.prefixes if model.prefix_caching and not cache.window else None  # automatic prefix caching

    def lane(self, i: int) -> KVCache:
        return self.cache if self.cache.lanes == 1 else self.cache.lane_view(i)

    def prefill(self, ids: list[int], start: int, lane: int = 0) -> torch.Tensor:
        """Logits [T, V] of a chunk at positions start.. in `lane`: all loops (a chunk does not exit early)."""
        dev = self.model.device
        x = torch.tensor([ids], device=dev)
        step = self.net.make_step(torch.arange(start, start + len(ids), device=dev).unsqueeze(0), start + len(ids))
        return cached.forward(self.net, x, self.loops, step, self.lane(lane), exit_threshold=self.early_exit)[0]

    def decode(self, tokens: list[int], positions: list[int], cache: KVCache | None = None
               ) -> tuple[torch.Tensor, list[int]]:
        """One token per lane (lanes 0..B-1 of `cache`, default the runner's): logits [B, V] and the loops each
        lane ran. Subclasses may answer from elsewhere (resume's refine verifies a guessed continuation)."""
        cache = self.cache if cache is None else cache
        dev = self.model.device
        ids = torch.tensor([[t] for t in tokens], device=dev)
        pos = torch.tensor([[p] for p in positions], device=dev)
        step = self.net.make_step(pos, max(positions) + 1)
        if self.adaptive:
            out, used = cached.forward_adaptive(self.net, ids, self.loops, step, cache, self.early_exit)
            return out[:, -1], used
        return cached.forward(self.net, ids, self.loops, step, cache)[:, -1], [self.loops] * len(tokens)

    def first_logits(self, seq: Sequence, lane: int, cached: int, first: Prefill | None) -> torch.Tensor:
        """The prompt's last logits: a plain prefill of what the cache lacks, or `first` (prefix reuse, warm start).
        A one-token prompt with early exit decodes adaptively, as any one-token forward."""
        t = time.perf_counter()
        if first is None and not cached and self.prefixes is not None:
            first = self.prefixes.reuse(self, seq, lane)  # the longest cached prefix's blocks; None on a miss
        if first is not None:
            logits = first(seq)
            seq.loop_counts.append(self.loops)
        elif len(seq.prompt) - cached == 1 and self.adaptive:
            row, used = Runner.decode(self, [seq.prompt[-1]], [cached], self.lane(lane))
            logits = row[0]
            seq.loop_counts.append(used[0])
        else:
            logits = self.prefill(seq.prompt[cached:], cached, lane)[-1].clone()  # not a view pinning [T, V]
            seq.loop_counts.append(self.loops)
            release_freed_memory(self.model.device)
        if self.prefixes is not None:
            self.prefixes.keep(seq.prompt, self.loops, self.lane(lane))
        seq.stats.prefill_ms = (time.perf_counter() - t) * 1000
        return logits

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], cached: int = 0, first: Prefill | None = None) -> list:
        """Take every sequence from its prompt to its result. Lanes join as the pool's free blocks allow (in order),
        decode together, and give their blocks back when done. When a step finds the pool exhausted, the youngest
        running lane is preempted: its blocks go back, and it rejoins later by recomputing its cache (prompt, then
        its tokens one by one, the forwards that built it) and continues where it stopped."""
        waiting, running = list(range(len(seqs))), []  # lanes without a cache (new or preempted), oldest first
        logits: dict[int, torch.Tensor] = {}  # lane -> the logits its next token is sampled from
        while True:
            self.admit(seqs, waiting, running, logits, cached, first)
            for i in list(running):
                if i in logits and not seqs[i].step(logits.pop(i)):
                    running.remove(i)
                    if self.prefixes is not None and not self.adaptive:  # adaptive decode fills skipped loops by copies
                        self.prefixes.keep(seqs[i].history, self.loops, self.lane(i))
                    self.lane(i).reset()  # a finished lane's blocks go back at once
                    self.hold_back = False
            if not running:
                if not waiting:
                    return [seq.result() for seq in seqs]
                continue
            view = self.cache.select(running)
            try:
                rows, used = self.decode([seqs[i].token for i in running], [seqs[i].pos for i in running], view)
            except BudgetError:
                if len(running) == 1:
                    raise
                lane = running.pop()
                self.preempt(lane, waiting)
                seqs[lane].stats.preempted += 1
                continue
            finally:
                view.commit()
            for r, i in enumerate(running):
                seqs[i].pos += 1
                seqs[i].loop_counts.append(used[r])
                logits[i] = rows[r]

    def admit(self, seqs: list[Sequence], waiting: list[int], running: list[int], logits: dict, cached: int,
              first: Prefill | None) -> None:
        """Build the caches of waiting lanes, oldest first, while the pool has room for them (with nothing running a
        lane is tried anyway: a pool that cannot hold it raises BudgetError)."""
        pool, window, cfg = self.cache.pool, self.cache.ring, self.model.cfg
        if self.hold_back and running:
            return  # after a preemption lanes rejoin only once a running lane has finished (no thrashing)
        self.hold_back = False
        while waiting:
            i = waiting[0]
            seq = seqs[i]
            # its blocks now, and room for every running lane to cross into a new block on the next step
            need = blocks_for(cfg, len(seq.prompt) + seq.count + 1, seq.loops, window) + \
                sum(cfg.n_slots(seqs[r].loops) for r in running + [i])
            if running and need > pool.room():
                return
            waiting.pop(0)
            try:
                if seq.count == 0:
                    logits[i] = self.first_logits(seq, i, cached, first)
                    seq.t_prefilled = time.perf_counter()
                else:
                    self.recompute(seq, i)
            except BudgetError:
                self.lane(i).reset()
                if not running:
                    raise
                waiting.insert(0, i)
                return
            running.append(i)
            running.sort()

    def recompute(self, seq: Sequence, lane: int) -> None:
        """Rebuild a preempted lane's cache with the forwards that first built it: the prompt's prefill, then each
        token it has fed one at a time; the token it was about to feed (seq.token) comes next."""
        cache = self.lane(lane)
        self.prefill(seq.prompt, 0, lane)
        fed = seq.history[len(seq.prompt):-1]
        for j, token in enumerate(fed):
            Runner.decode(self, [token], [len(seq.prompt) + j], cache)

    def preempt(self, lane: int, waiting: list[int]) -> None:
        self.lane(lane).reset()
        waiting.append(lane)
        waiting.sort()
        self.hold_back = True
