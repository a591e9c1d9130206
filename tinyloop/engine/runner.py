"""Runner: the scheduler. It steps sequences through the model, each in a lane of its KV cache while it runs.

Sequences may be added at any time (`add`); one `step()` is one scheduling iteration (iteration-level scheduling,
as in Orca and vLLM), and both the in-process calls (`run`: add, then step until done) and the worker drive it.
One step, schedule -> execute -> postprocess (the shape of nano-vllm's and vLLM v1's engine step):
  1. retire: drop sequences cancelled from outside (`Sequence.cancel`) and give their lanes back;
  2. schedule (a Plan): admit waiting sequences (oldest first; of those that came together, the deepest and longest
     first: admission_order) while a lane is free (a beam request: beam_size lanes)
     and the pool's free blocks cover them (a preempted sequence is recomputed here, exactly); pieces of admitted
     prompts, the shortest rest first, up to `chunk` prompt tokens in all (a piece never crosses a multiple of
     `chunk`, so a prompt is cut at the same places alone or in a batch: the same forwards); the running lanes'
     decode rows, and the lanes whose driver (Sequence.driver: a speculative round, a refine's verified piece) runs
     its own forwards; then `reserve` takes every block they will write, so the forwards take none;
  3. execute: the pieces (those of up to 32 tokens as rows of shared C calls, one loop count a call:
     prefill_rows), the drivers' forwards, and the decode rows in one forward, each lane at its own loop count and
     early-exit threshold (the model's one forward takes them per lane);
  4. postprocess: every sequence with fresh logits takes its next token, drawn for all of them in one pass of the
     sampler (stops, grammar, streaming, max_tokens), a driven lane the tokens its round decided, and every beam
     request chooses its next beam (engine/beam.py); a finished one leaves at once and gives its blocks back; a fault
     of one request's own fails it alone.
When schedule finds the pool exhausted, the youngest sequence without fresh logits gives its blocks back and
waits (preemption); waiting sequences rejoin only after a running one finishes (no thrashing).

Forwards: `decode` runs one-token-per-lane rows, `prefill` a chunk, both through the model's one forward over the
paged cache (tinyloop/engine/forward.py); lanes at different loop counts, or with early exit (a threshold or the
model's exit gate), go through `forward_adaptive`, which runs each lane to its own depth.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..cache import KVCache
from ..errors import BudgetError, ForwardError, TinyLoopError
from ..memory import blocks_for, release_freed_memory
from ..exits import TRACKED, ExitRule, Track, exit_stops
from ..sampling import MIN_TEMPERATURE
from . import forward as paged
from .beam import BeamGroup
from . import iteration
from .c_backend import CBackend
from .options import EngineOptions
from .sequence import InFlight, Place, Sequence, Start


@dataclass
class Plan:
    """What one step's forwards run (Runner.schedule), their blocks already taken."""
    pieces: list[tuple[Sequence, int]]  # prefill: a sequence and the prompt tokens of its piece (0: its `first`)
    rows: list[Sequence]                # one token each, in the step's one decode forward
    driven: list[Sequence]              # lanes whose driver runs their own forwards (a speculative round)


def admission_order(seq: Sequence) -> tuple[int, int, int]:
    """The order waiting sequences take lanes in: those that came earlier first; of those that came together (between
    the same two steps, such as a generate_batch call's prompts), the most loop iterations first (loops x max_tokens
    x beam_size), so that no deep request starts last and runs alone at the end while the shallow ones are long done
    (the longest-processing-time rule); among equals, the order they came in."""
    work = seq.loops * seq.cfg.max_tokens * seq.cfg.beam_size
    return seq.place.came, -work, seq.place.arrival


# Every decision at DEBUG level, one line each: admit, prefill piece, decode group, finish, preempt (docs/engine.md).
log = logging.getLogger("tinyloop.scheduler")


class Runner:
    def __init__(self, model, cache: KVCache, loops: int | None = None, early_exit: "ExitRule | float" = 0.0,
                 chunk: int | None = None, options: EngineOptions | None = None):
        self.model, self.net, self.cache = model, model.net, cache
        # defaults for callers that feed the forwards themselves (beam search, resume); sequences bring their own
        self.loops, self.early_exit = loops or model.cfg.default_loops, ExitRule.of(early_exit, model.cfg.exit_rule)
        self.adaptive = self.is_adaptive(self.early_exit)
        self.chunk = model.prefill_chunk if chunk is None else chunk  # 0: a prompt in one piece
        self.free_lanes = list(range(cache.lanes))
        self.waiting: list[Sequence] = []   # without a lane (new or preempted), in admission_order
        self.admitted: list[Sequence] = []  # holding a lane, in admission order: the youngest last
        self.hold_back = False  # set by a preemption, cleared when a sequence finishes
        self.arrivals = self.steps = 0
        self.prefixes = model.prefixes if model.prefix_caching and not cache.window else None  # automatic prefix caching
        self.views: dict[int, KVCache] = {}
        self.reserved: dict[int, tuple] = {}  # lane -> what `reserve` took for it last
        self.reserved_epoch = -1  # the pool's epoch after that
        self.options = options = options or EngineOptions.from_env()
        # continuous-depth batching: decode rows at different depths, or exiting early, advance one loop iteration per
        # step (`iterate`); off for cores that need token ids (value embeddings)
        self.iterative = not model.cfg.value_embeds and options.depth_steps
        # the C calls (passes with their exit decisions, prefill rows) and the latent rows they keep between calls;
        # a greedy row whose token ended may wait a pass or two there to share its head with batch-mates'
        self.c = CBackend(model, cache, options.coalesce)
        self.fail_at_step: int | None = None  # a test-only hook: that step's forwards raise (workers/engine.py)

    def is_adaptive(self, rule: ExitRule) -> bool:
        return self.net.adaptive(rule)

    def lane(self, i: int) -> KVCache:
        """Lane i as a one-lane cache (kept: a driver's forwards keep what they prepared while it stays the same)."""
        if self.cache.lanes == 1:
            return self.cache
        view = self.views.get(i)
        if view is None:
            view = self.views[i] = self.cache.lane_view(i)
        return view

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

    def decode(self, tokens: list[int], positions: list[int], cache: KVCache | None = None,
               loops: list[int] | int | None = None, exits: list[ExitRule] | ExitRule | None = None
               ) -> tuple[torch.Tensor, list[int]]:
        """One token per lane (lanes 0..B-1 of `cache`, default the runner's), each lane at its own loop count and
        exit rule (lists, or one value for all): logits [B, V] and the loops each lane ran."""
        cache = self.cache if cache is None else cache
        B = len(tokens)
        loops = [loops or self.loops] * B if not isinstance(loops, list) else loops
        exits = [self.early_exit if exits is None else exits] * B if not isinstance(exits, list) else exits
        if len(set(loops)) == 1 and not any(self.is_adaptive(e) for e in exits):
            return paged.decode_rows(self.net, tokens, positions, loops[0], cache), loops
        dev = self.model.device
        ids = torch.tensor([[t] for t in tokens], device=dev)
        pos = torch.tensor([[p] for p in positions], device=dev)
        out, used = paged.forward_adaptive(self.net, ids, loops, self.net.make_step(pos, max(positions) + 1), cache,
                                            exits)
        return out[:, -1], list(used)

    @staticmethod
    def prefilling(seq: Sequence) -> bool:
        return seq.place.logits is None and (seq.place.cached < len(seq.prompt) or seq.place.first is not None)

    def piece_len(self, seq: Sequence) -> int:
        """Prompt tokens seq's next prefill forward runs: up to the next multiple of the chunk, whatever else runs,
        so a prompt is cut at the same places alone or in a batch."""
        at = seq.place
        n = len(seq.prompt) - at.cached
        return min(n, self.chunk - at.cached % self.chunk) if self.chunk and at.first is None else n

    def begin_prefill(self, seq: Sequence) -> int:
        """Schedule seq's next prefill piece: lend it the longest cached prefix of its prompt first (a new prompt), and
        take the blocks the piece writes. Returns the prompt tokens the piece covers. A prompt the cache holds but for
        its last token runs no piece: that token becomes a row of this step's decode forward (Place.prompt_row)."""
        t, at = time.perf_counter(), seq.place
        prefixes = seq.prefixes or self.prefixes  # a pool request reuses scaffolds even with prefix caching off
        if at.first is None and not at.cached and prefixes is not None:
            at.first = self.reuse(prefixes, seq)  # the longest cached prefix's blocks; None on a miss
            if at.first is not None and seq.stats.prefix_hit_tokens == len(seq.prompt) - 1 \
                    and not self.is_adaptive(seq.exit):
                # Only the prompt's last token is left: it goes in as a row of this step's decode forward (the same
                # forward at that position) instead of a forward of its own, which costs about a decode step of a
                # few lanes (a repeated prompt at 8 lanes: ~10 % of a worker's time).
                log.debug("step %d: #%d joins the decode rows (%d prompt tokens cached, lane %d)", self.steps,
                          at.arrival, len(seq.prompt) - 1, at.lane)
                at.first, at.cached, at.prompt_row = None, len(seq.prompt), True
                seq.stats.prefill_ms += (time.perf_counter() - t) * 1000
                return 0
        n = self.piece_len(seq)
        if at.first is not None:  # a handle lends its blocks now; the cells the rest writes are taken with them
            lane = self.lane(at.lane)
            writes = at.first.lend(lane)
            if writes is not None:
                slots, lo, hi = writes
                lane.take_blocks([(slot, [0], [lo], [hi]) for slot in slots])
        elif n:
            self.reserve([seq], [at.cached], [at.cached + n - 1])
        seq.stats.prefill_ms += (time.perf_counter() - t) * 1000
        return n

    def reuse(self, prefixes, seq: Sequence) -> Start | None:
        """Lend the longest prefix of seq's prompt the prefix cache holds to its lane; the rest is prefilled at every
        loop as one chunk (what generate's prefill does at those positions). None on a miss (a plain prefill follows)."""
        lane = seq.place.lane
        m = prefixes.restore(seq.prompt, seq.loops, self.lane(lane))
        if not m:
            return None
        seq.stats.prefix_hit_tokens = m
        rest = (self.model.cfg.slots_written(seq.loops), m, len(seq.prompt) - 1)
        return Start(lambda _: rest,
                     lambda seq, _: self.prefill(seq.prompt[m:], m, lane, seq.loops, seq.exit)[-1].clone())

    def prefill_piece(self, seq: Sequence, n: int) -> None:
        """Run seq's scheduled piece of n prompt tokens (or its `first`); sets its fresh logits once the prompt is in.
        A one-token prompt with early exit decodes adaptively, as any one-token forward."""
        t, at = time.perf_counter(), seq.place
        if at.first is not None:
            logits, at.first = at.first.run(seq, self.lane(at.lane)), None
            seq.loop_counts.append(seq.loops)
        elif len(seq.prompt) == 1 and self.is_adaptive(seq.exit):
            row, used = self.decode([seq.prompt[-1]], [0], self.lane(at.lane), seq.loops, seq.exit)
            logits = row[0]
            seq.loop_counts.append(used[0])
        else:
            self.log_piece(seq, n)
            logits = self.prefill(seq.prompt[at.cached:at.cached + n], at.cached, at.lane, seq.loops, seq.exit)[-1]
            if at.cached + n == len(seq.prompt):
                seq.loop_counts.append(seq.loops)
        self.piece_done(seq, n, logits.clone(), time.perf_counter() - t)  # (a copy: not a view pinning [T, V])

    def log_piece(self, seq: Sequence, n: int) -> None:
        at = seq.place
        log.debug("step %d: prefill #%d tokens %d..%d of %d (lane %d)", self.steps, at.arrival, at.cached,
                  at.cached + n, len(seq.prompt), at.lane)

    def in_rows(self, seq: Sequence, n: int) -> bool:
        """Whether seq's scheduled piece runs as C rows (forward.c_chunk: up to MAX_LANES tokens), so that pieces of
        several prompts can share a call (prefill_rows)."""
        return n > 0 and seq.place.first is None and not (len(seq.prompt) == 1 and self.is_adaptive(seq.exit)) \
            and self.c.chunk_rows(n, seq.exit)

    def prefill_rows(self, pieces: list[tuple[Sequence, int]]) -> None:
        """The pieces (each in_rows) as rows of shared C calls (CBackend.prefill_rows): each piece's logits are those of
        its prompt prefilled alone, however the pieces are packed."""
        for seq, n in pieces:
            self.log_piece(seq, n)
        for seq, n, logits, seconds in self.c.prefill_rows(pieces, self.steps):
            if seq.place.cached + n == len(seq.prompt):
                seq.loop_counts.append(seq.loops)
            self.piece_done(seq, n, logits.clone(), seconds)

    def piece_done(self, seq: Sequence, n: int, logits: torch.Tensor, seconds: float) -> None:
        """seq's piece of n prompt tokens ran, `logits` its last position's: once the prompt is in they are its fresh
        logits, and the prompt's blocks go to the prefix cache."""
        at = seq.place
        at.cached += n
        seq.stats.prefill_ms += seconds * 1000
        if at.cached == len(seq.prompt):
            at.logits, seq.t_prefilled = logits, time.perf_counter()
            release_freed_memory(self.model.device)
            if self.prefixes is not None and seq.cacheable:
                self.prefixes.keep(seq.prompt, seq.loops, self.lane(at.lane))

    def reserve(self, seqs: list[Sequence], lo: list[int], hi: list[int]) -> None:
        """Take now the blocks cells lo[i]..hi[i] of seqs[i]'s lane need in every slot it writes at its loop count
        (copy-on-write included), so the step's forwards take none (BudgetError here when the pool is out). A lane is
        skipped while it stays in the blocks reserved for it last time and nothing but these reservations took,
        shared or freed a block since (the pool's epoch): a lane's takes leave every other lane's blocks as they
        were, so a step where one lane crosses into a new block prepares that lane alone."""
        if not seqs:
            return
        cfg, cache, bt = self.model.cfg, self.cache, self.cache.bt
        if self.reserved_epoch != cache.pool.epoch:
            self.reserved = {}
        todo = []
        for s, a, b in zip(seqs, lo, hi):
            a, b = min(a, cache.cells - 1), min(b, cache.cells - 1)
            key = (s.place.arrival, a // bt, b // bt, s.loops)
            if self.reserved.get(s.place.lane) != key:
                todo.append((s, a, b, key))
        if not todo:
            return
        every = ([s.place.lane for s, *_ in todo], [a for _, a, _, _ in todo], [b for *_, b, _ in todo])
        jobs = [(slot, *every) for slot in [*range(cfg.n_prelude), *(cfg.coda_slot(j) for j in range(cfg.n_coda))]]
        for k in range(max(s.loops for s, *_ in todo)):  # a lane at L loops writes (and holds blocks for) loops < L
            at = tuple(map(list, zip(*[(s.place.lane, a, b) for s, a, b, _ in todo if k < s.loops])))
            jobs += [(cfg.core_slot(k, j), *at) for j in range(cfg.n_core)]
        cache.take_blocks(jobs)
        for s, *_, key in todo:
            self.reserved[s.place.lane] = key
        self.reserved_epoch = cache.pool.epoch

    # --- scheduling -----------------------------------------------------------------------------------------
    def add(self, seq: Sequence, cached: int = 0, first: Start | None = None) -> None:
        """Queue a sequence; it joins the running batch at a step boundary. `first`: the prompt's first `cached`
        tokens come from a handle instead of a prefill."""
        # the runner's state of it
        seq.place = Place(cached=cached, first=first, arrival=self.arrivals, came=self.steps)
        if seq.cfg.beam_size > 1 and seq.beam is None:
            seq.beam = BeamGroup(seq)  # it takes beam_size lanes when admitted
        self.arrivals += 1
        self.waiting.append(seq)
        self.waiting.sort(key=admission_order)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.admitted

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One scheduling iteration, schedule -> execute -> postprocess; returns the sequences that finished in it
        (`seq.error` set when one had to be given up: it could not get a block with nothing else running, or a fault
        of its own)."""
        self.steps += 1
        finished = self.retire()
        plan = self.schedule(finished)
        try:
            finished += self.execute(plan)
        except Exception as exc:  # noqa: BLE001 (a shared forward broke: its lanes fail, nobody else's)
            finished += self.fail_step(plan, exc)
        return finished + self.postprocess()

    def retire(self) -> list[Sequence]:
        """Sequences cancelled from outside, and beam requests that ended, give their lanes back."""
        for group in self.groups():
            if group.root.done:  # cancelled from outside
                group.cancel()
        finished = [s for s in self.waiting if s.done] + [s for s in self.admitted if s.done and s.beam is None]
        finished += [g.root for g in self.groups() if g.outcome is not None]
        for seq in finished:
            self.release(seq)
        return finished

    def schedule(self, finished: list[Sequence]) -> Plan:
        """Decide what this step's forwards run and take their blocks: admit waiting sequences; pieces of admitted
        prompts, the shortest rest first, up to `chunk` prompt tokens in all; the running lanes' decode rows, and the
        lanes whose driver runs its own forwards this step (it decodes alone, or a sampled speculative lane). When
        the pool runs out, a sequence is preempted (or given up: appended to `finished`) and the step goes on with
        what it has."""
        self.admit()
        plan, budget, spent = Plan([], [], []), self.chunk or float("inf"), 0
        # shortest rest first: a newcomer's short prompt is not stuck behind the pieces of an older long one
        prefilling = (s for s in self.admitted if self.prefilling(s))
        for seq in sorted(prefilling, key=lambda s: len(s.prompt) - s.place.cached):
            if spent and spent + self.piece_len(seq) > budget:
                continue  # it waits for a later step, so decode rows are not stalled behind long prompts
            if self.shares_a_new_prefix(seq, plan):
                continue  # the next step finds the blocks this one fills in the prefix cache
            try:
                n = self.begin_prefill(seq)
            except BudgetError as exc:
                finished += self.out_of_blocks(exc)
                plan.pieces = [(q, n) for q, n in plan.pieces if q in self.admitted]  # (the preempted one's went)
                return plan
            except TinyLoopError as exc:  # its own fault (a cached prefix it cannot take): it fails alone
                finished.append(self.fail(seq, exc))
                continue
            spent += n or 1
            if n or seq.place.first is not None:
                plan.pieces.append((seq, n))
        group = sorted((s for s in self.admitted if s.place.logits is None and not self.prefilling(s)
                        and all(seq is not s for seq, _ in plan.pieces)), key=lambda s: s.place.lane)
        alone = len(group) == 1
        # (a prompt's last token, left by the prefix cache, is a row of its own: its logits start the output)
        plan.driven = [s for s in group if s.driver is not None and not s.place.prompt_row and s.place.token is None
                       and s.driver.runs(alone)]
        plan.rows = [s for s in group if s not in plan.driven]
        spans = [s.driver.span() for s in plan.driven]
        rows = [s.pos - s.place.prompt_row for s in plan.rows]  # (a prompt row feeds the prompt's last position)
        try:
            self.reserve(plan.rows + plan.driven, rows + [s.pos for s in plan.driven],
                         rows + [s.pos + n - 1 for s, n in zip(plan.driven, spans)])
        except BudgetError as exc:
            finished += self.out_of_blocks(exc)
            plan.rows, plan.driven = [], []
            plan.pieces = [(q, n) for q, n in plan.pieces if q in self.admitted]
        return plan

    def shares_a_new_prefix(self, seq: Sequence, plan: Plan) -> bool:
        """Whether seq's prompt starts with a whole block of a prompt whose first piece this step runs: its lookup
        in the prefix cache comes before that piece's forward, so it waits a step and reuses it instead."""
        bt = self.cache.bt
        at = seq.place
        if at.cached or at.first is not None or (seq.prefixes or self.prefixes) is None or len(seq.prompt) <= bt:
            return False
        return any(not other.stats.prefix_hit_tokens and other.prompt[:bt] == seq.prompt[:bt]
                   for other, n in plan.pieces if n and other.place.cached == 0)

    def execute(self, plan: Plan) -> list[Sequence]:
        """The step's forwards over the blocks `schedule` took: the prefill pieces, each driven lane's own forwards
        (a speculative round: the tokens it decides wait for postprocess), and the decode rows in one forward, each
        lane at its own loop count and early-exit threshold; fresh logits go to seq.place.logits. Returns the sequences
        given up in them (a fault of their own)."""
        finished = []
        if self.steps == self.fail_at_step and (plan.pieces or plan.rows or plan.driven):
            raise RuntimeError(f"a fault injected into step {self.steps}'s forwards (Runner.fail_at_step)")
        rows = [(seq, n) for seq, n in plan.pieces if self.in_rows(seq, n)]
        if rows:
            self.prefill_rows(rows)
        for seq, n in plan.pieces:
            if any(seq is other for other, _ in rows):
                continue
            try:
                self.prefill_piece(seq, n)
            except BudgetError as exc:  # a handle's `first` takes blocks of its own
                return finished + self.out_of_blocks(exc)
            except TinyLoopError as exc:  # its own fault (a handle freed before its prefill): it fails alone
                finished.append(self.fail(seq, exc))
        for seq in plan.driven:
            seq.place.decided = seq.driver.step(self.lane(seq.place.lane))
        group = plan.rows
        if not group:
            return finished
        if log.isEnabledFor(logging.DEBUG):  # (its arguments cost a few us per step)
            log.debug("step %d: decode %d lane(s) at loops %s: #%s", self.steps, len(group),
                      ",".join(str(s.loops) for s in group), ",".join(str(s.place.arrival) for s in group))
        if self.iterative and self.by_iteration(group):
            return finished + self.iterate(group)
        view = self.cache.select([s.place.lane for s in group])
        t = time.perf_counter()
        try:
            out, used = self.decode([s.token for s in group], [s.pos - s.place.prompt_row for s in group], view,
                                    [s.loops for s in group], [s.exit for s in group])
        except BudgetError as exc:
            return finished + self.out_of_blocks(exc)
        finally:
            view.commit()
        if len(group) == 1 and group[0].driver is not None:
            group[0].driver.plain_row(time.perf_counter() - t)
        for r, seq in enumerate(group):
            self.token_done(seq, out[r], used[r])
        return finished

    def postprocess(self) -> list[Sequence]:
        """Every lane with fresh logits takes its next token (one pass of the sampler for all of them) and every beam
        request chooses its next beam; returns the requests that finished. A fault while one request samples,
        matches stops, advances its grammar or streams fails that request alone (seq.error); the others go on."""
        finished = []
        for seq in [s for s in self.admitted if s.place.drawn]:  # the C passes' greedy draws (iterate_in_c), in turn
            drawn, seq.place.drawn = seq.place.drawn, []
            for i, token in enumerate(drawn):
                ended = self.ended(seq, self.guarded(seq.take, token))
                if ended is not None:  # (a stop sequence: the draws after it, and their loop counts, go)
                    unused = len(drawn) - 1 - i + (seq.place.logits is not None)
                    del seq.loop_counts[len(seq.loop_counts) - unused:]
                    seq.place.logits = None
                    finished.append(ended)
                    break
        fresh = [s for s in self.admitted if s.place.logits is not None and s.beam is None]
        try:
            tokens: list = Sequence.sample_all(fresh, [s.place.logits for s in fresh]) if fresh else []
        except Exception:  # noqa: BLE001 (a lane's own fault broke the shared pass: draw each alone to find it)
            tokens = [self.guarded(s.sample, s.place.logits) for s in fresh]
        drawn = [(s, t) for s, t in zip(fresh, tokens) if not isinstance(t, Exception)]
        Sequence.score_all([s for s, _ in drawn], [s.place.logits for s, _ in drawn], [t for _, t in drawn])
        for seq, token in zip(fresh, tokens):
            seq.place.logits = None
            ended = self.ended(seq, token if isinstance(token, Exception) else self.guarded(seq.take, token))
            if ended is not None:
                finished.append(ended)
        for seq in [s for s in self.admitted if s.place.decided]:  # a driver's round decided these: take them in turn
            decided, seq.place.decided = seq.place.decided, []
            if seq.cfg.logprobs is not None:  # each under the verified logits it was chosen from
                Sequence.score_all([seq] * len(decided), list(seq.driver.chosen_from), decided)
            for token in decided:
                ended = self.ended(seq, self.guarded(seq.take, token))
                if ended is not None:
                    finished.append(ended)
                    break
            else:
                seq.pos += len(decided)
        for group in self.groups():  # beam requests: their members' logits choose the next beam
            if any(m.place.logits is None for m in group.members):
                continue  # (a member's token still loops)
            old = group.members
            new = self.guarded(group.advance, self.cache)
            if isinstance(new, Exception):
                finished.append(self.fail(group.root, new))
                continue
            at = self.admitted.index(old[0])
            self.admitted[at:at] = new
            for seq in old:
                self.admitted.remove(seq)
            if group.outcome is not None:
                self.release(group.root)
                finished.append(group.root)
        return finished

    def ended(self, seq: Sequence, alive: object) -> Sequence | None:
        """After a take (its result, or the exception it raised): the request if it ended, its lane given back (a
        fault of its own fails it alone), else None."""
        if isinstance(alive, Exception):
            return self.fail(seq, alive)
        if not alive:
            self.release(seq)
            return seq
        return None

    @staticmethod
    def guarded(fn: Callable, *args: object) -> object:
        """fn(*args), or the exception it raised (a request's own fault, answered to that request alone)."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001
            log.warning("a request failed in its own postprocess: %s: %s", type(exc).__name__, exc)
            return exc

    def fail(self, seq: Sequence, exc: Exception) -> Sequence:
        """Give a request up on a fault of its own; its blocks go back at once."""
        root = seq.beam.root if seq.beam is not None else seq
        root.error = exc
        root.cancel()
        if root.beam is not None:
            root.beam.cancel()
        self.release(root)
        return root

    def fail_step(self, plan: Plan, exc: Exception) -> list[Sequence]:
        """A forward of the step failed on no request's account: every request whose lane it ran (a prefill piece, a
        decode row, a driven round) fails with a ForwardError (or the runtime's own refusal, a TinyLoopError, as it
        is), its lanes and their half-written cells given back; the waiting ones and lanes the step did not run go
        on."""
        log.error("step %d: a shared forward failed (%s: %s); its %d lane(s) fail", self.steps, type(exc).__name__,
                  exc, len(plan.pieces) + len(plan.rows) + len(plan.driven))
        error = exc  # the runtime refusing what the lanes ask (a ModeError of the model's): that, not a fault
        if not isinstance(exc, TinyLoopError):
            error = ForwardError(f"a forward this request shared with others failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        failed: list[Sequence] = []
        for seq in [s for s, _ in plan.pieces] + plan.rows + plan.driven:
            root = seq.beam.root if seq.beam is not None else seq
            if root.error is None and not any(root is f for f in failed):
                failed.append(self.fail(root, error))
        return failed

    def groups(self) -> list[BeamGroup]:
        """The beam-search requests holding lanes, oldest first."""
        return list({id(s.beam): s.beam for s in self.admitted if s.beam is not None}.values())

    # --- continuous-depth batching: a step is one loop iteration of every row ------------------------------------
    def by_iteration(self, rows: list[Sequence]) -> bool:
        """Whether this step's rows advance by loop iterations: a token is in flight, or the rows' depths differ, or
        one may exit early, or every row draws its next tokens in C (one call then runs several tokens of each row,
        where a token step runs one: greedy decoding at fixed depth 1.1-1.25x faster at batch 1). Otherwise, all at
        one fixed depth, one forward of every loop per step does the same work in fewer calls."""
        return any(s.place.token is not None for s in rows) or len({s.loops for s in rows}) > 1 \
            or any(self.is_adaptive(s.exit) for s in rows) \
            or self.may_run_ahead() and all(map(self.draws_plainly, rows)) and self.c.passes(len(rows)) is not None

    def iterate(self, rows: list[Sequence]) -> list[Sequence]:
        """Loop iterations of every row until some row's token is done: that lane samples at this step's
        postprocess and starts its next token at the next step, while deeper lanes keep looping. Between two passes
        where no token ends there is nothing to schedule (no lane frees, nothing is sampled), so they run in one
        step: at batch 1 a token is one step, as at fixed depth. Where every row's exit rule can be decided in C,
        the passes and their exit decisions are one C call (`iterate_in_c`); otherwise one forward per pass
        (`one_pass`) with the decisions here."""
        if not self.iterate_in_c(rows):
            while not self.one_pass(rows):
                pass
        return []

    def iterate_in_c(self, rows: list[Sequence]) -> bool:
        """The passes of `iterate` as one C call (CBackend.iterate) where the C step runs the model over this cache and
        C decides every row's exit rule (a loop count, the latent rule with the exit gate, a forced depth, Ouro's
        cdf), the greedy rows drawing up to `ahead` tokens inside it. False (nothing run) where the rows need
        `one_pass`."""
        ended = self.c.iterate(rows, [self.is_adaptive(seq.exit) for seq in rows], self.ahead)
        if ended is None:
            return False
        for seq, logits, used in ended:
            self.token_done(seq, logits, used)
        return True

    def may_run_ahead(self) -> bool:
        """Whether rows may draw tokens inside a C call now: not while other work waits for a lane or a prefill (a
        call that runs ahead would hold it back)."""
        return self.options.run_ahead and not any(self.prefilling(s) for s in self.admitted) \
            and not (self.waiting and self.free_lanes)

    @staticmethod
    def draws_plainly(seq: Sequence) -> bool:
        """Whether seq's next token is a plain argmax that C can draw: a plain decode row (no beam, speculative
        driver, grammar or prompt row), greedy, with no penalty, bias or banned token, past min_tokens, asking no
        log-probabilities (a token drawn in C brings no logits back)."""
        c = seq.cfg
        return seq.beam is None and seq.driver is None and seq.grammar is None and not seq.place.prompt_row \
            and c.logprobs is None and c.temperature < MIN_TEMPERATURE and c.repetition_penalty == 1.0 \
            and seq.count >= c.min_tokens and not seq.sampling().adjusts

    def ahead(self, rows: list[Sequence], cells: list[int], positions: int) -> list[list[float]]:
        """How many tokens each row may draw inside the C call (`iterate_in_c`), as the forced depths of those tokens
        (each row's exit threshold where it has no schedule): none while other work waits for a lane or a prefill
        (a C call that runs ahead would hold it back), or for a row whose draw is not a plain argmax (sampling, a
        penalty, a bias, a grammar, banned tokens) or that is not a plain decode row; up to the end of the cell's
        block (reserved), one token before the request's max_tokens (its last token returns to the sampler, and its
        lane frees at that step) and the cache."""
        if not self.may_run_ahead():
            return [[] for _ in rows]
        bt, ahead = self.cache.bt, []
        for seq, cell in zip(rows, cells):
            c = seq.cfg
            n = min(self.c.max_draws, bt - 1 - cell % bt, c.max_tokens - seq.count - 1,
                    min(self.cache.cells, positions) - 1 - cell) if self.draws_plainly(seq) else 0
            schedule = c.exit_schedule
            ahead.append([float(schedule[(seq.count + 1 + i) % len(schedule)]) if schedule else 0.0
                          for i in range(max(0, n))])
        return ahead

    def one_pass(self, rows: list[Sequence]) -> bool:
        """One loop iteration of every row in one forward (engine/iteration.py): a row without a token in flight
        starts its next one (prelude and loop 0), the others run their next loop, each at its own loop index; a token
        whose loops are done (its loop count, or its exit rule fired) gets its logits. An exited token's skipped
        loops get copies of its last loop's K/V (the family's exit_kv "copy"; "compute" runs them and keeps the exit
        state's logits). True when some row's token is done."""
        net, dev = self.net, self.model.device
        starting = [s.place.token is None for s in rows]
        for seq, new in zip(rows, starting):
            if new:
                fresh, adaptive = paged.Latent.empty(1, 1, net), self.is_adaptive(seq.exit)
                seq.place.token = InFlight(0, fresh.e, fresh.s, adaptive, used=seq.loops)
        flights = [s.place.token for s in rows]
        for f in flights:
            self.c.track_of(f)  # its last passes ran in C (iterate_in_c): its rule's state as a Track
        latent = paged.Latent(torch.cat([f.e for f in flights]), torch.cat([f.s for f in flights]))
        adaptive = [b for b, f in enumerate(flights) if f.adaptive]
        before = latent.s[adaptive].clone() if adaptive else None
        # a fixed-depth token's last pass ends with its coda and head in the same call
        finish = [not f.adaptive and f.done + 1 == s.loops for s, f in zip(rows, flights)]
        positions = [s.pos - s.place.prompt_row for s in rows]
        logits = iteration.iterate(net, self.cache, positions, [f.done for f in flights],
                                   [s.token if new else None for s, new in zip(rows, starting)], finish, latent,
                                   lanes=[s.place.lane for s in rows])
        heads = iter(logits)
        for b, (seq, f) in enumerate(zip(rows, flights)):
            f.e, f.s, f.done = latent.e[b:b + 1], latent.s[b:b + 1], f.done + 1
            if finish[b]:
                self.token_done(seq, next(heads), seq.loops)
        if adaptive:
            for i, b in enumerate(adaptive):
                if starting[b]:  # the state loop 0 started from: the initial state of its prelude output
                    at = torch.tensor([[positions[b]]], device=dev)
                    before[i:i + 1] = net.init_state(flights[b].e, net.make_step(at, positions[b] + 1))
            ended = self.exits([rows[b] for b in adaptive], before, latent.s[adaptive])
            if ended:
                self.exit_heads(ended)
        return any(s.place.logits is not None for s in rows)

    def exits(self, rows: list[Sequence], s_old: torch.Tensor, s_new: torch.Tensor) -> list[Sequence]:
        """The exit rule of every early-exit row after its pass, in one go (exits.exit_stops, what model.ExitState
        does for a token); a rule that reads logits (Huginn's) gets this loop's, from the coda and head of the rows
        whose exit is not yet chosen. Returns the rows whose token's loops are done."""
        net, dev = self.net, s_new.device
        flights = [s.place.token for s in rows]
        reading = [i for i, (s, f) in enumerate(zip(rows, flights)) if s.exit.reads_logits and not f.chosen]
        logits = None
        if reading:
            logits = torch.zeros(len(rows), net.cfg.vocab_size, device=dev)
            logits[reading] = self.heads([rows[i] for i in reading], s_new[reading]).float()
        last = torch.tensor([[f.done == s.loops] for s, f in zip(rows, flights)], device=dev)
        track = None  # (only the rules that remember something between loops keep a Track)
        if any(s.exit.rule in TRACKED for s in rows):
            track = Track.cat([f.track if f.track is not None else Track.start(1, 1, net.cfg.vocab_size, dev)
                               for f in flights])
        stop = exit_stops(net, [s.exit for s in rows], [f.done for f in flights], last, s_old, s_new, track, logits)
        stop = stop.all(dim=1).tolist()
        ended = []
        for i, (seq, f, row, stops) in enumerate(zip(rows, flights, s_new, stop)):
            if track is not None:
                f.track = track.rows(torch.tensor([i], device=dev))
            if not f.chosen:
                f.out = row.unsqueeze(0).clone()
                if stops and i in reading:  # (its coda K/V are this loop's: they stay, with no head run again)
                    f.logits = logits[i]
            f.chosen |= stops
            if stops and f.used == seq.loops and f.done < seq.loops:
                f.used = f.done
            if f.done == seq.loops or f.used <= f.done and net.cfg.exit_kv == "copy":
                ended.append(seq)
        return ended

    def heads(self, rows: list[Sequence], s: torch.Tensor) -> torch.Tensor:
        """Logits [len(rows), V] of the rows' tokens from states s [len(rows), 1, d]: their coda and head, in one
        forward (it writes their coda K/V)."""
        net, dev = self.net, self.model.device
        view = self.cache.select([r.place.lane for r in rows])
        positions = torch.tensor([[r.pos - r.place.prompt_row] for r in rows], device=dev)
        latent = paged.Latent(torch.cat([r.place.token.e for r in rows]), s.contiguous())
        try:
            return paged.forward_loops(net, net.make_step(positions, int(positions.max()) + 1), view, 0, 0,
                                        latent)[:, -1]
        finally:
            view.commit()

    def exit_heads(self, rows: list[Sequence]) -> None:
        """Early-exit tokens whose loops are done take their logits: from the state they exited with, by one coda and
        head forward (or the logits their rule read at that loop); their skipped loops' K/V are copied from the last
        loop they ran."""
        if self.model.cfg.exit_kv == "copy":
            for seq in rows:
                self.cache.fill_skipped(seq.place.lane, seq.pos - seq.place.prompt_row, seq.place.token.used, seq.loops)
        unread = [s for s in rows if s.place.token.logits is None]
        logits = iter(self.heads(unread, torch.cat([s.place.token.out for s in unread])) if unread else [])
        for seq in rows:
            flight = seq.place.token
            self.token_done(seq, flight.logits if flight.logits is not None else next(logits), flight.used)

    def token_done(self, seq: Sequence, logits: torch.Tensor, used: int) -> None:
        """A fed token's forward is done (a decode row, or its last loop iteration): its logits are the lane's fresh
        logits."""
        seq.place.token = None
        if seq.place.prompt_row:  # its prompt is in: what the end of a prefill does
            seq.place.prompt_row, seq.t_prefilled = False, time.perf_counter()
            if self.prefixes is not None:
                self.prefixes.keep(seq.prompt, seq.loops, self.lane(seq.place.lane))
        else:
            seq.pos += 1
        seq.loop_counts.append(used)
        seq.place.logits = logits

    def out_of_blocks(self, exc: BudgetError) -> list[Sequence]:
        """Preempt the youngest request none of whose lanes holds fresh logits (they would be lost); a beam request
        goes with all its hypotheses. Alone, it is given up."""
        units: dict[int, tuple[Sequence, list[Sequence]]] = {}  # request (a beam's root) -> the lanes it holds
        for seq in self.admitted:
            root = seq.beam.root if seq.beam is not None else seq
            units.setdefault(id(root), (root, []))[1].append(seq)
        victims = [root for root, lanes in units.values() if all(s.place.logits is None for s in lanes)]
        if len(units) == 1 or not victims:
            return [self.fail(self.admitted[-1], exc)]
        self.preempt(victims[-1])
        return []

    def admit(self) -> None:
        """Give waiting sequences a lane, in admission_order, while the pool has room for them (with nothing admitted
        one is tried anyway: a pool that cannot hold it ends it with a BudgetError)."""
        pool, window, cfg = self.cache.pool, self.cache.ring, self.model.cfg
        if self.hold_back and self.admitted:
            return  # after a preemption sequences rejoin only once a running one has finished (no thrashing)
        self.hold_back = False
        while self.waiting and len(self.free_lanes) >= self.waiting[0].cfg.beam_size:
            seq = self.waiting[0]
            # its blocks now, and room for every admitted lane (a beam request's every lane) to cross into a new block
            # on the next step
            need = blocks_for(cfg, len(seq.prompt) + seq.count + 1, seq.loops, window) + \
                sum(cfg.n_slots(s.loops) for s in self.admitted) + seq.cfg.beam_size * cfg.n_slots(seq.loops)
            if self.admitted and need > pool.room():
                log.debug("step %d: #%d waits: needs %d blocks, %d free", self.steps, seq.place.arrival, need,
                          pool.room())
                return
            self.waiting.pop(0)
            seq.place.lane = self.free_lanes.pop(0)
            rebuilt = [seq]  # the sequences whose lanes a preempted request had (a beam's live hypotheses)
            if seq.beam is not None:
                seq.beam.lanes = [seq.place.lane] + [self.free_lanes.pop(0) for _ in range(seq.cfg.beam_size - 1)]
                if seq.beam.live:
                    rebuilt = seq.beam.members
                    for member, lane in zip(rebuilt, seq.beam.lanes):
                        member.place = Place(lane=lane, arrival=seq.place.arrival)
            self.admitted += rebuilt
            log.debug("step %d: admit #%d into lane %d (%d prompt tokens, %d loops; %d blocks free)", self.steps,
                      seq.place.arrival, seq.place.lane, len(seq.prompt), seq.loops, pool.room())
            if rebuilt != [seq]:
                try:
                    self.recompute_beam(rebuilt)
                except BudgetError as exc:
                    self.out_of_blocks(exc)
                    return
            elif seq.count:
                try:
                    self.recompute(seq)
                except BudgetError as exc:
                    self.out_of_blocks(exc)
                    return

    def recompute(self, seq: Sequence) -> None:
        """Rebuild a preempted sequence's cache with the forwards that first built it: the prompt's chunks, then
        each token it has fed one at a time; the token it was about to feed (seq.token) comes next."""
        cache = self.lane(seq.place.lane)
        self.reserve([seq], [0], [len(seq.history) - 2])  # the prompt and every token it fed
        for start in range(0, len(seq.prompt), self.chunk or len(seq.prompt)):
            self.prefill(seq.prompt[start:start + (self.chunk or len(seq.prompt))], start, seq.place.lane, seq.loops,
                         seq.exit)
        seq.place.cached = len(seq.prompt)
        fed = seq.history[len(seq.prompt):-1]
        if self.iterative and self.is_adaptive(seq.exit):  # its tokens exited as loop iterations decided: again
            pending, pos, counts = seq.token, seq.pos, list(seq.loop_counts)
            seq.pos = len(seq.prompt)
            for token in fed:
                seq.token = token
                self.iterate([seq])
                seq.place.logits = None
            seq.token, seq.pos, seq.loop_counts = pending, pos, counts
            return
        for j, token in enumerate(fed):
            self.decode([token], [len(seq.prompt) + j], cache, seq.loops, seq.exit)

    def recompute_beam(self, members: list[Sequence]) -> None:
        """Rebuild a preempted beam request's lanes: its prompt's chunks once, shared by every hypothesis's lane
        (copy-on-write), then each hypothesis's own tokens one at a time, as they were first fed."""
        first, P = members[0], len(members[0].prompt)
        self.reserve([first], [0], [P - 1])
        for start in range(0, P, self.chunk or P):
            self.prefill(first.prompt[start:start + (self.chunk or P)], start, first.place.lane, first.loops,
                         first.exit)
        self.cache.assign_lanes([m.place.lane for m in members[1:]], [first.place.lane] * (len(members) - 1))
        fed = [m for m in members if len(m.history) - 2 >= P]
        self.reserve(fed, [P] * len(fed), [len(m.history) - 2 for m in fed])  # (copy-on-write of a shared block)
        for m in members:
            m.place.cached = P
            for j, token in enumerate(m.history[P:-1]):
                self.decode([token], [P + j], self.lane(m.place.lane), m.loops, m.exit)

    def preempt(self, seq: Sequence) -> None:
        log.debug("step %d: pool exhausted: preempt #%d (lane %d, %d tokens to recompute)", self.steps,
                  seq.place.arrival, seq.place.lane, len(seq.history))
        arrival, came = seq.place.arrival, seq.place.came
        self.release(seq)  # (a beam request: every lane it holds)
        for member in ([seq] if seq.beam is None else [seq, *seq.beam.members]):
            member.place = Place(arrival=arrival, came=came)  # recomputed from its prompt (and tokens) when it rejoins
        seq.stats.preempted += 1
        self.waiting.append(seq)
        self.waiting.sort(key=admission_order)
        self.hold_back = True

    def release(self, seq: Sequence) -> None:
        """Take a sequence out of the runner; its lane's blocks go back to the pool at once (a beam request: every
        lane it holds)."""
        if seq.beam is not None and seq is seq.beam.root and seq.beam.lanes:
            self.admitted = [s for s in self.admitted if s.beam is not seq.beam]
            for lane in seq.beam.lanes:
                self.lane(lane).reset()
            self.free_lanes = sorted(self.free_lanes + seq.beam.lanes)
            seq.beam.lanes, seq.place.lane, self.hold_back = [], None, False
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.admitted:
            if self.prefixes is not None and seq.done and not self.is_adaptive(seq.exit) and seq.place.cached \
                    and seq.cacheable:
                # (not at adaptive depth: its decode fills skipped loops by copies)
                self.prefixes.keep(seq.history, seq.loops, self.lane(seq.place.lane))
            if seq.done:
                log.debug("step %d: #%d done (%s, %d tokens): lane %d and its blocks free", self.steps,
                          seq.place.arrival, seq.stop_reason, seq.count, seq.place.lane)
            self.admitted.remove(seq)
            self.lane(seq.place.lane).reset()
            self.free_lanes.append(seq.place.lane)
            self.free_lanes.sort()
            if seq.done:
                self.hold_back = False
        seq.place.lane = None

    # --- in-process calls -------------------------------------------------------------------------------------
    def run(self, seqs: list[Sequence], cached: int = 0, first: Start | None = None, raise_errors: bool = True
            ) -> list:
        '''Take every sequence from its prompt to its result: add them all, then step until none is left. A sequence
        given up raises its error (raise_errors), or has it in its place among the results.'''
        for seq in seqs:
            self.add(seq, cached, first)
        while not self.idle:
            for seq in self.step():
                if seq.error is not None and raise_errors:
                    raise seq.error
        return [seq.result() if seq.error is None else seq.error for seq in seqs]
