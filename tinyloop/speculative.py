"""Self-speculative and tree-speculative decoding (DESIGN section 4; the seed's pattern 5).

A looped model is its own draft model: the same weights at `draft_loops` propose tokens and at
`verify_loops` check them. The state s_k of a token depends only on loops < k of the tokens up to it, so a
drafted token's state after draft_loops, and the K/V it wrote for those loops, are exactly what full decode
would have. Verification therefore *continues* the drafted states from draft_loops to verify_loops in one
pass over the drafted chunk; the draft's loops are never computed again (`stats.loop_steps` shows it).

Every pass is the cached forward over a loop range (engine/forward.py: LoopForward), on the CPU the C step that
plain decode runs: a drafted token is a row run from loop 0 to draft_loops, a verified chunk rows continued from
draft_loops to verify_loops, and each row's logits have the bits of the same token decoded alone.

One round, from the pending token t0 at position p (sampled, not in the cache yet), with n = draft_ahead:
  draft    t0, d1 .. dn one token at a time through prelude + draft_loops; d_{i+1} comes from the coda run
           on the draft-depth state of d_i (the coda's cache slots are shared with verification, which
           overwrites them for the chunk). A chain stops early after a draft the draft itself doubts
           (probability under DRAFT_CONFIDENCE): the drafts after it would mostly be thrown away;
  verify   the chunk [t0, d1 .. dn] from draft_loops to verify_loops, then the coda: target logits P_0 .. P_n;
  accept   greedy: the longest prefix with d_{i+1} = argmax P_i, then argmax P_a (a correction or a bonus);
           sampled: accept d_{i+1} with probability min(1, p_i(d)/q_i(d)), on rejection draw from
           max(0, p_i - q_i) normalised; after n acceptances draw a bonus from P_n. The output keeps the
           target distribution.
Rejected drafts stay in the cache beyond the accepted length; the mask is causal by position and the next
round overwrites them before anything reads them (a ring buffer forgets them explicitly: KVCache.rollback).

Tree speculation (tree_width w > 1): the root proposes w first tokens (greedy: its top w; sampled: w draws
from q), each continued as its own chain, so w branches of depth n share the root. Each level of the tree is
drafted as one chunk and the whole tree (1 + w*n tokens) is verified in one pass. Branch tokens share
positions, so tree token i lives in cache cell p + i and attends through an explicit ancestor mask
(Step.cells / key_pos / mask); the accepted branch is moved to its real positions afterwards. Sampled trees
use multi-candidate rejection (SpecInfer): try the root's candidates in turn, after each rejection
p <- max(0, p - q) normalised; candidates are independent draws from q, which keeps the target distribution.

Early exit (threshold > 0 or an exit gate) composes per token exactly as in single decode: while drafting and
while verifying, a token whose latent stops changing freezes, copies its last K/V into the slots of the loops
it skips, and drops out of the chunk for the remaining loops; the others continue (LoopForward.until, the loop
range with an exit rule). Greedy output then equals plain early-exit `generate`. A round beside other rows (a
chain, a tree) is verified in their step: its chunk's rows from loop 0 join the step's loop iterations, each
stopping by the lane's rule, in a C call that ends once they are done (engine/executor.py's chunk_rows).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from .cache import KVCache
from .engine.calls import checked, engine
from .engine.plan import tree_parent, tree_positions
from .engine.sequence import Draft, Sequence
from .errors import ConfigError, ModeError
from .fields import MAX_LOOPS, SPECULATIVE_FIELDS
from .generation import generate
from .engine import forward as paged
from .loader import Model
from .sampling import accepts, adjust, distribution, draw, greedy_choice, greedy_proposals, residual
from .request import GenerateConfig, GenerateResult, GenerateStats, OnToken


# --- configuration ------------------------------------------------------------------------------------
@dataclass
class SpeculativeConfig:
    """draft_loops < verify_loops; verify_loops None = GenerateConfig.loops (or the model's default)."""
    draft_loops: int = 2
    verify_loops: int | None = None
    draft_ahead: int = 8  # the longest a chain drafts: it stops sooner after a doubtful draft (DRAFT_CONFIDENCE)
    tree_width: int = 1
    # a greedy lane decoding alone measures one plain row first and stops speculating when its rounds yield fewer
    # tokens per second than that row (False: every step alone is a round, e.g. to measure rounds)
    fallback: bool = True

    def validate(self, model: Model | None = None) -> "SpeculativeConfig":
        """Every setting against its rule in tinyloop/fields.py, then the rules between them and the model's."""
        for name, check in SPECULATIVE_FIELDS.items():
            error = check(getattr(self, name))
            if error:
                raise ConfigError(f"SpeculativeConfig.{name} {error}")
        max_loops = model.cfg.max_loops if model is not None else MAX_LOOPS
        if self.verify_loops is not None and not self.draft_loops < self.verify_loops <= max_loops:
            raise ConfigError(f"SpeculativeConfig.verify_loops must be an integer in draft_loops+1..{max_loops}, "
                              f"got {self.verify_loops!r}")
        if model is not None and self.tree_width > model.cfg.vocab_size:
            raise ConfigError(f"SpeculativeConfig.tree_width must be an integer in 1..vocab_size "
                              f"({model.cfg.vocab_size}), got {self.tree_width!r}")
        return self

    def resolved_verify_loops(self, model: Model, cfg: GenerateConfig) -> int:
        v = self.verify_loops if self.verify_loops is not None else cfg.resolved_loops(model)
        if v <= self.draft_loops:
            raise ConfigError(f"SpeculativeConfig.draft_loops {self.draft_loops} must be below the verify loops {v}")
        return v


def parse_speculative(value: str, source: str = "speculative") -> SpeculativeConfig:
    """"draft:verify:ahead[:width]" (e.g. "2:8:4") -> SpeculativeConfig; ConfigError names `source`."""
    try:
        nums = [int(x) for x in value.split(":")]
    except ValueError:
        nums = []
    if len(nums) not in (3, 4):
        raise ConfigError(f"{source}={value!r} must be draft:verify:ahead[:width], e.g. 2:8:4")
    sc = SpeculativeConfig(nums[0], nums[1], nums[2])
    if len(nums) == 4:
        sc.tree_width = nums[3]
    return sc.validate()


def speculative_from_env() -> SpeculativeConfig | None:
    """TINYLOOP_SPECULATIVE="draft:verify:ahead[:width]"; unset or empty = None."""
    value = os.environ.get("TINYLOOP_SPECULATIVE", "").strip()
    return parse_speculative(value, "environment TINYLOOP_SPECULATIVE") if value else None


@dataclass
class SpeculativeStats(GenerateStats):
    """GenerateStats plus what speculation did. Loop-steps count core passes per token (token x loop),
    decode phase only (the prompt's prefill is the same as plain decode's)."""
    draft_loops: int = 0
    verify_loops: int = 0
    draft_ahead: int = 0
    tree_width: int = 1
    verify_steps: int = 0        # verification passes (one per round)
    drafted: int = 0             # draft depth proposed, summed over rounds (a tree counts its depth once)
    accepted: int = 0            # drafted tokens accepted
    tokens_per_verify: float = 0.0
    draft_loop_steps: int = 0
    verify_loop_steps: int = 0
    loop_steps: int = 0
    draft_ms: float = 0.0        # wall time in draft passes and in verification passes (choose_speculative's costs)
    verify_ms: float = 0.0
    # chain drafts by the draft's own probability (>= DRAFT_CONFIDENCE: sure, else doubtful), and of those tested
    # (up to the first rejection) how many were accepted: choose_speculative's acceptance model
    doubtful: int = 0
    sure_tested: int = 0
    sure_accepted: int = 0
    doubtful_tested: int = 0
    doubtful_accepted: int = 0
    speculating: bool = True   # False: the lane found its rounds slower than plain rows and stopped


# --- the speculator ------------------------------------------------------------------------------------
# A chain stops drafting after a draft token the draft itself gives less than this probability: such drafts are
# rejected far more often than the others, and the drafts after a rejected one are thrown away, so they are not worth
# drafting (docs/speculative.md has the measurement).
DRAFT_CONFIDENCE = 0.05


@dataclass
class Round:
    """A round between its drafts and its verification: the root at position p, depth n, width w, N tokens (the root
    and the drafts), the tree's shape (None: a chain), each token's position, cell, id and parent, the draft
    distributions a sampled node's children were drawn from, the loops each token has used and whether it exited,
    the chain's doubtful drafts, and the tokens' latent rows [1, N, d]."""
    p: int
    n: int
    w: int
    N: int
    tree: paged.TreeShape | None
    pos: list[int]
    cells: list[int]
    toks: list[int]
    parent: list[int]
    q: dict[int, torch.Tensor | None]
    used: list[int]
    done: list[bool]
    doubtful: list[bool]
    lat: paged.Latent
    guessed: bool


class Speculator:
    """A speculative lane's driver (Sequence.driver): in a step where it speculates, the lane runs one draft/verify
    round instead of a decode row; counts loop-steps.

    Two shapes of a round:
    - its own forwards (`step`): the drafts, then the drafted chunk continued from draft_loops to verify_loops over the
      lane's blocks: a lane that decodes alone (a greedy one while its rounds pay or it verifies a guess);
    - around a shared forward (`drafter`: beside other rows): its drafts before the step's forward (`draft`; a
      guessed piece needs none), the drafted chunk (a chain, a tree, a guessed piece) as rows of that forward at
      verify_loops from loop 0 (the drafts' loops computed again: the price of sharing the forward, which streams
      each weight once for every row; with early exit or a tree, rows of the step's loop iterations, each stopping
      by the lane's rule, a tree's each seeing its ancestors), `accept` taking their logits and loops. A busy batch
      does not turn speculation off.
    Alone, a greedy lane's first decode step is a plain row whose time is the measure: a lane whose rounds yield fewer
    tokens per second than that row stops speculating (docs/speculative.md), in a batch too; a lane that has never
    decoded alone has nothing to measure its rounds against, and speculates in every step."""

    PROBE_ROUNDS = 3  # rounds measured before a greedy lane may decide its rounds do not pay

    def __init__(self, model: Model, sc: SpeculativeConfig, seq: Sequence, verify_loops: int,
                 guess: Iterable[int] = ()):
        cfg = seq.cfg
        self.model, self.net, self.cfg, self.seq = model, model.net, cfg, seq
        self.D, self.V, self.n, self.w = sc.draft_loops, verify_loops, sc.draft_ahead, sc.tree_width
        rule = self.rule = seq.exit
        self.adaptive = self.net.adaptive(rule)
        if self.adaptive and (rule.rule != "latent" or rule.min_loops > 1):
            # drafts stop per token on their latent change; the other rules read loops (or logits) drafts skip
            asked = f"the {rule.rule} exit rule" + (f" with min_loops {rule.min_loops}" if rule.min_loops > 1 else "")
            raise ModeError(f"speculative decoding with early exit supports the latent exit rule only, not {asked}; "
                            f"decode without early_exit_threshold, or without speculation")
        self.greedy = seq.sampling().greedy  # the sampler's rule: below MIN_TEMPERATURE
        # a known continuation to verify before drafting (greedy chains without early exit only): see step
        self.guess = list(guess) if self.greedy and sc.tree_width == 1 and not self.adaptive else []
        self.piece = 4  # the next guessed piece's length: doubles while pieces are taken whole
        self.gen = seq.gen  # the sequence's sampler draws the proposals and acceptances too
        self.used_at: dict[int, int] = {}  # loops used by the token at each committed position
        self.draft_loop_steps = self.verify_loop_steps = 0
        self.draft_s = self.verify_s = 0.0
        self.coda_slots = [model.cfg.coda_slot(i) for i in range(model.cfg.n_coda)]
        self.cache: KVCache | None = None  # the lane's cache, bound at each round (a preempted lane may move)
        self.fallback = sc.fallback
        self.chosen_from: torch.Tensor | None = None  # [len(out), V] of the last round (Sequence.score_all)
        self.plain_s: float | None = None
        self.pays, self.rounds_s, self.rounds_tokens, self.rounds = True, 0.0, 0, 0
        self.drafted: Round | None = None  # a batched round's drafts, waiting for the step's forward to verify them

    @property
    def stats(self) -> SpeculativeStats:
        st = self.seq.stats
        assert isinstance(st, SpeculativeStats)  # (speculative_sequence gives its sequence these)
        return st

    def bind(self, cache: KVCache) -> None:
        if cache is not self.cache:
            self.cache, self.forward = cache, paged.LoopForward(self.net, cache)  # every draft and verification pass

    # -- the runner's side --------------------------------------------------------------------------
    def runs(self, alone: bool) -> bool:
        """Whether this step's forward for the lane is a round of its own (else a batched round, or a plain row)."""
        if not self.greedy:  # every step a round: its own where it is alone
            return alone
        seq = self.seq
        if self.guess and seq.history[len(seq.prompt):] != self.guess[:seq.pos - len(seq.prompt) + 1]:
            self.guess = []  # the output left the guess: draft from here on
        # a guess is verified at once; drafting waits for the plain row it is measured against
        return alone and (not self.fallback or bool(self.guess) or self.pays and self.plain_s is not None)

    def span(self) -> int:
        """Cells a round may write from the pending token's (the root, the drafts or a guessed piece)."""
        return 1 + max(self.n * self.w, self.piece if self.guess else 0)

    def plain_row(self, seconds: float) -> None:
        """The lane decoded as the only row of a step in `seconds`: what a plain token costs it."""
        self.plain_s = seconds if self.plain_s is None else min(self.plain_s, seconds)

    def step(self, cache: KVCache) -> list[int]:
        """One round from the sequence's pending token (seq.token at seq.pos) over the lane's `cache`: the tokens it
        yields, for the runner to take in turn."""
        seq = self.seq
        self.bind(cache)
        t0 = time.perf_counter()
        n, w, guessed = self.next_round(cache)
        out, a, n = self.round(seq.token, seq.pos, n, w, guessed)
        self.yielded(out, a, n)
        if self.greedy and self.fallback and not guessed:  # drafting against the plain row: stop where it yields less
            self.rounds, self.rounds_s, self.rounds_tokens = self.rounds + 1, self.rounds_s + time.perf_counter() - t0, \
                self.rounds_tokens + len(out)
            if self.rounds >= self.PROBE_ROUNDS and self.rounds_s / self.rounds_tokens > (self.plain_s or 0.0):
                self.pays = False
        return out

    def next_round(self, cache: KVCache) -> tuple[int, int, list[int]]:
        """The next round's depth n and width w from the pending token, or the guessed piece it verifies."""
        seq, cfg = self.seq, self.cfg
        P, p, left = len(seq.prompt), seq.pos, cfg.max_tokens - seq.count  # a round yields at most depth + 1
        n, w = min(self.n, left - 1), self.w
        if w > 1:  # tree cells p .. p + n*w must fit the cache
            n = min(n, (cache.max_len - 1 - p) // w)
            if n == 0:
                n, w = min(self.n, left - 1), 1
        guessed = []
        if self.guess:  # everything so far, the pending token too, was guessed: verify the next piece
            guessed = self.guess[p - P + 1:p - P + 1 + min(self.piece, left - 1)]
            n, w, self.piece = len(guessed) or n, 1, self.piece * 2  # a next piece only if this one is taken whole
        return n, w, guessed

    def yielded(self, out: list[int], accepted: int, drafted: int) -> None:
        """A round's count: its verification, drafts and accepted drafts, and the loops of each token it yields."""
        stats, seq = self.stats, self.seq
        stats.verify_steps += 1
        stats.drafted += drafted
        stats.accepted += accepted
        seq.loop_counts += [self.used_at[seq.pos + j] for j in range(len(out))]

    # -- a round inside a shared step: drafts here, verification as rows of the step's decode forward ------------
    def drafter(self, alone: bool) -> "Speculator | None":
        """Itself where this step's round for the lane is split around the step's shared forward: its drafts run
        before it (`draft`), the drafted chunk is rows of that forward at verify_loops, and `accept` takes their
        logits. Beside other rows: sampled, or greedy while its rounds pay or it verifies a guess. A sampled lane draws
        from its generator in the same order either way, so a seeded request gives the same tokens alone or in a
        batch."""
        return self if not alone and (not self.greedy or self.pays or bool(self.guess)) else None

    def draft(self, cache: KVCache) -> Draft:
        """The drafts of a round from the pending token over the lane's `cache` (or the guessed piece, drafted by
        nobody): the chunk [pending, d1 .. dn] (a tree's 1 + n w tokens) for the step's forward to verify from loop
        0 (the drafts' loops are computed again there, the price of sharing the forward)."""
        seq = self.seq
        self.bind(cache)
        n, w, guessed = self.next_round(cache)
        if guessed:
            N, cells = 1 + n, list(range(seq.pos, seq.pos + 1 + n))
            self.drafted = Round(seq.pos, n, 1, N, None, cells, cells, [seq.token] + guessed, list(range(-1, n)), {},
                                 [0] * N, [False] * N, [], paged.Latent.empty(1, N, self.net), True)
        else:
            self.drafted = self.drafts(seq.token, seq.pos, n, w, [])
        if cache.window:  # a ring is read as old cells + the chunk: the drafts' cells are forgotten before it runs
            cache.rollback(seq.pos)
        return Draft(self.drafted.toks, self.rule if self.adaptive else None, self.drafted.w)

    def accept(self, logits: torch.Tensor, used: list[int]) -> list[int]:
        """The verified logits [len(chunk), V] of the drafted chunk and the loops each of its rows ran: the tokens
        the round yields."""
        rd, self.drafted = self.drafted, None
        assert rd is not None  # (drafted in this step)
        rd.used = used
        self.verify_loop_steps += sum(used)
        out, a = self.settle(rd, logits)
        self.yielded(out, a, rd.n)
        return out

    def finish(self) -> None:
        """The speculative stats of the whole request (Sequence.result calls it)."""
        stats = self.stats
        stats.draft_accept_rate = stats.accepted / stats.drafted if stats.drafted else 0.0
        stats.tokens_per_verify = stats.accepted / stats.verify_steps + 1 if stats.verify_steps else 0.0
        stats.draft_loop_steps, stats.verify_loop_steps = self.draft_loop_steps, self.verify_loop_steps
        stats.loop_steps = self.draft_loop_steps + self.verify_loop_steps
        stats.draft_ms, stats.verify_ms = self.draft_s * 1000, self.verify_s * 1000
        stats.speculating = self.pays

    # -- token choices: every one by the sampler's rules (tinyloop/sampling.py) ----------------------------------
    def penalised(self, logits: torch.Tensor, extra: list[int]) -> torch.Tensor:
        """Logits [V] after every adjustment the lane asks for, `extra` the drafts taken after its history."""
        return self.seq.penalised(logits, extra)

    def probs(self, logits: torch.Tensor, extra: list[int]) -> torch.Tensor:
        """The distribution [V] the lane samples from after its history and `extra` (sampling.distribution): the
        draft's q and the target's p alike."""
        lane = self.seq.sampling(extra)
        return distribution(adjust(logits.unsqueeze(0), [lane]), [lane])[0]

    def propose(self, logits: torch.Tensor, extra: list[int], k: int) -> tuple[list[int], torch.Tensor | None, float]:
        """k draft tokens after a node (greedy: sampling.greedy_proposals; sampled: k independent draws), their q,
        and the draft's own probability of the first (greedy: at temperature 1)."""
        if self.greedy:
            drafts, sure = greedy_proposals(self.penalised(logits, extra), k)
            return drafts, None, sure
        q = self.probs(logits, extra)
        drawn = draw(q, self.gen, k)
        return drawn, q, float(q[drawn[0]])

    # -- depth: every pass goes through the cached forward's loop range (engine/forward.py: LoopForward.until) ------
    def exits(self, used: list[int], done: list[bool]) -> paged.RowExits:
        """The early exit of a round's tokens (their loops so far and whether they stopped, updated in place), every
        skipped loop filled up to verify_loops."""
        return paged.RowExits(self.rule, self.adaptive, self.V, used, done)

    def draft_chunk(self, lat: paged.Latent, tokens: list[int], pos: list[int], cells: list[int],
                    tree: paged.TreeShape | None, head: bool):
        """A chunk of tokens (the root, a tree level, or a guessed chain) through prelude and draft_loops into the
        latent rows `lat` [1, T, d] and, if head, the coda and head. Returns logits [1, T, V] (None without head), the
        loops each token used, whether it exited early, and the loop-steps run."""
        t0, T = time.perf_counter(), len(tokens)
        exits = self.exits([0] * T, [False] * T)
        logits, steps = self.forward.until(pos, 0, self.D, lat, exits, head, tokens, tree, cells)
        self.draft_s += time.perf_counter() - t0
        return logits, exits.used, exits.done, steps

    # -- one round -----------------------------------------------------------------------------------
    def round(self, pending: int, p: int, n: int, w: int, guessed: list[int]) -> tuple[list[int], int, int]:
        """Draft from the pending token at position p (depth n, width w), verify, accept, commit. With
        `guessed` tokens (a chain known in advance) the drafts are those, their draft depth computed as one chunk.

        Returns the tokens the round yields (accepted drafts, then a correction or bonus), the number of drafted
        tokens accepted, and the depth drafted (n, or less where a chain stopped at a doubtful draft).
        """
        cache = self.cache
        assert cache is not None  # (bound by step)
        rd = self.drafts(pending, p, n, w, guessed)
        # verify: continue every drafted state from draft_loops to verify_loops in one pass, then the coda
        t0 = time.perf_counter()
        if cache.window:
            cache.rollback(p, self.coda_slots)  # the ring is read as old + new: drop the draft-depth coda entries
        verified, steps = self.forward.until(rd.pos, self.D, self.V, rd.lat, self.exits(rd.used, rd.done),
                                             tree=rd.tree, cells=rd.cells)
        assert verified is not None  # (with the head)
        self.verify_loop_steps += steps
        self.verify_s += time.perf_counter() - t0
        out, a = self.settle(rd, verified[0])
        return out, a, rd.n

    def drafts(self, pending: int, p: int, n: int, w: int, guessed: list[int]) -> "Round":
        """A round's drafts from the pending token at position p: depth n (less where a chain stops at a doubtful
        draft), width w, or the `guessed` chain as one chunk; their latent rows at draft_loops."""
        net, dev = self.net, self.model.device
        tree = paged.TreeShape(p, w, n, dev) if w > 1 else None
        N = 1 + n * w
        pos = tree_positions(p, w, N)
        cells = list(range(p, p + N))  # chain: cell = position
        toks = [pending] + [0] * (N - 1)
        parent = [tree_parent(i, w) for i in range(N)]
        q: dict[int, torch.Tensor | None] = {}  # sampled mode: the distribution a node's children were drawn from
        used, done, doubtful = [0] * N, [False] * N, []
        lat = paged.Latent.empty(1, N, net)  # the round's latent rows: drafts write them, verification continues them

        def path(i: int) -> list[int]:  # draft tokens after the root on the way to node i
            out: list[int] = []
            while i > 0:
                out.append(toks[i])
                i = parent[i]
            return out[::-1]

        def rows(a: int, b: int) -> paged.Latent:
            return paged.Latent(lat.e[:, a:b], lat.s[:, a:b])

        if guessed:  # prelude and draft loops of the whole known chain in one pass; nothing to propose
            toks[1:] = guessed
            _, used, done, steps = self.draft_chunk(lat, toks, pos, cells, None, head=False)
            self.draft_loop_steps += steps
        # draft: level 0 is the root, level d holds tokens 1+(d-1)w .. dw
        for d in range(0 if guessed else n + 1):
            a, b = (0, 1) if d == 0 else (1 + (d - 1) * w, 1 + d * w)
            logits, u, dn, steps = self.draft_chunk(rows(a, b), toks[a:b], pos[a:b], cells[a:b],
                                                    tree if d > 0 else None, head=d < n)
            self.draft_loop_steps += steps
            used[a:b], done[a:b] = u, dn
            if d == n:
                break
            logits = logits[0]
            for r, i in enumerate(range(a, b)):
                kids = list(range(1, 1 + w)) if d == 0 else [i + w]
                proposed, q[i], sure = self.propose(logits[r], path(i), len(kids))
                for c, t in zip(kids, proposed):
                    toks[c] = t
                if w == 1:  # a doubtful draft ends the chain: drafts after it would mostly be thrown away
                    doubtful.append(sure < DRAFT_CONFIDENCE)
                    n = d + 1 if doubtful[-1] else n
        N = 1 + n * w  # (a chain that ended early verifies what it drafted)
        return Round(p, n, w, N, tree, pos[:N], cells[:N], toks[:N], parent[:N], q, used[:N], done[:N], doubtful,
                     rows(0, N), bool(guessed))

    def settle(self, rd: "Round", logits: torch.Tensor) -> tuple[list[int], int]:
        """Accept from the verified logits [N, V] of a round's tokens (walking down the tree from the root), then
        commit: the accepted branch to its positions, the loops each committed token used, forget the rest. Returns
        the tokens it yields and the number of drafts accepted."""
        cache, dev, p, w, N, toks, q = self.cache, self.model.device, rd.p, rd.w, rd.N, rd.toks, rd.q
        assert cache is not None  # (bound by the round)
        out: list[int] = []
        accepted: list[int] = []
        node = 0
        # a plain argmax lane (LaneSampling.plain_argmax; its drafts only take it further past min_tokens): every
        # node's target at once; else each node's from its adjusted logits, which depend on the tokens before it
        best = greedy_choice(logits).tolist() if self.greedy and self.seq.sampling().plain_argmax else None
        while True:
            kids = [] if N == 1 else list(range(1, 1 + w)) if node == 0 else [node + w] if node + w < N else []
            if self.greedy:
                t = best[node] if best is not None else int(greedy_choice(self.penalised(logits[node], out)))
                nxt = next((c for c in kids if toks[c] == t), None)
            else:
                target, nxt = self.probs(logits[node], out), None
                for c in kids:  # candidates in turn; each rejection leaves the residual max(0, p - q)
                    qn = q[node]
                    assert qn is not None  # (sampled: the children were drawn from it)
                    if accepts(toks[c], target, qn, self.gen):
                        nxt = c
                        break
                    target = residual(target, qn)
                t = toks[nxt] if nxt is not None else draw(target, self.gen)[0]
            out.append(t)
            if nxt is None:
                break
            accepted.append(nxt)
            node = nxt

        a = len(accepted)
        if rd.tree is not None and a and accepted != list(range(1, a + 1)):
            cache.move_cells(torch.tensor([rd.cells[i] for i in accepted], device=dev),
                             torch.arange(p + 1, p + 1 + a, device=dev))
        for j, i in enumerate([0] + accepted):
            self.used_at[p + j] = rd.used[i]
        self.chosen_from = logits[[0] + accepted]  # the verified logits each token of `out` was chosen from
        cache.rollback(p + a + 1)
        if w == 1 and not rd.guessed:
            self.count_tests(rd.doubtful, a)
        return out, a

    def count_tests(self, doubtful: list[bool], accepted: int) -> None:
        """A chain's drafts by confidence: those up to the first rejected one were tested, the ones before it taken."""
        st = self.stats
        tested, taken = doubtful[:accepted + 1], doubtful[:accepted]
        st.doubtful += sum(doubtful)
        st.doubtful_tested += sum(tested)
        st.sure_tested += len(tested) - sum(tested)
        st.doubtful_accepted += sum(taken)
        st.sure_accepted += len(taken) - sum(taken)

def generate_speculative(model: Model, prompt, sc: SpeculativeConfig | None = None, cfg: GenerateConfig | None = None,
                         on_token: OnToken | None = None) -> GenerateResult:
    """Generate with self-speculative decoding. sc None: TINYLOOP_SPECULATIVE, else SpeculativeConfig().

    Greedy output equals `generate` at verify_loops; sampled output keeps its distribution. `on_token`
    streams as in generate_stream. result.stats is a SpeculativeStats.
    """
    sc, cfg = speculative_call(model, sc, cfg)
    with model.busy():
        ids = model.encode_prompt(prompt)
        verify_loops = sc.resolved_verify_loops(model, cfg)
        with engine(model, [ids], [cfg], loops=verify_loops, ring=speculative_ring(sc, cfg)) as (runner, client):
            return runner.run([speculative_sequence(model, ids, sc, cfg, on_token)], client=client)[0]


def speculative_call(model: Model, sc: SpeculativeConfig | None, cfg: GenerateConfig | None
                     ) -> tuple[SpeculativeConfig, GenerateConfig]:
    """The checked settings of a speculative call (ConfigError, ModeError)."""
    if model.cfg.dense:
        raise ModeError("self-speculative decoding drafts at fewer loops than it verifies at; this is a dense model "
                        "(its layers run once per token), so it has no shallower draft: use generate")
    sc = (sc or speculative_from_env() or SpeculativeConfig()).validate(model)
    cfg = checked(model, cfg, "tree_speculative" if sc.tree_width > 1 else "speculative")
    sc.resolved_verify_loops(model, cfg)
    return sc, cfg


def speculative_ring(sc: SpeculativeConfig, cfg: GenerateConfig) -> int:
    """A windowed lane's ring: room for the drafts a round may roll back without evicting what the window needs."""
    return cfg.cache_window + sc.draft_ahead + 1 if cfg.cache_window else 0


def speculative_sequence(model: Model, ids: list[int], sc: SpeculativeConfig, cfg: GenerateConfig,
                         on_token: OnToken | None, guess: Iterable[int] = ()) -> Sequence:
    """A sequence decoded speculatively: its driver runs the rounds, its loops are the verify loops. `guess`: a
    likely greedy continuation (a refine's draft); while the output follows it, rounds verify pieces of it (4, 8,
    16 ... tokens) instead of drafting token by token."""
    verify_loops = sc.resolved_verify_loops(model, cfg)
    stats = SpeculativeStats(draft_loops=sc.draft_loops, verify_loops=verify_loops, draft_ahead=sc.draft_ahead,
                             tree_width=sc.tree_width)
    seq = Sequence(model, ids, dataclasses.replace(cfg, loops=verify_loops), on_token, stats=stats)
    seq.driver = Speculator(model, sc, seq, verify_loops, guess)
    seq.ring = speculative_ring(sc, cfg)
    return seq


# --- pattern 5: measure, then choose -------------------------------------------------------------------------
@dataclass
class SpeculativeChoice:
    """What choose_speculative measured and its decision: `config` (the draft loops and draft length it picked) and
    whether to use it (only when its measured speedup over plain decode is above min_speedup)."""
    use_speculative: bool
    speedup: float                 # measured: the picked config against plain decode, side by side (median)
    plain_tokens_per_s: float
    speculative_tokens_per_s: float
    draft_accept_rate: float
    tokens_per_verify: float
    min_speedup: float
    config: SpeculativeConfig
    per_prompt: list[dict] = field(default_factory=list)
    predicted_speedup: float = 0.0  # what the measured acceptance and costs predicted for the pick
    candidates: list[dict] = field(default_factory=list)  # per draft loop count: acceptance, costs, best length

    def line(self) -> str:
        sc = self.config
        return (f"speculative {sc.draft_loops}->{sc.verify_loops} ahead {sc.draft_ahead} width {sc.tree_width}: "
                f"{self.speculative_tokens_per_s:.1f} vs plain {self.plain_tokens_per_s:.1f} tok/s = {self.speedup:.2f}x "
                f"(predicted {self.predicted_speedup:.2f}x; accept {self.draft_accept_rate:.2f}, "
                f"{self.tokens_per_verify:.2f} tok/verify) -> "
                f"{'speculative' if self.use_speculative else 'plain'} (needs > {self.min_speedup}x)")


@dataclass
class ChainModel:
    """What a chain round of up to n drafts yields, from measured acceptance: a draft is doubtful (under
    DRAFT_CONFIDENCE: the chain ends after it) with probability `doubtful`, and is accepted, once the drafts before
    it were, with probability alpha (sure) or alpha_doubtful."""
    alpha: float
    doubtful: float = 0.0
    alpha_doubtful: float = 0.0

    def tokens(self, n: int) -> float:
        """Expected tokens of a round: 1 (the correction or bonus) + sum over drafts i of P(drafted and accepted
        with all before it) = r^(i-1) (r + f a_d), where r = (1 - f) alpha (sure and accepted)."""
        f, r = self.doubtful, (1 - self.doubtful) * self.alpha
        return 1 + sum(r ** (i - 1) * (r + f * self.alpha_doubtful) for i in range(1, n + 1))

    def drafts(self, n: int) -> float:
        """Expected drafts of a round: the i-th is drafted when none before it was doubtful."""
        return sum((1 - self.doubtful) ** (i - 1) for i in range(1, n + 1))


def best_length(model: ChainModel, draft_s: float, verify_s: Callable[[float], float], plain_s: float,
                max_ahead: int) -> tuple[int, float]:
    """The draft length n in 1..max_ahead with the most tokens per second, and its predicted speedup over plain
    decode: a round runs drafts(n) + 1 draft passes (draft_s each: the pending token's, then each draft's) and one
    verification of as many rows (verify_s(T)), and yields model.tokens(n), each of which plain decode makes in
    plain_s."""
    def speedup(n: int) -> float:
        rows = model.drafts(n) + 1
        return plain_s * model.tokens(n) / (rows * draft_s + verify_s(rows))
    n = max(range(1, max_ahead + 1), key=speedup)
    return n, speedup(n)


PROBE_AHEAD = (2, 8)  # the draft lengths each candidate's probes run: verification costs at two chunk sizes


def speculative_stats(result: GenerateResult) -> SpeculativeStats:
    """The stats of a result of generate_speculative."""
    assert isinstance(result.stats, SpeculativeStats)
    return result.stats


def _per_token_s(result: GenerateResult) -> float:
    """Seconds per decoded token (the prompt's prefill is the same work either way)."""
    return result.stats.decode_ms / 1000 / max(result.stats.generated_tokens - 1, 1)


def _probe(runs: dict[int, list[GenerateResult]], plain_s: float, max_ahead: int) -> dict:
    """A draft loop count's measurements (speculative runs at each PROBE_AHEAD length) and its best draft length.
    Costs are the least over the runs: on a busy machine noise only ever adds time."""
    sts = [speculative_stats(r) for rs in runs.values() for r in rs]
    total = {k: sum(getattr(st, k) for st in sts) for k in ("drafted", "doubtful", "sure_tested", "sure_accepted",
                                                            "doubtful_tested", "doubtful_accepted")}
    model = ChainModel(total["sure_accepted"] / max(total["sure_tested"], 1),
                       total["doubtful"] / max(total["drafted"], 1),
                       total["doubtful_accepted"] / max(total["doubtful_tested"], 1))
    draft_s = min(st.draft_ms / 1000 / max(st.drafted + st.verify_steps, 1) for st in sts)
    points = []  # per probe length: (mean rows of a verification, its seconds)
    for rs in runs.values():
        ss = [speculative_stats(r) for r in rs]
        rounds = [max(st.verify_steps, 1) for st in ss]
        points.append((sum(st.drafted + st.verify_steps for st in ss) / sum(rounds),
                       min(st.verify_ms / 1000 / k for st, k in zip(ss, rounds))))
    (t1, v1), (t2, v2) = sorted(points)
    slope = max((v2 - v1) / (t2 - t1), 0.0) if t2 - t1 > 0.5 else 0.0  # a row more never costs less: that is noise

    def verify_s(T: float) -> float:  # the line through the two measured chunk sizes
        return max(v1 + slope * (T - t1), v1 / 2)

    n, predicted = best_length(model, draft_s, verify_s, plain_s, max_ahead)
    return {"accept": model.alpha, "doubtful": model.doubtful, "accept_doubtful": model.alpha_doubtful,
            "draft_ms": draft_s * 1000, "verify_ms": {round(t1, 2): v1 * 1000, round(t2, 2): v2 * 1000},
            "draft_ahead": n, "predicted": predicted}


def choose_speculative(model: Model, prompts: Seq, sc: SpeculativeConfig | None = None,
                       cfg: GenerateConfig | None = None, min_speedup: float = 1.1,
                       max_ahead: int = 12) -> SpeculativeChoice:
    """The seed's pattern 5: measure, then choose. On a few representative prompts (after a warm-up), each prompt in
    turn:
      1. plain decode at the verify loops: seconds per token (the least of all its runs);
      2. for each draft loop count D (1..4 below the verify loops, and sc's), speculative decode at draft lengths
         PROBE_AHEAD: how often a draft is doubtful, the acceptance of sure and doubtful drafts, and the seconds of
         a draft pass and of a verification of T rows (a line in T through the two lengths);
      3. the model (ChainModel): a round of up to n drafts yields tokens(n) for drafts(n) + 1 draft passes and one
         verification of as many rows: the (D, n) with the most tokens per second (n up to max_ahead);
      4. that pick against plain decode side by side, each prompt once each way: speculative only when it is more
         than `min_speedup` times faster, else plain (speculation off).
    Chains only (on the CPU trees cost more than they gain; docs/speculative.md). Returns the measurements, so a
    worker can log why it chose."""
    if not prompts:
        raise ConfigError("choose_speculative needs at least one prompt")
    cfg = cfg or GenerateConfig(max_tokens=32)
    sc = (sc or speculative_from_env() or SpeculativeConfig()).validate(model)
    V = sc.resolved_verify_loops(model, cfg)
    plain_cfg = dataclasses.replace(cfg, loops=V)

    def speculative(prompt, D: int, n: int) -> GenerateResult:
        return generate_speculative(model, prompt, SpeculativeConfig(D, V, n, fallback=False), cfg)

    generate(model, prompts[0], plain_cfg)  # warm-up: first calls pay for allocation
    speculative(prompts[0], sc.draft_loops, sc.draft_ahead)
    plain_s = float("inf")
    probes: dict[int, dict[int, list[GenerateResult]]] = {}
    for D in sorted({*range(1, min(V, 5)), sc.draft_loops}):  # plain decode between them: its least time is taken
        probes[D] = {n: [] for n in PROBE_AHEAD}                # over the whole measurement, as theirs are
        for prompt in prompts:
            plain_s = min(plain_s, _per_token_s(generate(model, prompt, plain_cfg)))
            for n in PROBE_AHEAD:
                probes[D][n].append(speculative(prompt, D, n))
    candidates = [{"draft_loops": D, **_probe(runs, plain_s, max_ahead)} for D, runs in probes.items()]
    best = max(candidates, key=lambda c: c["predicted"])
    pick = SpeculativeConfig(best["draft_loops"], V, best["draft_ahead"])
    rounds = dataclasses.replace(pick, fallback=False)  # measured as rounds: the pick decides whether they pay
    rows = []
    for prompt in prompts:  # side by side: each prompt plain, then speculative
        a, b = generate(model, prompt, plain_cfg), generate_speculative(model, prompt, rounds, cfg)
        bs = speculative_stats(b)
        rows.append({"plain_s": a.stats.decode_ms / 1000, "speculative_s": b.stats.decode_ms / 1000,
                     "plain_tokens": a.stats.generated_tokens, "speculative_tokens": b.stats.generated_tokens,
                     "speedup": _per_token_s(a) / max(_per_token_s(b), 1e-9), "drafted": bs.drafted,
                     "accepted": bs.accepted, "tokens_per_verify": bs.tokens_per_verify})
    speedup = statistics.median(r["speedup"] for r in rows)  # one stalled run moves a median least
    plain_tps = sum(r["plain_tokens"] - 1 for r in rows) / max(sum(r["plain_s"] for r in rows), 1e-9)
    spec_tps = sum(r["speculative_tokens"] - 1 for r in rows) / max(sum(r["speculative_s"] for r in rows), 1e-9)
    accept = sum(r["accepted"] for r in rows) / max(sum(r["drafted"] for r in rows), 1)
    return SpeculativeChoice(speedup > min_speedup, speedup, plain_tps, spec_tps, accept,
                             sum(r["tokens_per_verify"] for r in rows) / len(rows), min_speedup, pick, rows,
                             best["predicted"], candidates)
