"""Executor: runs a step's plan (engine/plan.py) over the paged cache, and owns every tensor and buffer of it.

The plan says which prefill pieces and decode rows run, at which loop counts and exit rules, over blocks the
scheduler already took; the executor picks the backend for each part and gives back logits by lane:
- prefill pieces: up to 32 tokens as rows of shared C calls, one loop count a call (CBackend.prefill_rows), else
  the model's one forward over a chunk (engine/forward.py), or a handle's own forward; a piece whose latent rows
  its sequence keeps (a resume handle's build) through the loop-range forward, its rows given back with its logits;
  a piece whose request asks for prompt log-probabilities (keep_rows) gives back every row's logits, not only its
  last one's (Outputs.rows);
- decode rows at one fixed depth: one forward of every loop (the token step);
- decode rows at different depths, exiting early, or drawing greedily inside C: loop iterations (continuous-depth
  batching), in one C call with the exit decisions in C (`iterate_in_c`), else one forward per pass (`one_pass`,
  engine/iteration.py) with the decisions here. A token between passes is in flight (`flights`, by lane): its
  latent rows and exit state stay here until its loops are done.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from ..cache import KVCache
from ..errors import TinyLoopError
from ..exits import TRACKED, ExitRule, Track, exit_stops
from . import forward as paged
from . import iteration
from .c_backend import CBackend
from .options import EngineOptions
from .plan import Chunk, Outputs, Piece, Plan, Row
from .sequence import InFlight

log = logging.getLogger("tinyloop.scheduler")  # (the scheduler's decisions and how they ran: one log)


class Executor:
    def __init__(self, model, cache: KVCache, loops: int, early_exit: ExitRule, options: EngineOptions):
        self.model, self.net, self.cache, self.options = model, model.net, cache, options
        # defaults for callers that feed the forwards themselves (beam search, resume); plans bring their own
        self.loops, self.early_exit = loops, early_exit
        self.views: dict[int, KVCache] = {}
        self.flights: dict[int, InFlight] = {}  # lane -> the token it is looping (continuous-depth batching)
        # continuous-depth batching: decode rows at different depths, or exiting early, advance one loop iteration per
        # step (`iterate`); off (TINYLOOP_DEPTH_STEPS=0), each step runs such rows' whole tokens (`whole_tokens`)
        self.iterative = options.depth_steps
        # the C calls (passes with their exit decisions, prefill rows) and the latent rows they keep between calls;
        # a greedy row whose token ended may wait a pass or two there to share its head with batch-mates'
        self.c = CBackend(model, cache, options.coalesce)
        # the lanes of windowed requests (the lane's KV policy): each request's lanes keep their K/V in a ring cache of
        # their own over the same pool, run by an executor over it; lane -> (that executor, the lane's index there)
        self.rings: dict[int, tuple[Executor, int]] = {}

    def is_adaptive(self, rule: ExitRule) -> bool:
        return self.net.adaptive(rule)

    def lane(self, i: int) -> KVCache:
        """Lane i as a one-lane cache (kept: a driver's forwards keep what they prepared while it stays the same); a
        windowed lane's is its ring."""
        if i in self.rings:
            sub, j = self.rings[i]
            return sub.lane(j)
        if self.cache.lanes == 1:
            return self.cache
        view = self.views.get(i)
        if view is None:
            view = self.views[i] = self.cache.lane_view(i)
        return view

    def forget(self, lane: int) -> None:
        """The lane was given back (finished, failed, preempted): its token in flight goes with it, and a windowed
        lane's ring (its blocks went back with the lane's reset)."""
        self.flights.pop(lane, None)
        ring = self.rings.pop(lane, None)
        if ring is not None:
            ring[0].forget(ring[1])

    # --- windowed lanes: a ring of their own over the batch's pool ------------------------------------------
    def attach_ring(self, lanes: list[int], window: int, cells: int) -> None:
        """The lanes of one windowed request (one, or a beam's) keep their K/V in a ring of `cells` cells attending
        over the last `window` positions, with blocks from the batch's pool: they stay lanes of this engine
        (admitted, planned, preempted and counted with the others), and their share of each plan runs through an
        executor over the ring, whose attention reads it (KVCache's ring mode)."""
        base = self.cache
        ring = KVCache(base.cfg, len(lanes), base.max_len, base.mode, device=base.device, dtype=base.dtype,
                       window=window, ring=cells, pool=base.pool)
        sub = Executor(self.model, ring, self.loops, self.early_exit, self.options)
        for j, lane in enumerate(lanes):
            self.rings[lane] = (sub, j)

    def take_blocks(self, jobs: list[tuple[int, list[int], list[int], list[int]]]) -> None:
        """KVCache.take_blocks over the engine's lanes: a windowed lane's in its ring."""
        if not self.rings:
            self.cache.take_blocks(jobs)
            return
        plain: list[tuple[int, list[int], list[int], list[int]]] = []
        rings: dict[int, tuple[Executor, list[tuple[int, list[int], list[int], list[int]]]]] = {}
        for slot, lanes, lo, hi in jobs:
            keep = [i for i, lane in enumerate(lanes) if lane not in self.rings]
            plain.append((slot, [lanes[i] for i in keep], [lo[i] for i in keep], [hi[i] for i in keep]))
            for i, lane in enumerate(lanes):
                if lane in self.rings:
                    sub, j = self.rings[lane]
                    rings.setdefault(id(sub), (sub, []))[1].append((slot, [j], [lo[i]], [hi[i]]))
        self.cache.take_blocks(plain)
        for sub, ring_jobs in rings.values():
            sub.cache.take_blocks(ring_jobs)

    def assign_lanes(self, dst: list[int], src: list[int]) -> None:
        """KVCache.assign_lanes over the engine's lanes (a beam's children take their parents' cells): within a
        windowed request's ring where its lanes are."""
        if dst and dst[0] in self.rings:
            sub = self.rings[dst[0]][0]
            sub.cache.assign_lanes([self.rings[lane][1] for lane in dst], [self.rings[lane][1] for lane in src])
        else:
            self.cache.assign_lanes(dst, src)

    def run_rings(self, plan: Plan, out: Outputs) -> Plan:
        """The windowed lanes' share of the plan, each ring's through its executor (under the ring's lane numbers);
        their outputs go to `out` by the engine's lanes. Returns the rest of the plan."""
        rest = Plan(plan.step, driven=plan.driven, drafting=plan.drafting)
        parts: dict[int, tuple[Executor, Plan, dict[int, int]]] = {}  # id(executor) -> it, its plan, ring -> lane
        for kind in ("pieces", "rows", "chunks"):
            for item in getattr(plan, kind):
                if item.lane not in self.rings:
                    getattr(rest, kind).append(item)
                    continue
                sub, j = self.rings[item.lane]
                _, ring_plan, lane_of = parts.setdefault(id(sub), (sub, Plan(plan.step), {}))
                getattr(ring_plan, kind).append(replace(item, lane=j))
                lane_of[j] = item.lane
        for sub, ring_plan, lane_of in parts.values():
            got = sub.execute(ring_plan)
            out.tokens.update((lane_of[j], v) for j, v in got.tokens.items())
            out.drawn.update((lane_of[j], v) for j, v in got.drawn.items())
            out.chosen_from.update((lane_of[j], v) for j, v in got.chosen_from.items())
            out.verified.update((lane_of[j], v) for j, v in got.verified.items())
            out.failed.update((lane_of[j], v) for j, v in got.failed.items())
            out.pieces += [(lane_of[j], n, logits, used, seconds) for j, n, logits, used, seconds in got.pieces]
            out.latents += [(lane_of[j], start, e, s) for j, start, e, s in got.latents]
            out.rows += [(lane_of[j], start, rows) for j, start, rows in got.rows]
            if len(plan.rows) == 1 and got.lone_row_seconds is not None:
                out.lone_row_seconds = got.lone_row_seconds
        return rest

    # --- forwards -----------------------------------------------------------------------------------------
    def prefill(self, ids: list[int], start: int, lane: int = 0, loops: int | None = None,
                exits: ExitRule | None = None, all_rows: bool = False) -> torch.Tensor:
        """Logits [1, V] of a chunk's last position at positions start.. in `lane` ([T, V], every position's, with
        all_rows): all loops (a chunk does not exit early)."""
        dev = self.model.device
        x = torch.tensor([ids], device=dev)
        step = self.net.make_step(torch.arange(start, start + len(ids), device=dev).unsqueeze(0), start + len(ids))
        exits = self.early_exit if exits is None else exits
        return paged.forward(self.net, x, loops or self.loops, step, self.lane(lane), exit_threshold=exits,
                             last_only=not all_rows)[0]

    def decode(self, tokens: list[int], positions: list[int], loops: list[int] | int | None = None,
               exits: list[ExitRule] | ExitRule | None = None) -> tuple[torch.Tensor, list[int]]:
        """One token per lane (lanes 0..B-1), each lane at its own loop count and exit rule (lists, or one value for
        all), for callers that feed the forwards themselves: logits [B, V] and the loops each lane ran."""
        B = len(tokens)
        loops = [loops or self.loops] * B if not isinstance(loops, list) else loops
        exits = [self.early_exit if exits is None else exits] * B if not isinstance(exits, list) else exits
        out = Outputs()
        self.token_step([Row(i, t, p, n, e, self.is_adaptive(e))
                         for i, (t, p, n, e) in enumerate(zip(tokens, positions, loops, exits))], out)
        logits, used = zip(*(out.tokens[i] for i in range(B)))
        return torch.stack(logits), list(used)

    def whole_tokens(self, rows: list[Row], out: Outputs) -> None:
        """The rows' tokens, each at its own loop count and exit rule, all done within this call: loop iterations
        (`iterate`) until every row's token is done, no greedy token drawn ahead. The path of the rows when
        iteration-level steps are off (TINYLOOP_DEPTH_STEPS=0), of a one-token prompt that may exit early, and of the
        refeed of such tokens."""
        pending = [replace(r, greedy=False, draws=[]) for r in rows]
        while pending:
            self.iterate(pending, out)
            pending = [r for r in pending if r.lane not in out.tokens]

    # --- a step -------------------------------------------------------------------------------------------
    def execute(self, plan: Plan) -> Outputs:
        """The plan's forwards: its prefill pieces, then its decode rows in one forward (or loop iterations), each
        lane at its own loop count and exit rule. A driven lane's forwards are its driver's (the runner calls it).
        A windowed request's share runs over its ring (`run_rings`)."""
        out = Outputs()
        if self.rings:
            plan = self.run_rings(plan, out)
        rows = [p for p in plan.pieces if self.in_rows(p)]
        if rows:
            for piece, logits, seconds, every in self.c.prefill_rows(rows, plan.step):
                out.pieces.append((piece.lane, len(piece.tokens), logits.clone(), piece.loops, seconds))
                if every is not None:
                    out.rows.append((piece.lane, piece.start, every))
        for piece in plan.pieces:
            if not any(piece is other for other in rows):
                try:
                    self.run_piece(piece, out)
                except TinyLoopError as exc:  # its own fault (a handle freed before its prefill): it fails alone
                    out.failed[piece.lane] = exc
                    continue
            if piece.handle is None:  # (a capped prompt: its skipped loops' K/V)
                self.cache.fill_skipped(piece.lane, piece.start, piece.loops, piece.kv_loops, len(piece.tokens))
        if plan.rows or plan.chunks:
            self.decode_step(plan, out)
        return out

    def in_rows(self, piece: Piece) -> bool:
        """Whether the piece runs as C rows (forward.c_chunk: up to MAX_LANES tokens), so that pieces of several
        prompts can share a call."""
        return bool(piece.tokens) and piece.handle is None and not piece.whole and not piece.keep_latent \
            and not (piece.start == 0 and len(piece.tokens) == 1 and self.is_adaptive(piece.exit)) \
            and self.c.chunk_rows(len(piece.tokens), piece.exit)

    def run_piece(self, piece: Piece, out: Outputs) -> None:
        """A piece that is not C rows: its handle's forward, one that keeps its latent rows, a one-token prompt with
        early exit (it decodes adaptively, as any one-token forward), or a chunk forward."""
        t, used = time.perf_counter(), piece.loops
        if piece.handle is not None:
            rows = piece.handle.run(self.lane(piece.lane)).unsqueeze(0)
        elif piece.keep_latent:
            rows = self.latent_piece(piece, out)
        elif piece.start == 0 and len(piece.tokens) == 1 and self.is_adaptive(piece.exit):
            token = Outputs()
            self.whole_tokens([Row(piece.lane, piece.tokens[0], 0, piece.loops, piece.exit, True)], token)
            logits, used = token.tokens[piece.lane]
            rows = logits.unsqueeze(0)
        else:  # (every row's logits only where its request asks for them: keep_rows)
            rows = self.prefill(piece.tokens, piece.start, piece.lane, piece.loops, piece.exit, piece.keep_rows)
        # (a copy: not a view pinning [T, V])
        out.pieces.append((piece.lane, len(piece.tokens), rows[-1].clone(), used, time.perf_counter() - t))
        if piece.keep_rows:
            out.rows.append((piece.lane, piece.start, rows))

    def latent_piece(self, piece: Piece, out: Outputs) -> torch.Tensor:
        """A piece whose latent rows its sequence keeps (a resume handle's build): the loop-range forward from its ids
        over all its loops, the path the handle later deepens by (ResumeHandle.run_loops), so the rows and entries
        have the same bits; the shared C rows give no latent back. Its rows go to out.latents; returns the logits
        [1, V] of its last position (every token's coda runs, the last one's head), or of every position [T, V]
        (keep_rows)."""
        net, dev, T = self.net, self.model.device, len(piece.tokens)
        step = net.make_step(torch.arange(piece.start, piece.start + T, device=dev).unsqueeze(0), piece.start + T)
        latent = paged.Latent.empty(1, T, net)
        logits = paged.forward_loops(net, step, self.lane(piece.lane), 0, piece.loops, latent,
                                     torch.tensor([piece.tokens], device=dev), last_only=not piece.keep_rows)
        assert logits is not None  # (with the head)
        out.latents.append((piece.lane, piece.start, latent.e, latent.s))
        return logits[0]

    def decode_step(self, plan: Plan, out: Outputs) -> None:
        rows = plan.rows
        if log.isEnabledFor(logging.DEBUG):  # (its arguments cost a few us per step)
            log.debug("step %d: decode %d lane(s) at loops %s: lanes %s; %d chunk(s) to verify", plan.step, len(rows),
                      ",".join(str(r.loops) for r in rows), ",".join(str(r.lane) for r in rows), len(plan.chunks))
        if plan.chunks and self.with_chunks(rows, plan.chunks, out):
            return
        if plan.chunks and self.iterate_in_c(rows + self.chunk_rows(plan.chunks), out):
            return
        for chunk in plan.chunks:  # (neither C call can take them: each its own forward)
            out.verified[chunk.lane] = self.verify_alone(chunk)
        if not rows:
            return
        if self.iterative and self.by_iteration(rows):
            self.iterate(rows, out)
        else:
            self.token_step(rows, out)

    def token_step(self, rows: list[Row], out: Outputs) -> None:
        """Every row's whole token in this call: one forward of every loop where the rows run at one fixed depth,
        else loop iterations until each token is done (`whole_tokens`)."""
        if len({r.loops for r in rows}) > 1 or any(r.adaptive for r in rows):
            self.whole_tokens(rows, out)
            return
        view = self.cache.select([r.lane for r in rows])
        t = time.perf_counter()
        try:
            logits = paged.decode_rows(self.net, [r.token for r in rows], [r.position for r in rows], rows[0].loops,
                                       view)
        finally:
            view.commit()
        if len(rows) == 1:
            out.lone_row_seconds = time.perf_counter() - t
        for r, row in enumerate(rows):
            out.tokens[row.lane] = (logits[r], row.loops)

    def with_chunks(self, rows: list[Row], chunks: list[Chunk], out: Outputs) -> bool:
        """The decode rows and the drafted chunks' rows in one C call of every loop, where the rows are a token step
        at the chunks' depth (no token in flight, no early exit, one loop count) and all fit one call: a chunk then
        costs the step its rows, not a forward of its own. Each row has the bits of its token decoded alone, so a
        chunk's logits are those of its tokens decoded one by one. False: nothing run."""
        loops = {r.loops for r in rows} | {c.loops for c in chunks}
        if len(loops) > 1 or any(r.adaptive or r.greedy or r.lane in self.flights for r in rows) \
                or any(c.exit is not None or c.width > 1 for c in chunks):
            return False
        view = self.cache.select([r.lane for r in rows] + [c.lane for c in chunks])
        n = len(rows) + sum(len(c.tokens) for c in chunks)
        if paged.c_chunk(self.net, view, n) is None:  # (the C step only: on the CPU, up to its rows)
            return False
        tokens = [r.token for r in rows] + [t for c in chunks for t in c.tokens]
        positions = [r.position for r in rows] + [c.start + i for c in chunks for i in range(len(c.tokens))]
        lanes = list(range(len(rows))) + [len(rows) + j for j, c in enumerate(chunks) for _ in c.tokens]
        try:
            logits = paged.decode_rows(self.net, tokens, positions, loops.pop(), view, lanes)
        finally:
            view.commit()
        for r, row in enumerate(rows):
            out.tokens[row.lane] = (logits[r], row.loops)
        at = len(rows)
        for chunk in chunks:
            out.verified[chunk.lane] = (logits[at:at + len(chunk.tokens)], [chunk.loops] * len(chunk.tokens))
            at += len(chunk.tokens)
        return True

    def chunk_rows(self, chunks: list[Chunk]) -> list[Row]:
        """The drafted chunks' tokens as rows of the step's loop iterations (`verifies`): each starts its token at
        its cell and runs to its loop count, or stops by its chunk's exit rule; a tree's token at its depth's position,
        seeing its ancestors."""
        return [Row(c.lane, token, position, c.loops, c.exit or ExitRule(), c.exit is not None, verifies=True,
                    cell=c.start + i, sees=(c.start, c.ancestors(i)) if c.width > 1 else None)
                for c in chunks for i, (token, position) in enumerate(zip(c.tokens, c.positions()))]

    def verify_alone(self, chunk: Chunk) -> tuple[torch.Tensor, list[int]]:
        """A drafted chunk through a forward of its own: the loop range (every loop, or each row stopping on its own
        by the chunk's exit rule, its skipped loops filled; a tree with its ancestor mask), as a speculative round
        verifies."""
        T, net, w = len(chunk.tokens), self.net, chunk.width
        exits = paged.RowExits(chunk.exit or ExitRule(), chunk.exit is not None, chunk.loops, [0] * T, [False] * T)
        cells = list(range(chunk.start, chunk.start + T))
        positions = chunk.positions()
        tree = paged.TreeShape(chunk.start, w, (T - 1) // w, self.model.device) if w > 1 else None
        logits, _ = paged.LoopForward(net, self.lane(chunk.lane)).until(
            positions, 0, chunk.loops, paged.Latent.empty(1, T, net), exits, True, chunk.tokens, tree, cells)
        assert logits is not None  # (with the head)
        return logits[0], exits.used

    # --- continuous-depth batching: a step is one loop iteration of every row ------------------------------------
    def by_iteration(self, rows: list[Row]) -> bool:
        """Whether this step's rows advance by loop iterations: a token is in flight, or the rows' depths differ, or
        one may exit early, or every row draws its next tokens in C (one call then runs several tokens of each row,
        where a token step runs one: faster greedy decoding at fixed depth, docs/engine.md). Otherwise, all at
        one fixed depth, one forward of every loop per step does the same work in fewer calls."""
        return any(r.lane in self.flights for r in rows) or len({r.loops for r in rows}) > 1 \
            or any(r.adaptive for r in rows) \
            or all(r.greedy for r in rows) and self.c.passes(len(rows)) is not None

    def iterate(self, rows: list[Row], out: Outputs) -> None:
        """Loop iterations of every row until some row's token is done: that lane samples at this step's
        postprocess and starts its next token at the next step, while deeper lanes keep looping. Between two passes
        where no token ends there is nothing to schedule (no lane frees, nothing is sampled), so they run in one
        step: at batch 1 a token is one step, as at fixed depth. Where every row's exit rule can be decided in C,
        the passes and their exit decisions are one C call (`iterate_in_c`); otherwise one forward per pass
        (`one_pass`) with the decisions here."""
        if not self.iterate_in_c(rows, out):
            while not self.one_pass(rows, out):
                pass

    def iterate_in_c(self, rows: list[Row], out: Outputs) -> bool:
        """The passes of `iterate` as one C call (CBackend.iterate) where the C step runs the model over this cache and
        C decides every row's exit rule (a loop count, the latent rule with the exit gate, a forced depth, Ouro's
        cdf), the greedy rows drawing their `draws` inside it. False (nothing run) where the rows need `one_pass`."""
        ended = self.c.iterate(rows, self.flights, self.budget, out)
        if ended is None:
            return False
        chunks: dict[int, list[tuple[torch.Tensor, int]]] = {}  # lane -> its chunk's rows' (logits, loops), in order
        for row, logits, used in ended:
            if row.verifies:
                chunks.setdefault(row.lane, []).append((logits, used))
            else:
                self.token_done(row, logits, used, out)
        for lane, got in chunks.items():
            out.verified[lane] = (torch.stack([logits for logits, _ in got]), [used for _, used in got])
        return True

    def budget(self, rows: list[Row], positions: int) -> list[list[float]]:
        """The tokens each row draws inside the C call: its `draws` (the scheduler took their cells' blocks), up to
        the cache's (and the C step's) positions."""
        cells = min(self.cache.cells, positions)
        return [r.draws[:max(0, cells - 1 - r.position)] for r in rows]

    def one_pass(self, rows: list[Row], out: Outputs) -> bool:
        """One loop iteration of every row in one forward (engine/iteration.py): a row without a token in flight
        starts its next one (prelude and loop 0), the others run their next loop, each at its own loop index; a token
        whose loops are done (its loop count, or its exit rule fired) gets its logits. An exited token's skipped
        loops get copies of its last loop's K/V (the family's exit_kv "copy"; "compute" runs them and keeps the exit
        state's logits). True when some row's token is done."""
        net, dev = self.net, self.model.device
        starting = [r.lane not in self.flights for r in rows]
        for row, new in zip(rows, starting):
            if new:
                fresh = paged.Latent.empty(1, 1, net)
                self.flights[row.lane] = InFlight(0, fresh.e, fresh.s, row.adaptive, used=row.loops)
        flights = [self.flights[r.lane] for r in rows]
        for f in flights:
            self.c.track_of(f)  # its last passes ran in C (iterate_in_c): its rule's state as a Track
        latent = paged.Latent(torch.cat([f.e for f in flights]), torch.cat([f.s for f in flights]))
        adaptive = [b for b, f in enumerate(flights) if f.adaptive]
        before = latent.s[adaptive].clone() if adaptive else None
        # a fixed-depth token's last pass ends with its coda and head in the same call
        finish = [not f.adaptive and f.done + 1 == r.loops for r, f in zip(rows, flights)]
        positions = [r.position for r in rows]
        logits = iteration.iterate(net, self.cache, positions, [f.done for f in flights],
                                   [r.token if new else None for r, new in zip(rows, starting)], finish, latent,
                                   lanes=[r.lane for r in rows],
                                   looping=[r.token for r in rows] if net.cfg.value_embeds else None)
        heads = iter(logits)
        done = False
        for b, (row, f) in enumerate(zip(rows, flights)):
            f.e, f.s, f.done = latent.e[b:b + 1], latent.s[b:b + 1], f.done + 1
            if finish[b]:
                self.token_done(row, next(heads), row.loops, out)
                done = True
        if adaptive:
            assert before is not None
            for i, b in enumerate(adaptive):
                if starting[b]:  # the state loop 0 started from: the initial state of its prelude output
                    at = torch.tensor([[positions[b]]], device=dev)
                    before[i:i + 1] = net.init_state(flights[b].e, net.make_step(at, positions[b] + 1))
            ended = self.exits([rows[b] for b in adaptive], before, latent.s[adaptive])
            if ended:
                self.exit_heads(ended, out)
                done = True
        return done

    def exits(self, rows: list[Row], s_old: torch.Tensor, s_new: torch.Tensor) -> list[Row]:
        """The exit rule of every early-exit row after its pass, in one go (exits.exit_stops, what model.ChunkExits
        does for a token); a rule that reads logits (Huginn's) gets this loop's, from the coda and head of the rows
        whose exit is not yet chosen. Returns the rows whose token's loops are done."""
        net, dev = self.net, s_new.device
        flights = [self.flights[r.lane] for r in rows]
        reading = [i for i, (r, f) in enumerate(zip(rows, flights)) if r.exit.reads_logits and not f.chosen]
        logits = None
        if reading:
            logits = torch.zeros(len(rows), net.cfg.vocab_size, device=dev)
            logits[reading] = self.heads([rows[i] for i in reading], s_new[reading]).float()
        last = torch.tensor([[f.done == r.loops] for r, f in zip(rows, flights)], device=dev)
        track = None  # (only the rules that remember something between loops keep a Track)
        if any(r.exit.rule in TRACKED for r in rows):
            track = Track.cat([f.track if f.track is not None else Track.start(1, 1, net.cfg.vocab_size, dev)
                               for f in flights])
        stop = exit_stops(net, [r.exit for r in rows], [f.done for f in flights], last, s_old, s_new, track, logits)
        stops_of = stop.all(dim=1).tolist()
        ended = []
        for i, (row, f, state, stops) in enumerate(zip(rows, flights, s_new, stops_of)):
            if track is not None:
                f.track = track.rows(torch.tensor([i], device=dev))
            if not f.chosen:
                f.out = state.unsqueeze(0).clone()
                if stops and i in reading:  # (its coda K/V are this loop's: they stay, with no head run again)
                    assert logits is not None  # (some rows read them)
                    f.logits = logits[i]
            f.chosen |= stops
            if stops and f.used == row.loops and f.done < row.loops:
                f.used = f.done
            if f.done == row.loops or f.used <= f.done and net.cfg.exit_kv == "copy":
                ended.append(row)
        return ended

    def heads(self, rows: list[Row], s: torch.Tensor) -> torch.Tensor:
        """Logits [len(rows), V] of the rows' tokens from states s [len(rows), 1, d]: their coda and head, in one
        forward (it writes their coda K/V)."""
        net, dev = self.net, self.model.device
        view = self.cache.select([r.lane for r in rows])
        positions = torch.tensor([[r.position] for r in rows], device=dev)
        latent = paged.Latent(torch.cat([self.flights[r.lane].e for r in rows]), s.contiguous(),
                              torch.tensor([[r.token] for r in rows], device=dev) if net.cfg.value_embeds else None)
        try:
            logits = paged.forward_loops(net, net.make_step(positions, int(positions.max()) + 1), view, 0, 0, latent)
            assert logits is not None  # (with the head)
            return logits[:, -1]
        finally:
            view.commit()

    def exit_heads(self, rows: list[Row], out: Outputs) -> None:
        """Early-exit tokens whose loops are done take their logits: from the state they exited with, by one coda and
        head forward (or the logits their rule read at that loop); their skipped loops' K/V are copied from the last
        loop they ran."""
        if self.model.cfg.exit_kv == "copy":
            for row in rows:
                self.cache.fill_skipped(row.lane, row.position, self.flights[row.lane].used, row.loops)
        unread = [r for r in rows if self.flights[r.lane].logits is None]
        states = [self.flights[r.lane].exit_state() for r in unread]
        logits: Iterator[torch.Tensor] = iter(self.heads(unread, torch.cat(states)) if unread else [])
        for row in rows:
            flight = self.flights[row.lane]
            self.token_done(row, flight.logits if flight.logits is not None else next(logits), flight.used, out)

    def token_done(self, row: Row, logits: torch.Tensor, used: int, out: Outputs) -> None:
        """A fed token's forward is done (its last loop iteration): its logits are the lane's fresh logits."""
        self.flights.pop(row.lane, None)
        out.tokens[row.lane] = (logits, used)

    # --- rebuilding a preempted request's cache ------------------------------------------------------------------
    def rebuild(self, lane: int, prompt: list[int], chunk: int, loops: int, exits: ExitRule, kv_loops: int) -> None:
        """Refill a lane's prompt with the chunks that first built it (its blocks taken), at the depth it ran."""
        if lane in self.rings:
            sub, j = self.rings[lane]
            sub.rebuild(j, prompt, chunk, loops, exits, kv_loops)
            return
        for start in range(0, len(prompt), chunk or len(prompt)):
            piece = prompt[start:start + (chunk or len(prompt))]
            self.prefill(piece, start, lane, loops, exits)
            self.cache.fill_skipped(lane, start, loops, kv_loops, len(piece))

    def refeed(self, lane: int, tokens: list[int], start: int, loops: int, exits: list[ExitRule]) -> None:
        """Feed tokens one at a time at positions start.., each under its exit rule, as they were first fed: by loop
        iterations where an early-exit token's depth is decided (its exits decided again, the same), else a decode
        forward each (their blocks taken)."""
        if lane in self.rings:
            sub, i = self.rings[lane]
            sub.refeed(i, tokens, start, loops, exits)
            return
        for j, (token, rule) in enumerate(zip(tokens, exits)):
            if self.is_adaptive(rule):
                self.whole_tokens([Row(lane, token, start + j, loops, rule, True)], Outputs())
            else:
                paged.decode_rows(self.net, [token], [start + j], loops, self.lane(lane))
