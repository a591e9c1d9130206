"""A step's plan: what the scheduler (engine/scheduler.py) hands the executor (engine/executor.py), and what comes back.

A plan is plain data: which lanes run, at which positions, which tokens they feed, their loop counts and exit rules,
and how many greedy tokens a row may draw inside a C call. Every block it writes was taken when it was made, so the
executor takes none. Requests are named by their lane (a beam request by each hypothesis's); the executor never sees
a Sequence. The one thing that is not data is a handle's `run` (a resume handle or a prefix cache that runs the loops
it lacks itself): the handle lent its blocks at schedule, and its forward runs at execute.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..exits import ExitRule
from .sequence import Start


@dataclass
class Piece:
    """A prefill piece: the prompt tokens `tokens` at positions start.. of the lane, all `loops` loops (a chunk does
    not exit early); under a depth cap `loops` is the cap and the slots of loops up to `kv_loops` (the request's) get
    copies of the last loop's K/V."""
    lane: int
    start: int
    tokens: list[int]
    loops: int
    exit: ExitRule
    kv_loops: int = 0  # (0: loops)
    whole: bool = False  # one forward over the piece, never C rows (a prefix hit's rest: as generate's prefill)
    handle: Start | None = None  # a handle runs it instead (Start.run: it lent its blocks at schedule)
    # its latent rows come back too (Outputs.latents): a resume handle's build keeps every prompt token's (resume.py)
    keep_latent: bool = False
    # every row's logits come back (Outputs.rows): its request asks for prompt log-probabilities (Sequence.rows_wanted)
    keep_rows: bool = False


@dataclass
class Row:
    """One token a lane feeds in this step's decode (or its next loop iterations, when its token is in flight)."""
    lane: int
    token: int
    position: int
    loops: int
    exit: ExitRule
    adaptive: bool  # its depth is decided per token: an early-exit rule, the exit gate, a forced depth
    greedy: bool = False  # its next token is a plain argmax that C may draw, and nothing waits for a lane or a prefill
    # greedy tokens it may draw inside a C call after this one, as their forced depths (each its exit threshold where
    # it has no schedule); empty: it returns to the sampler
    draws: list[float] = field(default_factory=list)
    ignore_eos: bool = False
    # its request asks for log-probabilities: its draws bring back the logits each was chosen from (Outputs.chosen_from)
    keep_logits: bool = False
    # a row of a drafted chunk (Chunk), run by loop iterations beside the step's rows: its token ends within the call,
    # its logits go to Outputs.verified
    verifies: bool = False
    cell: int = -1  # the cell it writes (-1: its position; a tree's tokens share positions)
    # a tree's row: (first, seen): of the lane's cells first.., it sees those where seen[i] (its ancestors), every cell
    # before them
    sees: tuple[int, list[bool]] | None = None


@dataclass
class Chunk:
    """A speculative lane's drafted chunk (its pending token, then its drafts) at positions start.. of the lane: rows
    of the step's decode forward at `loops`, every row's logits given back (Outputs.verified). With an adaptive exit
    rule, each row stops by it: the chunk runs by loop iterations beside the step's rows. A tree (width w > 1): the
    pending token, then its w children and each child's chain, level by level (token i's parent is i - w, the root
    for the first level); its tokens sit at cells start.. and at positions start + their depth, and each sees its
    ancestors only."""
    lane: int
    start: int
    tokens: list[int]
    loops: int
    exit: ExitRule | None = None  # (None: every loop)
    width: int = 1

    def positions(self) -> list[int]:
        """Each token's position: start + its depth in the tree (a chain's: start + i)."""
        return tree_positions(self.start, self.width, len(self.tokens))

    def ancestors(self, i: int) -> list[bool]:
        """Which of the chunk's tokens 0..i token i sees: itself and its ancestors."""
        seen, j = [False] * (i + 1), i
        while j >= 0:
            seen[j], j = True, tree_parent(j, self.width)
        return seen


def tree_positions(start: int, width: int, n: int) -> list[int]:
    """The positions of a drafted tree's n tokens (the root at `start`, then `width` tokens a level): start + each
    one's depth."""
    return [start + (i + width - 1) // width for i in range(n)]


def tree_parent(i: int, width: int) -> int:
    """The parent of a drafted tree's token i (-1: the root's): the root for the first level, else the token a
    level up on its branch."""
    return -1 if i == 0 else 0 if i <= width else i - width


@dataclass
class Plan:
    """What one step's forwards run, their blocks already taken."""
    step: int
    pieces: list[Piece] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    driven: list[int] = field(default_factory=list)  # lanes whose driver runs their own forwards (speculation)
    # lanes whose driver drafts before the step's forward (the runner calls it); their chunks join the decode rows
    drafting: list[int] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)

    def lanes(self) -> list[int]:
        """The lanes whose forwards the step runs."""
        return [p.lane for p in self.pieces] + [r.lane for r in self.rows] + self.driven + self.drafting


@dataclass
class Outputs:
    """What a step's forwards gave back, by lane."""
    # a fed token's forward done (a decode row, or its last loop iteration): its logits [V] and the loops it ran
    tokens: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    # greedy tokens the C passes drew, with the loops of each (taken before any fresh logits)
    drawn: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # a keep_logits row's draws: the logits [V] each was chosen from, one per token of drawn[lane]
    chosen_from: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    # a prefill piece done: (lane, tokens it covered, logits [V] of its last position, loops it ran, seconds)
    pieces: list[tuple[int, int, torch.Tensor, int, float]] = field(default_factory=list)
    # a keep_latent piece done: (lane, its start, e and s [1, T_piece, d]: the prelude's output, the state after its
    # loops)
    latents: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # a chunk verified: its rows' logits [len(tokens), V] and the loops each ran
    verified: dict[int, tuple[torch.Tensor, list[int]]] = field(default_factory=dict)
    # a keep_rows piece done: (lane, its start, the logits of its every row [T_piece, V])
    rows: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    failed: dict[int, Exception] = field(default_factory=dict)  # a piece's own fault (its handle was freed)
    lone_row_seconds: float | None = None  # a decode forward of one row: its time (a speculative driver learns it)
