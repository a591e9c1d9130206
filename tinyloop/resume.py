"""Warm start: a ResumeHandle keeps what a prompt's prefill computed up to some depth, so a later call at
more loops runs only the loops it lacks.

Why this is exact: the state s_k of token t depends only on loops < k of tokens <= t (a token at loop k
attends to loop-k entries of earlier tokens). So the handle keeps, per prompt token, the injected input e
and the state at the deepest depth D it has computed, plus the KV entries of the prelude and of loops
0..D-1. Resuming at L >= D runs loops D..L-1 over the prompt chunk (`net.loop`), then the coda and decode:
the same operations `generate(..., loops=L)` performs, minus the first D loops.
Every resume deeper than D stores the new state and entries, so 4 -> 8 -> 16 each reuse the deepest state.
Resuming at L < D recomputes loops 0..L-1 from e (only the prelude is skipped): the handle keeps one state.

A refine also saves on its answer, using the handle's last output (the draft) as a guess. Greedy, at more
loops than the handle holds: self-speculation from the handle's depth D (speculative.py); while the output
follows the draft, rounds verify pieces of it (4, 8, 16 ... tokens), then drafts at D go on token by token.
Otherwise: while the sampled tokens follow the draft, their logits come from verifying it piece by piece in
one chunk each instead of one-token steps; at the first difference plain decode goes on (the causal mask
hides the rest of the piece until decode overwrites it). Any guess keeps the output exact, since every token
is still sampled from the refine's own logits and generator. `stats.draft_reused_tokens` counts the answer
tokens taken from drafts.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import torch

from .cache import KVCache, Span
from .engine.calls import checked, engine
from .engine.sequence import Sequence, Start, Writes
from .errors import ConfigError, HandleError
from .handle_base import Handle, encode_tokens, prefill_by_steps, tensor_bytes
from .engine import forward as paged
from .modes import check_modes
from .loader import Model
from .speculative import SpeculativeConfig, speculative_sequence, speculative_stats
from .sampling import MIN_TEMPERATURE
from .request import GenerateConfig, GenerateResult, GenerateStats, OnToken

REFINE_AHEAD = 6  # draft_ahead of a greedy refine (the best chain in `tinyloop bench --section speculative`)


class ResumeHandle(Handle):
    """Per prompt token: e and s at `depth` loops; KV entries of the prelude and loops 0..depth-1.

    With a cache window only the newest `cache_window` positions' entries are kept (all a later token can
    see); e and s are kept for every prompt token since the resumed loops run over the whole prompt.
    """

    kind = "ResumeHandle"

    def __init__(self, model: Model, ids: list[int], depth: int, cache_window: int):
        super().__init__(model)
        self.ids, self.depth, self.cache_window = ids, depth, cache_window
        self.e: torch.Tensor | None = None
        self.s: torch.Tensor | None = None
        self.span: Span | None = None  # blocks of slots 0..P + R*depth - 1 (a window: the ring's newest cells)
        self.draft: list[int] = []  # the last resume_generate's tokens: the next call's guess (refine_sequence)

    @property
    def l_used(self) -> int:
        return self.depth

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.e, self.s) + (self.span.nbytes if self.span is not None else 0)

    def release(self) -> None:
        if self.span is not None:
            self.span.release()
        self.e = self.s = self.span = None

    def slots(self, depth: int) -> range:
        cfg = self.model.cfg
        return range(cfg.n_prelude + cfg.n_core * depth)

    def pieces(self) -> list[tuple[int, int]]:
        """The prompt's prefill pieces as the runner cuts them (model.prefill_chunk): the handle's entries then have
        the bits of generate's prefill, and a long prompt is not one huge chunk. A windowed handle runs one piece. The
        build's engine steps (prefill_by_steps) cut the prompt at the same places, and the deepenings run these."""
        T, c = len(self.ids), self.model.prefill_chunk
        c = T if not c or self.cache_window else c
        return [(a, min(a + c, T)) for a in range(0, T, c)]

    def run_loops(self, cache: KVCache, first: int, last: int, latent: paged.Latent, head: bool = False
                  ) -> torch.Tensor | None:
        """Loops first..last of the prompt's latent rows (in place), piece by piece through the loop-range forward
        (first == 0: from the initial state of latent.e); with head, the coda and head: the last piece's logits
        [T_piece, V]. The build ran loops 0..depth-1 from the ids in the same pieces (Executor.latent_piece)."""
        net, dev = self.model.net, self.model.device
        logits = None
        for a, b in self.pieces():
            step = net.make_step(torch.arange(a, b, device=dev).unsqueeze(0), b)
            rows = paged.Latent(latent.e[:, a:b], latent.s[:, a:b])
            if first == 0:
                rows.s.copy_(net.init_state(rows.e, step))
            logits = paged.forward_loops(net, step, cache, first, last, rows, None, head)
        return None if logits is None else logits[0]

    @torch.inference_mode()
    def build(self) -> None:
        """Prefill the prompt to `depth` loops by steps of the engine (their blocks taken in its schedule, as every
        step's), through the loop-range forward piece by piece (Executor.latent_piece), and keep every token's latent
        rows and the blocks of slots(depth); the coda's, written for the step's last logits, go back."""
        latent = paged.Latent.empty(1, len(self.ids), self.model.net)

        def keep(lane: KVCache) -> None:
            self.span = lane.share(self.slots(self.depth), len(self.ids))

        prefill_by_steps(self.model, self.ids, self.depth, keep, window=self.cache_window, latent=latent,
                         what=f"a {len(self.ids)}-token resume handle")
        self.e, self.s = latent.e, latent.s

    def lend(self, cache: KVCache, loops: int) -> Writes:
        """Lend the kept blocks to `cache` for a run at `loops` loops (`prefill`); returns what that run writes: the
        slots of the loops the handle lacks and the coda's, over the prompt's cells."""
        start = self.depth if loops >= self.depth else 0
        assert self.span is not None  # (built, not released: the caller holds it)
        # Only loops < start are lent: the recomputed ones must not find stale ring entries beside them.
        held = self.span if start == self.depth else self.span.only(self.slots(0))
        cache.adopt(held)
        if held is not self.span:
            held.release()
        cfg = self.model.cfg
        slots = [*range(self.slots(start).stop, self.slots(loops).stop), *(cfg.coda_slot(j) for j in range(cfg.n_coda))]
        return slots, 0, len(self.ids) - 1

    @torch.inference_mode()
    def prefill(self, cache: KVCache, loops: int, stats: GenerateStats) -> torch.Tensor:
        """Run the loops the handle lacks over the prompt, and the coda, in `cache` (its blocks lent by `lend`).

        Returns the logits [T, V] of the prompt's last piece; deepens the handle when `loops` > depth.
        """
        start = self.depth if loops >= self.depth else 0
        assert self.e is not None and self.s is not None and self.span is not None  # (built, not released)
        latent = paged.Latent(self.e, self.s.clone() if start else torch.empty_like(self.s))
        logits = self.run_loops(cache, start, loops, latent, head=True)
        assert logits is not None  # (with the head)
        stats.skipped_loops = start * len(self.ids)
        if loops > self.depth:
            new = cache.share(range(self.slots(self.depth).stop, self.slots(loops).stop), len(self.ids))
            self.span.blocks.update(new.blocks)
            if new.cell_pos is not None:
                assert self.span.cell_pos is not None  # (a ring's span, as the new one)
                self.span.cell_pos.update(new.cell_pos)
            self.s, self.depth = latent.s, loops
        return logits


class GuessFollower:
    """A refine's driver (Sequence.driver) for a guessed continuation (the handle's last draft): while the sampled
    tokens equal it, the lane's logits come from verifying the next piece of the guess in one chunk (4 tokens,
    doubling while they are all taken), not from one-token steps. A piece is only started on a token already
    sampled, so a guess that diverges wastes at most the rest of one piece; a new piece is started only when the lane
    decodes alone (beside other rows a row costs the step almost nothing), and a piece already verified serves in any
    step."""

    def __init__(self, seq: Sequence, guess: list[int], loops: int):
        self.seq, self.guess, self.loops, self.base = seq, guess, loops, len(seq.prompt)
        self.following, self.reused = True, 0
        self.piece, self.rows_from = 4, 0
        self.rows: torch.Tensor | None = None  # the verified piece's logits
        self.chosen_from: torch.Tensor | None = None  # (its steps decide no tokens: Driver)

    def covered(self, i: int) -> bool:
        return self.rows is not None and self.rows_from <= i < self.rows_from + len(self.rows)

    def runs(self, alone: bool) -> bool:
        seq, i = self.seq, self.seq.pos - self.base
        self.following = self.following and i < len(self.guess) and seq.token == self.guess[i]
        return self.following and (alone or self.covered(i))

    def span(self) -> int:
        """Cells its next step may write from seq.pos: a new piece of the guess, or none."""
        return 1 if self.covered(self.seq.pos - self.base) else self.piece

    def plain_row(self, seconds: float) -> None:
        pass

    def drafter(self, alone: bool) -> None:
        return None  # (a piece of the guess is verified by its own forward, or the lane is a plain row)

    def step(self, cache: KVCache) -> list[int]:
        seq, net = self.seq, self.seq.model.net
        i = seq.pos - self.base
        if not self.covered(i):  # positions the chunk writes past the output are rewritten before they are read
            chunk, dev = self.guess[i:i + self.piece], cache.device
            step = net.make_step(torch.arange(seq.pos, seq.pos + len(chunk), device=dev).unsqueeze(0),
                                 seq.pos + len(chunk))
            self.rows = paged.forward(net, torch.tensor([chunk], device=dev), self.loops, step, cache)[0]
            self.rows_from, self.piece = i, self.piece * 2
        assert self.rows is not None  # (covered now)
        seq.place.logits = self.rows[i - self.rows_from]
        seq.pos += 1
        seq.loop_counts.append(self.loops)
        self.reused += 1
        return []

    def finish(self) -> None:
        self.seq.stats.draft_reused_tokens = self.reused


def refine_sequence(handle: ResumeHandle, cfg: GenerateConfig, on_token: OnToken | None, held: bool = False
                    ) -> tuple[Sequence, int, Start | None]:
    """A resume from `handle` at cfg's loops as a sequence for a runner: (sequence, prompt tokens its `first`
    provides, first). `held`: the caller holds the handle for the whole call (else its lend and prefill hold it, in
    the scheduler's step). The handle lends its blocks at the first
    step and runs only the loops it lacks (ResumeHandle.prefill); the answer follows the handle's last one as far as
    it agrees (a greedy refine deeper than the handle: self-speculation from the handle's depth; otherwise
    GuessFollower)."""
    model, ids = handle.model, handle.ids
    L = cfg.resolved_loops(model)
    adaptive = model.net.adaptive(cfg.exit(model))
    if len(ids) == 1 and adaptive:  # generate runs a one-token prompt with early exit; match it by a plain prefill
        seq = Sequence(model, ids, cfg, on_token)
        seq.on_result = lambda res: setattr(handle, "draft", res.tokens)
        return seq, 0, None
    sc = None
    greedy = cfg.temperature < MIN_TEMPERATURE  # (the sampler's rule: it chooses by argmax there)
    if L > handle.depth and greedy and cfg.grammar is None and not adaptive and not cfg.cache_window:
        # a greedy refine drafts at the depth the handle holds and verifies at L (self-speculation)
        sc = SpeculativeConfig(handle.depth, L, REFINE_AHEAD).validate(model)
        seq = speculative_sequence(model, ids, sc, cfg, on_token, handle.draft)
    else:
        seq = Sequence(model, ids, cfg, on_token)
        if not (adaptive or cfg.cache_window):
            # early exit decides per token, not per chunk; a ring would need room for the chunk's extra cells
            seq.driver = GuessFollower(seq, handle.draft[:cfg.max_tokens - 1], L)

    def done(res: GenerateResult) -> None:
        if sc is not None:  # the answer tokens a self-speculative refine took from drafts at the handle's depth
            res.stats.draft_reused_tokens = speculative_stats(res).accepted
        handle.draft = res.tokens

    def lend(lane: KVCache) -> Writes:
        with nullcontext() if held else handle.held(model):  # freed meanwhile: HandleError, for this request alone
            return handle.lend(lane, L)

    def run(lane: KVCache) -> torch.Tensor:
        with nullcontext() if held else handle.held(model):
            return handle.prefill(lane, L, seq.stats)[-1]

    seq.on_result, seq.cacheable = done, False  # its cells came from the handle's prefill, not generate's
    return seq, len(ids), Start(lend, run)


def _window_default() -> int:
    return GenerateConfig().cache_window


def build_resume_handle(model: Model, prompt, l_used: int, *, cache_window: int | None = None) -> ResumeHandle:
    """Prefill `prompt` to l_used loops (prelude and core only) and keep it for resume_generate.

    cache_window: the sliding window the later calls will use (None: the TINYLOOP_CACHE_WINDOW default, as
    GenerateConfig); the window changes attention during prefill, so a handle serves one window only.
    """
    if not isinstance(l_used, int) or isinstance(l_used, bool) or not 1 <= l_used <= model.cfg.max_loops:
        raise ConfigError(f"l_used must be an integer in 1..{model.cfg.max_loops}, got {l_used!r}")
    window = _window_default() if cache_window is None else cache_window
    probe = GenerateConfig(cache_window=window).validate(model)
    check_modes("warm_start", model.cache_mode, probe)
    ids = encode_tokens(model, prompt, "prompt")
    if len(ids) >= model.max_seq_len:
        raise ConfigError(f"prompt length {len(ids)} must be below max_seq_len {model.max_seq_len}")
    handle = ResumeHandle(model, ids, l_used, window)
    with model.busy():
        handle.build()
    return handle


def check_resume(handle: ResumeHandle, cfg: GenerateConfig | None) -> GenerateConfig:
    """The checked config of a resume from `handle` (HandleError, ConfigError, ModeError)."""
    if not isinstance(handle, ResumeHandle):
        raise HandleError(f"expected a ResumeHandle, got {type(handle).__name__}")
    model = handle.model
    handle.check(model)
    cfg = checked(model, cfg or GenerateConfig(), "warm_start")
    if cfg.cache_window != handle.cache_window:
        raise ConfigError(f"GenerateConfig.cache_window must equal the window the handle was built with "
                          f"({handle.cache_window}), got {cfg.cache_window}")
    return cfg


def resume_generate(handle: ResumeHandle, loops: int | None = None, cfg: GenerateConfig | None = None,
                    on_token: OnToken | None = None) -> GenerateResult:
    """Generate from the handle's prompt at `loops` loops (None: cfg.loops), skipping the loops it holds.

    Greedy output equals generate(model, prompt, cfg with loops); stats.skipped_loops counts the
    prompt-token-loops not recomputed (prompt tokens x loops skipped).
    """
    base = cfg or GenerateConfig()
    cfg = check_resume(handle, base if loops is None else dataclasses.replace(base, loops=loops))
    model = handle.model
    with handle.using(model), engine(model, [handle.ids], [cfg]) as (runner, client):
        seq, cached_tokens, first = refine_sequence(handle, cfg, on_token, held=True)
        return runner.run([seq], cached=cached_tokens, first=first, client=client)[0]
