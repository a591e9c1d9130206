"""Elastic depth: under load, lanes with a depth range spend fewer loops per token instead of making requests wait.

A request gives a depth range beside its `loops` (GenerateConfig.min_loops at a fixed depth, or max_loss_increase:
Sequence.floor). The runner calls `DepthController.steer(admitted, waiting)` once per step, after retire. It measures
the pressure, the largest of
  - time per output token (TPOT) of the decoding lanes over the last WINDOW steps / Targets.tpot_s, and of each
    ranged lane on its own over the last LANE_WINDOW steps (under continuous-depth batching a token takes as many
    steps as its loops, so a lane at full depth beside lanes at their floor waits several times the batch's mean
    TPOT per token: its own TPOT is what its client sees),
  - the age of the oldest request still without a first token (its broker queue time included) / Targets.ttft_s,
  - the age of the oldest waiting request (no lane yet; in a service, also the broker's oldest, as its last dispatch
    to this worker reported it: note_backlog) / Targets.queue_s (ttft_s when no queue_s is given),
and steers each lane's depth cap (Sequence.depth_cap; the scheduler forces each token's loops to it, Sequence.
forced_depth) in notches: NOTCHES steps across [floor, loops].
  - over target (pressure > 1) for LOWER_EVERY steps in a row, and at most every LOWER_EVERY steps: the most
    tolerant half of the lanes that are above their floor go down (the least important first: the highest
    GenerateConfig.priority, then the widest range, then the least lowered, so lanes come down together), one notch
    just over target, 2 from 1.5x, 4 from 3x (`notches_for`), and the other half half as many, a tolerant lane over
    its own TPOT target straight to a cap that meets it (fitting_notch); never below a floor;
  - calm (pressure < CALM for RAISE_AFTER steps in a row, none lowered meanwhile): the least tolerant half of the
    capped lanes go one notch up; a lane back at its loops is uncapped (its rows are plain fixed-depth rows again);
  - a ranged request starts at the controller's level (the median notch of the ranged lanes, one lower after every
    RAISE_AFTER calm steps) when first seen, waiting or admitted, so a request that arrives under sustained load does
    not start at full depth; at its floor while over target with a backlog in the broker (the service is full);
    never deeper than the measured lanes' TPOT says meets the target (fitting_notch); its prompt runs at the cap it
    stands at when its first piece is planned
    (Sequence.prompt_depth), the K/V slots of the loops above it filled with copies of its last loop's;
  - between CALM and 1: nothing (hysteresis: depth neither falls nor climbs back and forth).
A lane without a range is never touched: its rows are the rows of a fixed-depth run (same forwards, same tokens).
A lane once capped leaves the prefix cache alone (Sequence.cacheable): its K/V are not the fixed-depth K/V.
This module imports no torch (the CLI parses the targets with it).
"""
from __future__ import annotations

import math
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (this module imports no torch: the CLI reads parse_seconds and Targets without it)
    from .sequence import Sequence

NOTCHES = 8  # steps across a lane's range [floor, loops]
LOWER_EVERY = 4  # steps between two lowerings
RAISE_AFTER = 24  # calm steps in a row before depth climbs a notch
CALM = 0.6  # pressure under which a step counts as calm
WINDOW = 8  # steps the TPOT of the decoding lanes is measured over
# steps each ranged lane's own TPOT is measured over: long enough to see a token of a lane at full depth (a lane's
# tokens take as many steps as its loops while its batch-mates run fewer: its TPOT is its own, not the batch's mean)
LANE_WINDOW = 32
# seconds a note of the broker's backlog stands: a worker under a backlog gets a request each time a lane frees (every
# few steps), so an older note means the broker's queue has emptied (or this worker's lanes run long requests)
BACKLOG_TTL = 0.25


@dataclass(frozen=True)
class Targets:
    """Latency targets (seconds; None: not watched)."""
    tpot_s: float | None = None  # time per output token of a decoding lane
    ttft_s: float | None = None  # time to first token, broker queue included
    queue_s: float | None = None  # time a request waits for a lane (default: ttft_s)

    def __bool__(self) -> bool:
        return any(t is not None for t in (self.tpot_s, self.ttft_s, self.queue_s))


def parse_seconds(value: str | float | None) -> float | None:
    """'40ms', '0.04s', '0.04' (seconds), 40e-3 -> seconds; None stays None. ValueError names the form."""
    if value is None or isinstance(value, (int, float)):
        seconds = None if value is None else float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(ms|s|us)?\s*", str(value), re.IGNORECASE)
        if not m:
            raise ValueError(f"a latency target must look like '40ms' or '0.04s', got {value!r}")
        seconds = float(m.group(1)) * {"ms": 1e-3, "us": 1e-6, "s": 1.0, None: 1.0}[(m.group(2) or "").lower() or None]
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"a latency target must be a positive time, got {value!r}")
    return seconds


def ranged_floor(seq: Sequence) -> int:
    """The floor of a lane the controller steers (only lanes with a depth range are)."""
    assert seq.floor is not None, "a lane without a depth range is never steered"
    return seq.floor


def notch_cap(seq: Sequence, notch: int) -> int | None:
    """The depth cap of a ranged lane at `notch` (0: its loops, uncapped; NOTCHES: its floor)."""
    floor = ranged_floor(seq)
    cap = max(floor, seq.loops - round(notch * (seq.loops - floor) / NOTCHES))
    return None if notch <= 0 or cap >= seq.loops else cap


def notches_for(pressure: float) -> int:
    """Notches the most tolerant half goes down at one lowering (the rest half as many): 1 just over target, more the
    further over it is, so a heavy overload is met in a few lowerings instead of a slow walk while the queue grows."""
    return 1 if pressure < 1.5 else 2 if pressure < 3 else 4


class DepthController:
    def __init__(self, targets: Targets, clock: Callable[[], float] = time.perf_counter):
        self.targets, self.clock = targets, clock
        self.last: float | None = None  # when the last step was steered
        self.counts: dict[int, int] = {}  # id(seq) -> tokens it had at the last step
        self.window: deque[tuple[float, int, int]] = deque(maxlen=WINDOW)  # (seconds, tokens, decoding lanes)
        self.steps = self.since_lowered = self.calm = self.over = 0  # (over, calm: steps in a row)
        self.pressure = 0.0  # the last step's
        self.tpot = 0.0  # measured over the window
        self.lowered = self.raised = 0  # notches given up and given back, in all
        # the notch a ranged lane starts at when it is first steered: the median of the ranged lanes' after the last
        # step, one lower after every RAISE_AFTER calm steps (a request lives a few dozen steps: one that starts at
        # full depth under sustained load would be lowered only a notch or two before it ends)
        self.level = 0
        self.seen: set[int] = set()  # id(seq) of the lanes steered so far (those still admitted)
        self.backlog: tuple[float, float] | None = None  # (the broker's oldest waiting request's age, noted when)
        # id(seq) -> (when, tokens) of a decoding ranged lane, oldest first, over the last LANE_WINDOW steps (since it
        # was last lowered), and its own TPOT over the target where measured
        self.lane_counts: dict[int, deque[tuple[float, int]]] = {}
        self.lane_ratios: dict[int, float] = {}
        self.loop_s: float | None = None  # a loop's share of a measured lane's TPOT (the median lane's)

    def note_backlog(self, seconds: float) -> None:
        """The age of the oldest request still in the broker's queue when it sent this worker a request (0: none).
        The queue of a service lives in its broker (a worker holds only what its lanes run), so the controller counts
        it with its own waiting requests."""
        self.backlog = (seconds, self.clock()) if seconds > 0 else None

    def backlogged(self) -> bool:
        """Whether the broker's last dispatch (within BACKLOG_TTL) left requests waiting in its queue."""
        return self.backlog is not None and self.clock() - self.backlog[1] < BACKLOG_TTL

    # --- measuring ----------------------------------------------------------------------------------------------
    def measure(self, admitted: list[Sequence], waiting: list[Sequence]) -> float:
        now = self.clock()
        decoding = [s for s in admitted if s.count and id(s) in self.counts]
        if self.last is not None and decoding:
            tokens = sum(max(0, s.count - self.counts[id(s)]) for s in decoding)
            self.window.append((now - self.last, tokens, len(decoding)))
        self.last = now
        self.counts = {id(s): s.count for s in admitted}
        seconds = sum(w[0] for w in self.window)
        tokens = sum(w[1] for w in self.window)
        lanes = sum(w[2] for w in self.window) / len(self.window) if self.window else 0
        self.tpot = seconds * lanes / tokens if tokens else 0.0
        t = self.targets
        ratios = [self.tpot / t.tpot_s] if t.tpot_s and tokens else []
        lanes_tpot = self.lane_tpots(admitted, now)
        self.lane_ratios = {i: tpot / t.tpot_s for i, tpot in lanes_tpot.items()} if t.tpot_s else {}
        ratios += self.lane_ratios.values()
        first = [s for s in admitted if s.count == 0] + list(waiting)
        if t.ttft_s and first:
            ratios.append(max(now - s.t_call + s.queued_s for s in first) / t.ttft_s)
        queue = t.queue_s or t.ttft_s
        if queue and waiting:
            ratios.append(max(now - s.t_call + s.queued_s for s in waiting) / queue)
        if queue and self.backlog is not None and self.backlogged():
            ratios.append((self.backlog[0] + now - self.backlog[1]) / queue)
        return max(ratios, default=0.0)

    def lane_tpots(self, admitted: list[Sequence], now: float) -> dict[int, float]:
        """Each decoding ranged lane's own TPOT over the last LANE_WINDOW steps (id(seq) -> seconds per token), or the
        time since the window's start where it took none (at least that)."""
        kept, tpots, per_loop = {}, {}, []
        for seq in admitted:
            if not seq.count or seq.floor is None:
                continue
            seen = kept[id(seq)] = self.lane_counts.get(id(seq)) or deque(maxlen=LANE_WINDOW)
            seen.append((now, seq.count))
            t0, c0 = seen[0]
            if len(seen) == LANE_WINDOW or seq.count - c0 >= 2:  # (a span long enough to mean something)
                tpots[id(seq)] = (now - t0) / max(1, seq.count - c0)
                per_loop.append(tpots[id(seq)] / (seq.depth_cap or seq.loops))
        self.lane_counts = kept
        self.loop_s = sorted(per_loop)[len(per_loop) // 2] if per_loop else None
        return tpots

    # --- steering -----------------------------------------------------------------------------------------------
    @staticmethod
    def tolerance(seq: Sequence) -> tuple:
        """Sort key, most tolerant first: least important (the highest GenerateConfig.priority), widest range, least
        lowered."""
        return -seq.cfg.priority, -(seq.loops - ranged_floor(seq)), seq.depth_notch, seq.place.arrival

    @staticmethod
    def move(seq: Sequence, notch: int) -> None:
        """Put a lane at `notch` (0: uncapped)."""
        seq.depth_notch, seq.depth_cap = notch, notch_cap(seq, notch)
        if seq.depth_cap is not None:
            seq.cacheable = False  # its K/V are not the fixed-depth K/V: kept out of the prefix cache

    def shift(self, seq: Sequence, way: int) -> None:
        """One notch down (way 1) or up (-1): to the next notch whose cap differs (a narrow range has fewer caps)."""
        cap, notch = seq.depth_cap, seq.depth_notch
        while 0 <= notch + way <= NOTCHES:
            notch += way
            if notch_cap(seq, notch) != cap:
                break
        self.move(seq, notch)

    def fitting_notch(self, seq: Sequence) -> int:
        """The first notch from the lane's own whose cap would bring its TPOT within the target: from its own TPOT
        where measured, else (a request first seen) from a loop's share of the measured lanes' TPOT; its notch now
        where it is within the target or nothing is measured. A token's time is taken as proportional to its loops,
        which overstates what a loop costs (the prelude, coda and head are counted in): the cap errs low."""
        ratio, notch, target = self.lane_ratios.get(id(seq)), seq.depth_notch, self.targets.tpot_s
        if ratio is not None:
            want = (seq.depth_cap or seq.loops) / ratio if ratio > 1 else math.inf
        else:
            want = target / self.loop_s if target and self.loop_s else math.inf
        while notch < NOTCHES and (notch_cap(seq, notch) or seq.loops) > want:
            notch += 1
        return notch

    def steer(self, admitted: list[Sequence], waiting: list[Sequence]) -> None:
        """Once per step (the runner's, after retire): measure, then lower or raise the depth caps of ranged lanes."""
        self.steps += 1
        self.since_lowered += 1
        self.pressure = self.measure(admitted, waiting)
        ranged = [s for s in admitted if s.floor is not None and s.beam is None and s.driver is None]
        # a request first seen starts at the level (at its floor while the broker holds a backlog and the service is
        # over target: it is full, and a request arriving then would only be lowered during its few steps), and no
        # deeper than the measured lanes' TPOT says fits the target; one still waiting too, so that its prompt runs
        # at that depth
        fresh = [s for s in waiting if s.floor is not None and s.beam is None and s.driver is None
                 and s.prompt_loops is None]
        start = NOTCHES if self.pressure > 1.0 and self.backlogged() else self.level
        for seq in ranged + fresh:
            if id(seq) not in self.seen:
                notch = max(start, self.fitting_notch(seq))  # (no deeper than the lanes' TPOT allows)
                if notch:
                    self.move(seq, notch)
        self.seen = {id(s) for s in ranged + fresh}
        self.adjust(ranged)
        notches = sorted(s.depth_notch for s in ranged)
        if notches:
            self.level = notches[len(notches) // 2]

    def adjust(self, ranged: list[Sequence]) -> None:
        if self.pressure > 1.0:
            self.calm, self.over = 0, self.over + 1
            down = sorted((s for s in ranged if s.depth_notch < NOTCHES), key=self.tolerance)
            # (over target for LOWER_EVERY steps in a row: one slow step, a long prompt's piece, lowers nothing)
            if down and self.since_lowered >= LOWER_EVERY and self.over >= LOWER_EVERY:
                steps = notches_for(self.pressure)
                half = math.ceil(len(down) / 2)
                for i, seq in enumerate(down):
                    before = seq.depth_notch
                    for _ in range(steps if i < half else steps // 2):
                        self.shift(seq, 1)
                    if i < half:  # (a tolerant lane over its own target: straight to a cap that meets it)
                        self.move(seq, max(seq.depth_notch, self.fitting_notch(seq)))
                    self.lowered += seq.depth_notch - before
                    self.lane_counts.pop(id(seq), None)  # (its TPOT is measured again at its new depth)
                self.since_lowered = 0
            return
        self.over = 0
        self.calm = self.calm + 1 if self.pressure < CALM else 0
        if self.calm >= RAISE_AFTER:
            up = sorted((s for s in ranged if s.depth_notch > 0), key=self.tolerance, reverse=True)
            for seq in up[:math.ceil(len(up) / 2)]:
                self.shift(seq, -1)
                self.raised += 1
            self.level = max(0, self.level - 1)
            self.calm = 0
