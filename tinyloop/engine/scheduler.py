"""Scheduler: which requests hold lanes, and what each runs in a step. It alone takes and frees blocks.

`schedule` admits waiting sequences (oldest first; of those that came together, the deepest and longest first:
admission_order) while a lane is free (a beam request: beam_size lanes) and the pool's free blocks cover them (a
preempted sequence is rebuilt here, exactly); then it makes the step's plan (engine/plan.py), plain data: pieces of
admitted prompts, the shortest rest first, up to `chunk` prompt tokens in all (a piece never crosses a multiple of
`chunk`, so a prompt is cut at the same places alone or in a batch: the same forwards); the running lanes' decode
rows, each with its loop count, exit rule and the greedy tokens it may draw inside a C call; and the lanes whose
driver (Sequence.driver: a speculative round, a refine's verified piece) runs its own forwards. Then it takes every
block they will write (`reserve`), so the forwards take none. When the pool is exhausted, the youngest sequence
without fresh logits gives its blocks back and waits (preemption); waiting sequences rejoin only after a running one
finishes (no thrashing).

This is the engine's scheduler; `tinyloop.Scheduler` (tinyloop/batch.py) is the serving front over a Runner.
"""
from __future__ import annotations

import logging
import time

from ..cache import KVCache
from ..errors import BudgetError, TinyLoopError
from ..memory import blocks_for
from .beam import BeamGroup
from .executor import Executor
from .plan import Piece, Plan, Row
from .sequence import ENGINE_PREFIXES, BeamRequest, Place, Sequence, Start

# Every decision at DEBUG level, one line each: admit, prefill piece, decode group, finish, preempt (docs/engine.md).
log = logging.getLogger("tinyloop.scheduler")


def admission_order(seq: Sequence) -> tuple[int, int, int, int]:
    """The order waiting sequences take lanes in: the most important first (GenerateConfig.priority, lower first, as
    vLLM's priority policy); among equals, those that came earlier first; of those that came together (between
    the same two steps, such as a generate_batch call's prompts), the most loop iterations first (loops x max_tokens
    x beam_size), so that no deep request starts last and runs alone at the end while the shallow ones are long done
    (the longest-processing-time rule); among equals, the order they came in."""
    work = seq.loops * seq.cfg.max_tokens * seq.cfg.beam_size
    return seq.cfg.priority, seq.place.came, -work, seq.place.arrival


def draws_plainly(seq: Sequence) -> bool:
    """Whether C can draw seq's next tokens: the sampler says its choice is a plain argmax (LaneSampling.plain_argmax:
    greedy, no penalty, bias, banned token or grammar; C's argmax is sampling.greedy_choice's rule), in a plain decode
    row (no beam or speculative driver, not the prompt's row), past min_tokens (so the tokens it draws ahead are
    under the same rule). One asking for log-probabilities draws there too: C brings back the logits of each draw
    (Row.keep_logits), and they are scored as a token chosen here is (Sequence.score_all)."""
    return seq.beam is None and seq.driver is None and not seq.place.prompt_row \
        and seq.count >= seq.cfg.min_tokens and seq.sampling().plain_argmax


class Scheduler:
    def __init__(self, model, cache: KVCache, executor: Executor, chunk: int | None = None):
        self.model, self.cache, self.executor = model, cache, executor
        self.fixed_chunk = chunk  # None: the model's prefill_chunk, read at each use (0: a prompt whole)
        self.free_lanes = list(range(cache.lanes))
        self.waiting: list[Sequence] = []   # without a lane (new or preempted), in admission_order
        self.admitted: list[Sequence] = []  # holding a lane, in admission order: the youngest last
        self.hold_back = False  # set by a preemption, cleared when a sequence finishes
        self.arrivals = self.steps = 0
        self.reserved: dict[int, tuple] = {}  # lane -> what `reserve` took for it last
        self.reserved_epoch = -1  # the pool's epoch after that

    @property
    def chunk(self) -> int:
        return self.model.prefill_chunk if self.fixed_chunk is None else self.fixed_chunk

    @property
    def prefixes(self):
        """The automatic prefix cache (None: the model's prefix caching is off)."""
        return self.model.prefixes if self.model.prefix_caching else None

    def prefix_cache(self, seq: Sequence):
        """The prefix cache seq reads its prompt from and adds its blocks to: its own choice (Sequence.prefix_cache:
        None, or a lookup-only view), else the automatic one."""
        return self.prefixes if seq.prefix_cache is ENGINE_PREFIXES else seq.prefix_cache

    def chunk_of(self, seq: Sequence) -> int:
        return 0 if seq.whole_prompt else self.chunk

    def lane(self, i: int) -> KVCache:
        return self.executor.lane(i)

    def by_lane(self) -> dict[int, Sequence]:
        """The admitted sequences by lane (what a plan names them by)."""
        return {s.place.lane: s for s in self.admitted}

    # --- queues ------------------------------------------------------------------------------------------------
    def add(self, seq: Sequence, cached: int = 0, first: Start | None = None) -> None:
        """Queue a sequence; it joins the running batch at a step boundary. `first`: the prompt's first `cached`
        tokens come from a handle instead of a prefill."""
        seq.place = Place(cached=cached, first=first, arrival=self.arrivals, came=self.steps)
        if seq.cfg.beam_size > 1 and seq.beam is None:
            seq.beam = BeamGroup(seq)  # it takes beam_size lanes when admitted
        self.arrivals += 1
        self.waiting.append(seq)
        self.waiting.sort(key=admission_order)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.admitted

    def groups(self) -> list[BeamRequest]:
        """The beam-search requests holding lanes, oldest first."""
        return list({id(s.beam): s.beam for s in self.admitted if s.beam is not None}.values())

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

    # --- the plan ----------------------------------------------------------------------------------------------
    @staticmethod
    def prefilling(seq: Sequence) -> bool:
        return seq.place.logits is None and (seq.place.cached < len(seq.prompt) or seq.place.first is not None)

    def piece_len(self, seq: Sequence) -> int:
        """Prompt tokens seq's next prefill forward runs: up to the next multiple of the chunk, whatever else runs,
        so a prompt is cut at the same places alone or in a batch."""
        at = seq.place
        n, chunk = len(seq.prompt) - at.cached, self.chunk_of(seq)
        return min(n, chunk - at.cached % chunk) if chunk and at.first is None else n

    def schedule(self, finished: list[Sequence]) -> Plan:
        """Decide what this step's forwards run and take their blocks: admit waiting sequences; pieces of admitted
        prompts, the shortest rest first, up to `chunk` prompt tokens in all; the running lanes' decode rows, and the
        lanes whose driver runs its own forwards this step (it decodes alone, or a sampled speculative lane). When
        the pool runs out, a sequence is preempted (or given up: appended to `finished`) and the step goes on with
        what it has."""
        self.admit()
        plan, budget, spent = Plan(self.steps), self.chunk or float("inf"), 0
        scheduled: set[int] = set()  # lanes with a piece in this step
        # shortest rest first: a newcomer's short prompt is not stuck behind the pieces of an older long one
        prefilling = (s for s in self.admitted if self.prefilling(s))
        for seq in sorted(prefilling, key=lambda s: len(s.prompt) - s.place.cached):
            if spent and spent + self.piece_len(seq) > budget:
                continue  # it waits for a later step, so decode rows are not stalled behind long prompts
            if self.shares_a_new_prefix(seq, plan):
                continue  # the next step finds the blocks this one fills in the prefix cache
            try:
                piece = self.begin_prefill(seq)
            except BudgetError as exc:
                finished += self.out_of_blocks(exc)
                return self.still_admitted(plan)
            except TinyLoopError as exc:  # its own fault (a cached prefix it cannot take): it fails alone
                finished.append(self.fail(seq, exc))
                continue
            spent += len(piece.tokens) if piece is not None else 1
            if piece is not None:
                piece.keep_latent = seq.latents is not None  # (a resume handle's build: Sequence.latents)
                piece.keep_rows = piece.handle is None and seq.rows_wanted(piece.start, len(piece.tokens))
                plan.pieces.append(piece)
                scheduled.add(seq.place.lane)
        looping = self.executor.flights
        group = sorted((s for s in self.admitted if s.place.logits is None and not self.prefilling(s)
                        and s.place.lane not in scheduled), key=lambda s: s.place.lane)
        alone = len(group) == 1
        # (a prompt's last token, left by the prefix cache, is a row of its own: its logits start the output)
        driven = [s for s in group if s.driver is not None and not s.place.prompt_row and s.place.lane not in looping
                  and s.driver.runs(alone)]
        # a speculative chain beside other rows: its drafts before the step's forward, their chunk rows of it
        drafting = []
        for s in group:
            if s not in driven and s.driver is not None and not s.place.prompt_row and s.place.lane not in looping:
                s.place.drafter = s.driver.drafter(alone)
                if s.place.drafter is not None:
                    drafting.append(s)
        rows = [s for s in group if s not in driven and s not in drafting]
        own = driven + drafting
        spans = [s.driver.span() for s in own if s.driver is not None]  # (all of them)
        cells = [s.pos - s.place.prompt_row for s in rows]  # (a prompt row feeds the prompt's last position)
        # (no greedy run-ahead beside a drafting lane: rows drawing many tokens a call would leave its rounds behind)
        ahead = self.may_run_ahead(plan) and not drafting
        greedy = [ahead and draws_plainly(s) for s in rows]
        draws = [self.draws(s) if g else 0 for s, g in zip(rows, greedy)]
        firsts, own_lasts = cells + [s.pos for s in own], [s.pos + n - 1 for s, n in zip(own, spans)]
        try:
            try:  # the cells a row's draws move on to are taken too: its draws need not stop at the end of a block
                self.reserve(rows + own, firsts, [c + n for c, n in zip(cells, draws)] + own_lasts)
            except BudgetError:
                if not any(draws):
                    raise
                # no room for the next blocks yet: a row draws up to the end of its cell's block
                log.debug("step %d: no room for the blocks of greedy draws beyond their cells' blocks", self.steps)
                draws = [min(n, self.cache.bt - 1 - c % self.cache.bt) for c, n in zip(cells, draws)]
                self.reserve(rows + own, firsts, [c + n for c, n in zip(cells, draws)] + own_lasts)
        except BudgetError as exc:
            finished += self.out_of_blocks(exc)
            return self.still_admitted(plan)
        plan.rows = [self.row(s, g, n) for s, g, n in zip(rows, greedy, draws)]
        plan.driven = [s.place.lane for s in driven]
        plan.drafting = [s.place.lane for s in drafting]
        return plan

    def draws(self, seq: Sequence) -> int:
        """The greedy tokens a row that may run ahead draws inside a C call after its own: up to `max_draws`, and one
        token before max_tokens (its last token returns to the sampler, and its lane frees at that step)."""
        return min(self.executor.c.max_draws, seq.cfg.max_tokens - seq.count - 1)

    def row(self, seq: Sequence, greedy: bool, n: int) -> Row:
        """seq's decode row: the token it feeds, where, its loops and exit rule, whether its next token is a plain
        argmax that C may draw (greedy), and the n greedy tokens it draws inside a C call after it (their cells
        reserved), as their forced depths (each its exit threshold where it has no schedule)."""
        c = seq.cfg
        if seq.place.prompt_row:  # the prompt's last token: at its asked depth, as a prefill piece
            rule = seq.prefill_exit
        else:
            # (a lane with a depth range: its cap now, noted for each token)
            seq.plan_depths(1 + n, seq.place.lane in self.executor.flights)
            rule = seq.exit
        draws = [float(d) if (d := seq.forced_depth(seq.count + 1 + i)) is not None else 0.0 for i in range(n)]
        return Row(seq.place.lane, seq.token, seq.pos - seq.place.prompt_row, seq.loops, rule,
                   self.executor.is_adaptive(rule), greedy, draws, c.ignore_eos,
                   keep_logits=greedy and c.logprobs is not None)

    def may_run_ahead(self, plan: Plan) -> bool:
        """Whether rows may draw tokens inside a C call in this step: not while other work waits for a lane or a
        prefill after the plan's pieces (a call that runs ahead would hold it back)."""
        by_lane = self.by_lane()
        done = {p.lane for p in plan.pieces if p.handle is not None or p.start + len(p.tokens) == len(by_lane[p.lane].prompt)}
        return self.executor.options.run_ahead and not (self.waiting and self.free_lanes) \
            and not any(self.prefilling(s) and s.place.lane not in done for s in self.admitted)

    def still_admitted(self, plan: Plan) -> Plan:
        """The plan less the work of requests preempted while it was made (no decode rows: the step goes on with its
        pieces)."""
        lanes = {s.place.lane for s in self.admitted}
        plan.pieces = [p for p in plan.pieces if p.lane in lanes]
        return plan

    def begin_prefill(self, seq: Sequence) -> Piece | None:
        """Schedule seq's next prefill piece: lend it the longest cached prefix of its prompt first (a new prompt), and
        take the blocks the piece writes. A prompt the cache holds but for its last token runs no piece (None): that
        token becomes a row of this step's decode forward (Place.prompt_row)."""
        t, at = time.perf_counter(), seq.place
        prefixes = self.prefixes_for(seq)
        whole = False
        if at.first is None and not at.cached and prefixes is not None:
            hit = self.reuse(prefixes, seq)  # the longest cached prefix's blocks, its rest's cells taken
            if hit and hit == len(seq.prompt) - 1 and not self.executor.is_adaptive(seq.prefill_exit):
                # Only the prompt's last token is left: it goes in as a row of this step's decode forward (the same
                # forward at that position) instead of a forward of its own, which costs about a decode step of a
                # few lanes (a large share of a worker's time under repeated prompts).
                log.debug("step %d: #%d joins the decode rows (%d prompt tokens cached, lane %d)", self.steps,
                          at.arrival, len(seq.prompt) - 1, at.lane)
                at.cached, at.prompt_row = len(seq.prompt), True
                seq.stats.prefill_ms += (time.perf_counter() - t) * 1000
                return None
            whole = bool(hit)  # the rest is prefilled at every loop as one chunk (what generate's prefill does there)
        n = len(seq.prompt) - at.cached if whole else self.piece_len(seq)
        handle = at.first
        if handle is not None:  # a handle lends its blocks now; the cells the rest writes are taken with them
            lane = self.lane(at.lane)
            writes = handle.lend(lane)
            if writes is not None:
                slots, lo, hi = writes
                lane.take_blocks([(slot, [0], [lo], [hi]) for slot in slots])
            at.first = None
        elif n:
            self.reserve([seq], [at.cached], [at.cached + n - 1])
        seq.stats.prefill_ms += (time.perf_counter() - t) * 1000
        log.debug("step %d: prefill #%d tokens %d..%d of %d (lane %d)", self.steps, at.arrival, at.cached,
                  at.cached + n, len(seq.prompt), at.lane)
        loops = seq.loops if handle is not None else seq.prompt_depth()
        return Piece(at.lane, at.cached, seq.prompt[at.cached:at.cached + n], loops, seq.prefill_exit, seq.loops,
                     whole, handle)

    def prefixes_for(self, seq: Sequence):
        """Where seq's prompt prefix may be found: its pool's scaffolds (even with prefix caching off), else the
        prefix cache; none for a windowed lane (a ring holds no prefix), nor for one asking for prompt log-probabilities
        (every prompt row's logits must come from its own prefill; it still adds its prompt to the cache for others)."""
        if seq.cfg.cache_window or seq.prompt_scores is not None:
            return None
        return seq.prefixes or self.prefix_cache(seq)

    def reuse(self, prefixes, seq: Sequence) -> int:
        """Lend the longest prefix of seq's prompt the prefix cache holds to its lane, and take the cells its rest
        writes; returns the prompt tokens it covers (0: a miss, a plain prefill follows)."""
        lane, at = seq.place.lane, seq.place
        m = prefixes.restore(seq.prompt, seq.loops, self.lane(lane))
        if not m:
            return 0
        seq.stats.prefix_hit_tokens = at.cached = m
        self.lane(lane).take_blocks([(slot, [0], [m], [len(seq.prompt) - 1])
                                     for slot in self.model.cfg.slots_written(seq.loops)])
        return m

    def shares_a_new_prefix(self, seq: Sequence, plan: Plan) -> bool:
        """Whether seq's prompt starts with a whole block of a prompt whose first piece this step runs: its lookup
        in the prefix cache comes before that piece's forward, so it waits a step and reuses it instead."""
        bt = self.cache.bt
        at = seq.place
        if at.cached or at.first is not None or self.prefixes_for(seq) is None or len(seq.prompt) <= bt:
            return False
        by_lane = self.by_lane()
        return any(p.start == 0 and p.tokens and not by_lane[p.lane].stats.prefix_hit_tokens
                   and by_lane[p.lane].prompt[:bt] == seq.prompt[:bt] for p in plan.pieces)

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
        self.executor.take_blocks(jobs)
        for s, *_, key in todo:
            self.reserved[s.place.lane] = key
        self.reserved_epoch = cache.pool.epoch

    # --- admission, preemption, release ------------------------------------------------------------------------
    def admit(self) -> None:
        """Give waiting sequences a lane, in admission_order, while the pool has room for them (with nothing admitted
        one is tried anyway: a pool that cannot hold it ends it with a BudgetError)."""
        pool, cfg = self.cache.pool, self.model.cfg
        if self.hold_back and self.admitted:
            return  # after a preemption sequences rejoin only once a running one has finished (no thrashing)
        self.hold_back = False
        while True:
            seq = self.next_within_quota()
            if seq is None or len(self.free_lanes) < seq.cfg.beam_size:
                return
            # its blocks now, and room for every admitted lane (a beam request's every lane) to cross into a new block
            # on the next step
            need = blocks_for(cfg, len(seq.prompt) + seq.count + 1, seq.loops, seq.ring) + \
                sum(cfg.n_slots(s.loops) for s in self.admitted) + seq.cfg.beam_size * cfg.n_slots(seq.loops)
            if self.admitted and need > pool.room():
                log.debug("step %d: #%d waits: needs %d blocks, %d free", self.steps, seq.place.arrival, need,
                          pool.room())
                return
            self.waiting.remove(seq)
            seq.place.lane = self.free_lanes.pop(0)
            rebuilt = [seq]  # the sequences whose lanes a preempted request had (a beam's live hypotheses)
            if seq.beam is not None:
                seq.beam.lanes = [seq.place.lane] + [self.free_lanes.pop(0) for _ in range(seq.cfg.beam_size - 1)]
                if seq.beam.live:
                    rebuilt = seq.beam.members
                    for member, lane in zip(rebuilt, seq.beam.lanes):
                        member.place = Place(lane=lane, arrival=seq.place.arrival)
            if seq.cfg.cache_window:  # its K/V in a ring of its own (the lane's KV policy)
                self.executor.attach_ring(seq.beam.lanes if seq.beam is not None else [seq.place.lane],
                                          seq.cfg.cache_window, seq.ring)
            self.admitted += rebuilt
            log.debug("step %d: admit #%d into lane %d (%d prompt tokens, %d loops; %d blocks free)", self.steps,
                      seq.place.arrival, seq.place.lane, len(seq.prompt), seq.loops, pool.room())
            if rebuilt != [seq] or seq.count:
                try:
                    self.rebuild(rebuilt)
                except BudgetError as exc:
                    self.out_of_blocks(exc)
                    return

    def next_within_quota(self) -> Sequence | None:
        """The first waiting sequence, in admission order, whose client (Runner.add) has lanes of its quota left for
        it: the others wait their turn."""
        held: dict[int, int] = {}  # id(client) -> the lanes its sequences hold (a beam's hypotheses: its root's)
        for s in self.admitted:
            if s.client is not None:
                held[id(s.client)] = held.get(id(s.client), 0) + 1
        for seq in self.waiting:
            if seq.client is None or held.get(id(seq.client), 0) + seq.cfg.beam_size <= seq.client.lanes:
                return seq
        return None

    def rebuild(self, members: list[Sequence]) -> None:
        """Rebuild a preempted request's lanes with the forwards that first built them (the executor's, the one place
        where the scheduler runs forwards: they must be in before the request's next step is planned): its prompt's
        chunks once, shared by every beam hypothesis's lane (copy-on-write), then each lane's own tokens one at a
        time, each under the exit rule it was first fed with; the token a lane was about to feed comes next."""
        first, P, ex = members[0], len(members[0].prompt), self.executor
        self.reserve([first], [0], [P - 1])
        ex.rebuild(first.place.lane, first.prompt, self.chunk_of(first), first.prompt_depth(), first.prefill_exit,
                   first.loops)
        if len(members) > 1:
            self.executor.assign_lanes([m.place.lane for m in members[1:]], [first.place.lane] * (len(members) - 1))
        fed = [m for m in members if len(m.history) - 2 >= P]
        self.reserve(fed, [P] * len(fed), [len(m.history) - 2 for m in fed])  # (copy-on-write of a shared block)
        for m in members:
            m.place.cached = P
            tokens = m.history[P:-1]
            ex.refeed(m.place.lane, tokens, P, m.loops, [m.exit_at(j + 1) for j in range(len(tokens))])

    def out_of_blocks(self, exc: BudgetError) -> list[Sequence]:
        """Preempt the least important request (the highest GenerateConfig.priority), the youngest of those, none of
        whose lanes holds fresh logits (they would be lost); a beam request goes with all its hypotheses. Alone, it is
        given up."""
        units: dict[int, tuple[Sequence, list[Sequence]]] = {}  # request (a beam's root) -> the lanes it holds
        for seq in self.admitted:
            root = seq.beam.root if seq.beam is not None else seq
            units.setdefault(id(root), (root, []))[1].append(seq)
        victims = [root for root, lanes in units.values() if all(s.place.logits is None for s in lanes)]
        if len(units) == 1 or not victims:
            return [self.fail(self.admitted[-1], exc)]
        least = max(v.cfg.priority for v in victims)
        self.preempt([v for v in victims if v.cfg.priority == least][-1])
        return []

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

    def fail(self, seq: Sequence, exc: Exception) -> Sequence:
        """Give a request up on a fault of its own; its blocks go back at once."""
        root = seq.beam.root if seq.beam is not None else seq
        root.error = exc
        self.give_up(root)
        return root

    def give_up(self, root: Sequence) -> None:
        """Stop a request (a beam request: every hypothesis) and take it out; its blocks go back at once."""
        root.cancel()
        if root.beam is not None:
            root.beam.cancel()
        self.release(root)

    def free_lane(self, lane: int) -> None:
        self.lane(lane).reset()
        self.executor.forget(lane)
        self.free_lanes.append(lane)
        self.free_lanes.sort()

    def release(self, seq: Sequence) -> None:
        """Take a sequence out of the engine; its lane's blocks go back to the pool at once (a beam request: every
        lane it holds)."""
        if seq.beam is not None and seq is seq.beam.root and seq.beam.lanes:
            self.admitted = [s for s in self.admitted if s.beam is not seq.beam]
            for lane in seq.beam.lanes:
                self.free_lane(lane)
            seq.beam.lanes, seq.place.lane, self.hold_back = [], None, False  # type: ignore[assignment]  # (Place.lane)
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.admitted:
            prefixes = self.prefix_cache(seq)
            if prefixes is not None and seq.done and not self.executor.is_adaptive(seq.exit) and seq.place.cached \
                    and seq.cacheable:
                # (not at adaptive depth: its decode fills skipped loops by copies)
                prefixes.keep(seq.history, seq.loops, self.lane(seq.place.lane))
            if seq.done:
                log.debug("step %d: #%d done (%s, %d tokens): lane %d and its blocks free", self.steps,
                          seq.place.arrival, seq.stop_reason, seq.count, seq.place.lane)
            self.admitted.remove(seq)
            self.free_lane(seq.place.lane)
            if seq.done:
                self.hold_back = False
        seq.place.lane = None  # type: ignore[assignment]  # (it holds none now: Place.lane)
