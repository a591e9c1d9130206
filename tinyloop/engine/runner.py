"""Runner: steps a set of sequences through the model, lane i of its KV cache holding sequence i.

One call of `run` takes every sequence from its prompt to its result: each prompt is prefilled into its lane (one
chunk: the same call for a sequence alone or in a batch, so their outputs are equal), then all lanes decode in
lockstep, one token per lane per forward. A lane whose sequence is done stays in the forward's shape, fed its last
token at a frozen position (its writes land past its output); its outputs are discarded.

The model forward is `forward`: the lean step of tinyloop/kernels for one-token-per-lane rows (the fast path),
the model's chunk forward otherwise; with early exit (a threshold or the model's exit gate) decode rows run
`forward_adaptive`, which stops each lane's looping on its own.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..cache import KVCache
from ..kernels.lean import decode_forward
from .sequence import Sequence

# first(sequence) -> logits [V] of the prompt's last position, the prompt's cache already in the lane: how prefix
# reuse and warm starts replace the prefill
Prefill = Callable[[Sequence], torch.Tensor]


class Runner:
    def __init__(self, model, cache: KVCache, loops: int, early_exit: float = 0.0):
        self.model, self.net, self.cache, self.loops, self.early_exit = model, model.net, cache, loops, early_exit
        self.adaptive = early_exit > 0 or self.net.exit_gate is not None

    def lane(self, i: int) -> KVCache:
        return self.cache if self.cache.lanes == 1 else self.cache.lane_view(i)

    def prefill(self, ids: list[int], start: int, lane: int = 0, loops: int | None = None) -> torch.Tensor:
        """Logits [T, V] of a chunk at positions start.. in `lane`: all loops (a chunk does not exit early)."""
        dev = self.model.device
        x = torch.tensor([ids], device=dev)
        step = self.net.make_step(torch.arange(start, start + len(ids), device=dev).unsqueeze(0), start + len(ids))
        return self.net(x, self.loops if loops is None else loops, step, self.lane(lane))[0]

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
            out, used = self.net.forward_adaptive(ids, self.loops, step, cache, self.early_exit)
            return out[:, -1], used.tolist()
        return decode_forward(self.net, ids, self.loops, step, cache)[:, -1], [self.loops] * len(tokens)

    def first_logits(self, seq: Sequence, lane: int, cached: int, first: Prefill | None) -> torch.Tensor:
        """The prompt's last logits: a plain prefill of what the cache lacks, or `first` (prefix reuse, warm start).
        A one-token prompt with early exit decodes adaptively, as any one-token forward."""
        t = time.perf_counter()
        if first is not None:
            logits = first(seq)
            seq.loop_counts.append(self.loops)
        elif len(seq.prompt) - cached == 1 and self.adaptive:
            row, used = Runner.decode(self, [seq.prompt[-1]], [cached], self.lane(lane))
            logits = row[0]
            seq.loop_counts.append(used[0])
        else:
            logits = self.prefill(seq.prompt[cached:], cached, lane)[-1]
            seq.loop_counts.append(self.loops)
        seq.stats.prefill_ms = (time.perf_counter() - t) * 1000
        return logits

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], cached: int = 0, first: Prefill | None = None) -> list:
        """Prefill every sequence into its lane, then decode all lanes in lockstep until every one is done."""
        rows = [self.first_logits(seq, i, cached, first) for i, seq in enumerate(seqs)]
        t = time.perf_counter()
        for seq in seqs:
            seq.t_prefilled = t
        logits = torch.stack(rows)
        while True:
            for i, seq in enumerate(seqs):
                if not seq.done:
                    seq.step(logits[i])
            live = [not seq.done for seq in seqs]
            if not any(live):
                return [seq.result() for seq in seqs]
            logits, used = self.decode([seq.token for seq in seqs], [seq.pos for seq in seqs])
            for seq, alive, u in zip(seqs, live, used):
                if alive:  # a done lane keeps its frozen position
                    seq.pos += 1
                    seq.loop_counts.append(u)
