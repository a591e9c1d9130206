"""The engine's C backend: how a step's rows are spoken to kernels/cpu_block.c, apart from what the scheduler decides.

The scheduler (engine/scheduler.py) decides which rows run, at which loop range and exit rule, and how many greedy
tokens a row may draw inside a call; the executor (engine/executor.py) hands the rows C can run to this module, which
turns them into the C step's terms and back:

- the exit rules C decides, as `tl_exit_t` rows of 8 numbers (`exit_row`): a loop count, `latent` (with the exit
  gate), a forced depth (`exit_schedule`), Ouro's `cdf`; a row's rule state between calls lives in its InFlight
  (`c_exit`) and, for the torch passes, converts to an exits.Track (`track_of`);
- the lane latent buffer [3, lanes, d] (e, s and the state a row exits with) where a token in flight keeps its rows
  between C calls (`latent`);
- prefill pieces as rows of shared calls (`prefill_rows`), each call at one loop count.

Where C cannot run a step (another device, cache mode or dtype, a rule that reads each loop's logits) `passes`
returns None and the executor takes the torch passes (engine/iteration.py).
"""
from __future__ import annotations

import logging
import time

import torch

from ..cache import KVCache
from ..exits import ExitRule, Track
from ..kernels import cpu_block
from . import forward as paged
from .plan import Outputs, Piece, Row
from .sequence import InFlight

# the exit rules C decides, as cpu_block.c's tl_exit_t numbers them
C_RULES = {"latent": 1, "schedule": 2, "cdf": 3}

log = logging.getLogger("tinyloop.scheduler")  # (the scheduler's decisions and how they ran: one log)


class CBackend:
    """The C calls of one executor over its cache; it owns the lane latent buffer."""

    max_draws = cpu_block.RUN_AHEAD  # the most tokens a row draws inside one call

    def __init__(self, model, cache: KVCache, coalesce: bool = True):
        self.model, self.net, self.cache = model, model.net, cache
        # passes a greedy row whose token ended may sit out to share its head with batch-mates' (of a known depth, of
        # an adaptive one; 0: none)
        self.coalesce = cpu_block.COALESCE if coalesce else (0, 0)
        self.buffer: torch.Tensor | None = None  # [3, lanes, d]: tokens in flight between C calls
        self.views: list[tuple] = []

    # --- what C can run ---------------------------------------------------------------------------------------
    def passes(self, B: int) -> tuple | None:
        """The C step and exit gate (weight, bias; None without one) that run B rows' passes in one call, or None
        where the C step does not run this model over this cache."""
        net, cache = self.net, self.cache
        if cache.device.type != "cpu" or not cpu_block.supported(self.model.cfg, cache, B, net.embed.weight.dtype):
            return None
        step, gate = paged.c_step(net, cache), net.exit_gate
        if gate is not None:
            gate = gate.weight.detach().reshape(-1), float(gate.bias) if gate.bias is not None else 0.0
        if step is None or gate is not None and (gate[0].dtype != torch.float32 or not gate[0].is_contiguous()):
            return None
        return step, gate

    def chunk_rows(self, n: int, exits: ExitRule) -> bool:
        """Whether a prefill piece of n tokens under `exits` runs as C rows (forward.c_chunk)."""
        return paged.c_chunk(self.net, self.cache, n, exits) is not None

    # --- exit rules in C's terms ------------------------------------------------------------------------------
    @staticmethod
    def exit_row(row: Row, flight: InFlight | None) -> list | None:
        """A row's token's exit rule as a tl_exit_t row: [rule, loops, min_loops, threshold, chosen, used, cdf, rest];
        None for a rule C does not decide."""
        rule = row.exit
        if not row.adaptive:
            return [0, row.loops, 1, 0.0, 0, row.loops, 0.0, 1.0]
        if rule.rule not in C_RULES:
            return None
        if flight is not None and flight.c_exit is not None:
            return flight.c_exit
        track = flight.track if flight is not None else None
        return [C_RULES[rule.rule], row.loops, rule.min_loops, rule.threshold, int(flight is not None and flight.chosen),
                row.loops if flight is None else flight.used, 0.0 if track is None else float(track.cdf),
                1.0 if track is None else float(track.rest)]

    def track_of(self, flight: InFlight) -> None:
        """A token whose last passes ran in C continues in torch: the cdf rule's sums as its Track."""
        if flight.c_exit is None:
            return
        if flight.c_exit[0] == C_RULES["cdf"]:
            flight.track = Track.start(1, 1, self.net.cfg.vocab_size, self.cache.device)
            flight.track.cdf[:], flight.track.rest[:] = flight.c_exit[6], flight.c_exit[7]
        flight.c_exit = None

    def latent(self) -> tuple[torch.Tensor, list[tuple]]:
        """The rows e, s and the exit state [3, lanes, d] where C keeps each lane's token in flight, and each lane's
        three rows as [1, 1, d] views (an InFlight's e, s and out while its passes run in C)."""
        if self.buffer is None:
            self.buffer = torch.zeros(3, self.cache.lanes, self.model.cfg.d_model)
            self.views = [tuple(self.buffer[i, lane].view(1, 1, -1) for i in range(3))
                          for lane in range(self.cache.lanes)]
        return self.buffer, self.views

    # --- the calls --------------------------------------------------------------------------------------------
    def iterate(self, rows: list[Row], flights: dict[int, InFlight], budget, out: Outputs
                ) -> list[tuple[Row, torch.Tensor, int]] | None:
        """Loop iterations of every row until some row's token ends, with every row's exit decided after each pass,
        in one C call (cpu_block.DecodeStep.iterate_until). budget(rows, positions): the greedy tokens each row draws
        inside the call, as their forced depths. Updates the tokens in flight (`flights`, by lane) and appends each
        row's drawn tokens with their loops to out.drawn[lane] (a keep_logits row's also the logits each was chosen
        from, to out.chosen_from[lane]); returns (row, logits, loops used) of each row whose token ended with logits
        to sample (every `verifies` row: its token ends within the call), or None (nothing run) where the rows need
        the torch passes."""
        cache, cfg = self.cache, self.model.cfg
        c = self.passes(len(rows))
        if c is None:
            return None
        step, gate = c
        rules = [self.exit_row(row, flights.get(row.lane)) for row in rows]
        exits = [x for x in rules if x is not None]
        if len(exits) < len(rules):
            return None
        latent, views = self.latent()
        e, s, exit_state = latent
        tokens, done, lanes = [], [], [row.lane for row in rows]
        for row in rows:
            flight = flights.get(row.lane)
            tokens.append(row.token if flight is None else None)
            done.append(0 if flight is None else flight.done)
            if flight is not None and flight.s is not views[row.lane][1]:  # its last pass ran in Python
                e[row.lane], s[row.lane] = flight.e.reshape(-1), flight.s.reshape(-1)
                if flight.out is not None:
                    exit_state[row.lane] = flight.out.reshape(-1)
        positions = [row.position for row in rows]
        cells = [row.position if row.cell < 0 else row.cell for row in rows]
        masks = None
        if any(row.sees is not None for row in rows):  # (a tree's rows: each sees its ancestors)
            masks = [None if row.sees is None else (row.sees[0], torch.tensor(row.sees[1], dtype=torch.uint8))
                     for row in rows]
        ahead = budget(rows, step.positions)
        eos = -1 if any(row.ignore_eos for row, a in zip(rows, ahead) if a) else self.model.eos_id
        with paged.torch_threads(paged.decode_threads(len(rows), cfg, c_blocks=True)):
            got = step.iterate_until(cache, cells, done, tokens, exits, lanes, latent, gate,
                                     compute=cfg.exit_kv == "compute", ahead=ahead, eos=eos,
                                     wait=self.coalesce if len(rows) >= cpu_block.COALESCE_FROM_ROWS else (0, 0),
                                     keep=[row.keep_logits for row in rows],
                                     verify=[row.verifies for row in rows] if any(r.verifies for r in rows) else None,
                                     positions=positions if cells != positions else None, masks=masks)
        for b, row in enumerate(rows):
            if got.drawn[b]:  # taken at this step's postprocess, before any fresh logits
                flights.pop(row.lane, None)
                out.drawn.setdefault(row.lane, []).extend(got.drawn[b])
                chosen_from = got.kept[b]
                if chosen_from is not None:
                    out.chosen_from.setdefault(row.lane, []).extend(chosen_from.unbind())
            if b not in got.finished and not got.starts[b]:
                flight, x = flights.get(row.lane), exits[b]
                e_view, s_view, kept = views[row.lane]
                if flight is None:
                    flight = flights[row.lane] = InFlight(0, e_view, s_view, x[0] != 0)
                flight.done, flight.e, flight.s = got.done[b], e_view, s_view
                flight.chosen, flight.used, flight.track = bool(x[4]), x[5], None
                flight.out, flight.c_exit = (kept if x[0] else None), x
        assert all(b in got.finished for b, row in enumerate(rows) if row.verifies)  # (C ends the call after them)
        return [(rows[b], logits, exits[b][5]) for b, logits in zip(got.finished, got.logits)]

    def prefill_rows(self, pieces: list[Piece], step: int
                     ) -> list[tuple[Piece, torch.Tensor, float, torch.Tensor | None]]:
        """Prefill pieces (each one `chunk_rows` accepts) as the C step's rows, those at the same loop count sharing
        calls of up to MAX_LANES rows: each weight streams once per call instead of once per prompt. A row has the
        bits of its token decoded alone, so each piece's logits are those of its prompt prefilled alone, however the
        pieces are packed; a piece may span two calls (the first call's cells are written before the second reads
        them). Returns per piece (piece, logits of its last row, its rows' share of the calls' seconds, and for a
        keep_rows piece the logits of its every row [T, V], else None): a call computes every row's logits anyway."""
        plan = paged.c_step(self.net, self.cache)
        assert plan is not None  # (the caller checked that the pieces run in C)
        by_loops: dict[int, list[Piece]] = {}
        for piece in pieces:
            by_loops.setdefault(piece.loops, []).append(piece)
        done = []
        for loops, group in by_loops.items():
            rows = [(piece, i) for piece in group for i in range(len(piece.tokens))]
            last: dict[int, torch.Tensor] = {}  # id(piece) -> the logits of its last row
            every: dict[int, list[torch.Tensor]] = {id(p): [] for p in group if p.keep_rows}  # id(piece) -> its rows'
            took: dict[int, float] = {}  # id(piece) -> its rows' share of the calls' seconds
            for i in range(0, len(rows), cpu_block.MAX_LANES):
                call = rows[i:i + cpu_block.MAX_LANES]
                t = time.perf_counter()
                logits = plan.run(self.cache, [p.start + j for p, j in call], 0, loops, lanes=[p.lane for p, _ in call],
                                  tokens=[p.tokens[j] for p, j in call])
                assert logits is not None  # (with the head)
                share = (time.perf_counter() - t) / len(call)
                for r, (piece, _) in enumerate(call):
                    took[id(piece)] = took.get(id(piece), 0.0) + share
                    last[id(piece)] = logits[r]
                    if piece.keep_rows:
                        every[id(piece)].append(logits[r])
            log.debug("step %d: %d piece(s) at %d loops ran as %d rows in %d call(s)", step, len(group), loops,
                      len(rows), -(-len(rows) // cpu_block.MAX_LANES))
            done += [(piece, last[id(piece)], took[id(piece)],
                      torch.stack(every[id(piece)]) if piece.keep_rows else None) for piece in group]
        return done
