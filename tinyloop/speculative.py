"""Self-speculative and tree-speculative decoding (DESIGN section 4; the seed's pattern 5).

A looped model is its own draft model: the same weights at `draft_loops` propose tokens and at
`verify_loops` check them. The state s_k of a token depends only on loops < k of the tokens up to it, so a
drafted token's state after draft_loops, and the K/V it wrote for those loops, are exactly what full decode
would have. Verification therefore *continues* the drafted states from draft_loops to verify_loops in one
pass over the drafted chunk; the draft's loops are never computed again (`stats.loop_steps` shows it).

One round, from the pending token t0 at position p (sampled, not in the cache yet), with n = draft_ahead:
  draft    t0, d1 .. dn one token at a time through prelude + draft_loops; d_{i+1} comes from the coda run
           on the draft-depth state of d_i (the coda's cache slots are shared with verification, which
           overwrites them for the chunk);
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
it skips, and drops out of the chunk for the remaining loops; the others continue. Greedy output then equals
plain early-exit `generate`.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from .cache import KVCache
from .engine.calls import checked, lanes
from .engine.sequence import Sequence
from .errors import ConfigError, ModeError
from .fields import MAX_LOOPS, SPECULATIVE_FIELDS
from .generation import generate
from .engine import forward as cached
from .model import Step
from .runtime import Model
from .sampling import filter_logits
from .types import GenerateConfig, GenerateResult, GenerateStats, OnToken


# --- configuration ------------------------------------------------------------------------------------
@dataclass
class SpeculativeConfig:
    """draft_loops < verify_loops; verify_loops None = GenerateConfig.loops (or the model's default)."""
    draft_loops: int = 2
    verify_loops: int | None = None
    draft_ahead: int = 4
    tree_width: int = 1

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
    return SpeculativeConfig(*nums).validate()


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


# --- the speculator ------------------------------------------------------------------------------------
class TreeShape:
    """Cells and ancestor mask of one round's tree: token i (0 = root) sits in cell p + i.

    Token i >= 1 is at depth d = (i-1)//w + 1 (position p + d) on branch b = (i-1) % w; it sees the committed
    cells (<= p) and the earlier tokens of its own branch.
    """

    def __init__(self, p: int, w: int, n: int, device):
        self.p, self.w = p, w
        c = torch.arange(p + 1 + n * w, device=device)
        t = (c - p - 1).clamp_min(0)
        tree = c > p
        self.key_pos = torch.where(tree, p + 1 + t // w, c).unsqueeze(0)
        self.branch = torch.where(tree, t % w, -1)
        self.depth = torch.where(tree, t // w + 1, 0)
        self.cells = c

    def step(self, net, pos: list[int], cells: list[int]) -> Step:
        end = max(cells) + 1
        qc, kc = torch.tensor(cells, device=self.cells.device), self.cells[:end]
        same_branch = (self.branch[kc].unsqueeze(0) == self.branch[qc].unsqueeze(1)) & \
                      (self.depth[kc].unsqueeze(0) <= self.depth[qc].unsqueeze(1))
        mask = (kc <= self.p).unsqueeze(0) | ((qc > self.p).unsqueeze(1) & (kc > self.p).unsqueeze(0) & same_branch)
        return Step(torch.tensor([pos], device=qc.device), end, net.rope_cos, net.rope_sin,
                    cells=qc.unsqueeze(0), key_pos=self.key_pos[:, :end], mask=mask.unsqueeze(0))


class Speculator:
    """Runs speculative rounds over one lane of a KVCache; counts loop-steps."""

    def __init__(self, model: Model, sc: SpeculativeConfig, seq: Sequence, cache: KVCache, verify_loops: int,
                 guess: list[int] = ()):
        cfg = seq.cfg
        self.model, self.net, self.cache, self.cfg, self.seq = model, model.net, cache, cfg, seq
        self.D, self.V, self.n, self.w = sc.draft_loops, verify_loops, sc.draft_ahead, sc.tree_width
        self.threshold = cfg.early_exit_threshold
        self.adaptive = self.net.adaptive(self.threshold)
        if self.adaptive and model.cfg.exit_rule == "cdf":  # drafts stop per token; Ouro's rule picks among all loops
            raise ModeError("speculative decoding with early exit under the model's cdf exit rule (Ouro) is not "
                            "supported; decode without early_exit_threshold, or without speculation")
        self.greedy = cfg.temperature == 0
        # a known continuation to verify before drafting (greedy chains without early exit only): see run
        self.guess = list(guess) if self.greedy and sc.tree_width == 1 and not self.adaptive else []
        self.gen = seq.gen  # the sequence's sampler draws the proposals and acceptances too
        self.used_at: dict[int, int] = {}  # loops used by the token at each committed position
        self.draft_loop_steps = self.verify_loop_steps = 0
        self.coda_slots = [model.cfg.coda_slot(i) for i in range(model.cfg.n_coda)]

    # -- sampling helpers ---------------------------------------------------------------------------
    def penalised(self, logits: torch.Tensor, extra: list[int]) -> torch.Tensor:
        return self.seq.penalised(logits, extra)

    def probs(self, logits: torch.Tensor, extra: list[int]) -> torch.Tensor:
        c = self.cfg
        return torch.softmax(filter_logits(self.penalised(logits, extra), c.temperature, c.top_k, c.top_p), dim=-1)

    def draw(self, probs: torch.Tensor, k: int = 1) -> list[int]:
        return torch.multinomial(probs, k, replacement=True, generator=self.gen).tolist()

    def propose(self, logits: torch.Tensor, extra: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """k draft tokens after a node (greedy: the top k; sampled: k independent draws) and their q."""
        if self.greedy:
            return torch.topk(self.penalised(logits, extra), k).indices.tolist(), None
        q = self.probs(logits, extra)
        return self.draw(q, k), q

    # -- depth -------------------------------------------------------------------------------------------
    def make_step(self, pos: list[int], cells: list[int], tree: TreeShape | None) -> Step:
        if tree is None:
            return self.net.make_step(torch.tensor([pos], device=self.model.device), max(pos) + 1)
        return tree.step(self.net, pos, cells)

    def context(self, step: Step) -> cached.Cached:
        return cached.context(self.net, step, self.cache)

    def deepen(self, s, e, step: Step, pos: list[int], cells: list[int], tree: TreeShape | None,
               k0: int, k1: int, used: list[int], done: list[bool]) -> tuple[torch.Tensor, int]:
        """Run loops k0..k1-1 over a chunk; returns the states and the loop-steps executed.

        With early exit a token whose latent stops changing freezes, copies its K/V into the slots of every
        loop it skips (up to verify_loops) and leaves the chunk, exactly as forward_adaptive does per token.
        """
        T = s.shape[1]
        if not self.adaptive:
            ctx = self.context(step)
            for k in range(k0, k1):
                s = self.net.loop(s, e, k, ctx)
            used[:] = [k1] * T
            return s, T * (k1 - k0)
        s, steps = s.clone(), 0
        for k in range(k0, k1):
            act = [i for i in range(T) if not done[i]]
            if not act:
                break
            idx = torch.tensor(act, device=s.device)
            sub = step if len(act) == T else self.make_step([pos[i] for i in act], [cells[i] for i in act], tree)
            s_old = s[:, idx]
            s_new = self.net.loop(s_old, e[:, idx], k, self.context(sub))
            stop = self.net.exit_mask(s_old.transpose(0, 1), s_new.transpose(0, 1), self.threshold).tolist()
            s[:, idx] = s_new
            steps += len(act)
            for i, st in zip(act, stop):
                used[i] = k + 1
                if st:
                    done[i] = True
                    self.fill_skipped(cells[i], k)
        return s, steps

    def draft(self, tokens: list[int], pos: list[int], cells: list[int], tree: TreeShape | None, head: bool):
        """A chunk of tokens (the root, a tree level, or a guessed chain) through prelude and draft_loops and, if
        head, the coda and head. Returns s, e [1, T, d], logits [1, T, V] (None without head), the loops each
        token used, whether it exited early, and the loop-steps run."""
        step, T = self.make_step(pos, cells, tree), len(tokens)
        ctx = self.context(step)
        used, done = [0] * T, [False] * T
        e = self.net.encode(torch.tensor([tokens], device=self.model.device), ctx)
        s, steps = self.deepen(self.net.init_state(e, step), e, step, pos, cells, tree, 0, self.D, used, done)
        return s, e, self.net.decode_head(s, ctx) if head else None, used, done, steps

    def fill_skipped(self, cell: int, last: int) -> None:
        at = torch.tensor([[cell]], device=self.model.device)
        for k in range(last + 1, self.V):
            for j in range(self.model.cfg.n_core):
                self.cache.copy_slot(self.model.cfg.core_slot(last, j), self.model.cfg.core_slot(k, j), at)

    # -- one round -----------------------------------------------------------------------------------
    def round(self, pending: int, p: int, n: int, w: int, guessed: list[int]) -> tuple[list[int], int]:
        """Draft from the pending token at position p (depth n, width w), verify, accept, commit. With
        `guessed` tokens (a chain known in advance) the drafts are those, their draft depth computed as one chunk.

        Returns the tokens the round yields (accepted drafts, then a correction or bonus) and the number of
        drafted tokens accepted.
        """
        net, cache, dev = self.net, self.cache, self.model.device
        tree = TreeShape(p, w, n, dev) if w > 1 else None
        N = 1 + n * w
        pos = [p] + [p + (i - 1) // w + 1 for i in range(1, N)]
        cells = list(range(p, p + N))  # chain: cell = position
        toks = [pending] + [0] * (N - 1)
        parent = [-1] + [0 if i <= w else i - w for i in range(1, N)]
        q: dict[int, torch.Tensor] = {}  # sampled mode: the distribution a node's children were drawn from
        used, done = [0] * N, [False] * N
        states, embeds = [], []

        def path(i: int) -> list[int]:  # draft tokens after the root on the way to node i
            out = []
            while i > 0:
                out.append(toks[i])
                i = parent[i]
            return out[::-1]

        if guessed:  # prelude and draft loops of the whole known chain in one pass; nothing to propose
            toks[1:] = guessed
            s, e, _, used, done, steps = self.draft(toks, pos, cells, None, head=False)
            self.draft_loop_steps += steps
            states.append(s)
            embeds.append(e)
        # draft: level 0 is the root, level d holds tokens 1+(d-1)w .. dw
        for d in range(0 if guessed else n + 1):
            lvl = [0] if d == 0 else list(range(1 + (d - 1) * w, 1 + d * w))
            s, e, logits, u, dn, steps = self.draft([toks[i] for i in lvl], [pos[i] for i in lvl],
                                                    [cells[i] for i in lvl], tree if d > 0 else None, head=d < n)
            self.draft_loop_steps += steps
            for r, i in enumerate(lvl):
                used[i], done[i] = u[r], dn[r]
            states.append(s)
            embeds.append(e)
            if d == n:
                break
            logits = logits[0]
            for r, i in enumerate(lvl):
                kids = list(range(1, 1 + w)) if d == 0 else [i + w]
                proposed, q[i] = self.propose(logits[r], path(i), len(kids))
                for c, t in zip(kids, proposed):
                    toks[c] = t

        # verify: continue every drafted state from draft_loops to verify_loops in one pass, then the coda
        step = self.make_step(pos, cells, tree)
        if cache.window:
            cache.rollback(p, self.coda_slots)  # the ring is read as old + new: drop the draft-depth coda entries
        s, steps = self.deepen(torch.cat(states, 1), torch.cat(embeds, 1), step, pos, cells, tree, self.D, self.V,
                               used, done)
        logits = net.decode_head(s, self.context(step))[0]
        self.verify_loop_steps += steps

        # accept: walk down the tree from the root
        out, accepted, node = [], [], 0
        while True:
            kids = [] if N == 1 else list(range(1, 1 + w)) if node == 0 else [node + w] if node + w < N else []
            if self.greedy:
                t = int(torch.argmax(self.penalised(logits[node], out)))
                nxt = next((c for c in kids if toks[c] == t), None)
            else:
                target, nxt = self.probs(logits[node], out), None
                for c in kids:  # candidates in turn; each rejection leaves the residual max(0, p - q)
                    x = toks[c]
                    if float(torch.rand((), generator=self.gen)) * float(q[node][x]) < float(target[x]):
                        nxt = c
                        break
                    resid = (target - q[node]).clamp_min(0)
                    target = resid / resid.sum() if resid.sum() > 0 else target
                t = toks[nxt] if nxt is not None else self.draw(target)[0]
            out.append(t)
            if nxt is None:
                break
            accepted.append(nxt)
            node = nxt

        # commit: the accepted branch to its positions, the loops each committed token used, forget the rest
        a = len(accepted)
        if tree is not None and a and accepted != list(range(1, a + 1)):
            cache.move_cells(torch.tensor([cells[i] for i in accepted], device=dev),
                             torch.arange(p + 1, p + 1 + a, device=dev))
        for j, i in enumerate([0] + accepted):
            self.used_at[p + j] = used[i]
        cache.rollback(p + a + 1)
        return out, a

    # -- the whole generation -------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, prefill: Callable[[], torch.Tensor] | None = None) -> GenerateResult:
        """Prefill (or `prefill()`: the prompt's last logits, the cache filled by a handle) and decode; the
        sequence does the per-token bookkeeping as in plain decode."""
        seq, cfg, model, net = self.seq, self.cfg, self.model, self.net
        stats: SpeculativeStats = seq.stats
        prompt_ids = seq.prompt
        t0 = time.perf_counter()
        P = len(prompt_ids)
        if prefill is not None:
            logits = prefill()
        else:
            step = net.make_step(torch.arange(P, device=model.device).unsqueeze(0), P)
            logits = cached.forward(net, torch.tensor([prompt_ids], device=model.device), self.V, step, self.cache,
                                    last_only=True)[0, -1]
        seq.t_prefilled = time.perf_counter()
        stats.prefill_ms = (seq.t_prefilled - t0) * 1000
        first = seq.sample(logits)
        going, pending, p = seq.take(first), first, P
        piece = 4
        while going:
            left = cfg.max_tokens - seq.count  # tokens still to sample; a round yields at most depth + 1
            n, w = min(self.n, left - 1), self.w
            if w > 1:  # tree cells p .. p + n*w must fit the cache
                n = min(n, (self.cache.max_len - 1 - p) // w)
                if n == 0:
                    n, w = min(self.n, left - 1), 1
            guessed = []
            if self.guess and seq.history[P:] != self.guess[:p - P + 1]:
                self.guess = []  # the output left the guess: draft from here on
            if self.guess:  # everything so far, the pending token too, was guessed: verify the next piece
                guessed = self.guess[p - P + 1:p - P + 1 + min(piece, left - 1)]
                n, w, piece = len(guessed) or n, 1, piece * 2  # a next piece only if this one is taken whole
            out, a = self.round(pending, p, n, w, guessed)
            stats.verify_steps += 1
            stats.drafted += n
            stats.accepted += a
            for t in out:
                if not seq.take(t):
                    going = False
                    break
            pending, p = out[-1], p + len(out)
        # as plain decode counts it: the prefill, then one forward per sampled token but the last
        seq.loop_counts = [self.V] + [self.used_at[P + i] for i in range(seq.count - 1) if P + i in self.used_at]
        result = seq.result()
        stats.draft_accept_rate = stats.accepted / stats.drafted if stats.drafted else 0.0
        stats.tokens_per_verify = (seq.count - 1) / stats.verify_steps if stats.verify_steps else 0.0
        stats.draft_loop_steps, stats.verify_loop_steps = self.draft_loop_steps, self.verify_loop_steps
        stats.loop_steps = self.draft_loop_steps + self.verify_loop_steps
        return result


def generate_speculative(model: Model, prompt, sc: SpeculativeConfig | None = None, cfg: GenerateConfig | None = None,
                         on_token: OnToken | None = None) -> GenerateResult:
    """Generate with self-speculative decoding. sc None: TINYLOOP_SPECULATIVE, else SpeculativeConfig().

    Greedy output equals `generate` at verify_loops; sampled output keeps its distribution. `on_token`
    streams as in generate_stream. result.stats is a SpeculativeStats.
    """
    sc = (sc or speculative_from_env() or SpeculativeConfig()).validate(model)
    cfg = checked(model, cfg, "tree_speculative" if sc.tree_width > 1 else "speculative")
    verify_loops = sc.resolved_verify_loops(model, cfg)
    # a ring gets room for the drafts a round may roll back without evicting what the window still needs
    ring = cfg.cache_window + sc.draft_ahead + 1 if cfg.cache_window else 0
    with model.busy():
        ids = model.encode_prompt(prompt)
        with lanes(model, [ids], [cfg], loops=verify_loops, ring=ring) as cache:
            return speculate(model, ids, sc, cfg, cache, verify_loops, on_token)


def speculate(model: Model, ids: list[int], sc: SpeculativeConfig, cfg: GenerateConfig, cache: KVCache,
              verify_loops: int, on_token: OnToken | None, prefill: Callable[[SpeculativeStats], torch.Tensor] | None = None,
              guess: list[int] = ()) -> GenerateResult:
    """Speculative decode of `ids` over `cache` (the model held by the caller); `prefill(stats)`, when given,
    fills the cache for the prompt and returns its last logits (resume_generate's refine). `guess`: a likely
    greedy continuation (the refine's draft); while the output follows it, rounds verify pieces of it (4, 8,
    16 ... tokens) instead of drafting token by token."""
    stats = SpeculativeStats(draft_loops=sc.draft_loops, verify_loops=verify_loops, draft_ahead=sc.draft_ahead,
                             tree_width=sc.tree_width)
    # small steps run best on one thread (engine/forward.py: decode_threads); the verify chunk is the largest
    threads, before = cached.decode_threads(1 + sc.draft_ahead * sc.tree_width, model.cfg), torch.get_num_threads()
    if model.device.type == "cpu" and threads and threads != before:
        torch.set_num_threads(threads)
    try:
        seq = Sequence(model, ids, cfg, on_token, stats=stats)
        return Speculator(model, sc, seq, cache, verify_loops, guess).run(None if prefill is None else lambda: prefill(stats))
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


# --- pattern 5: benchmark, then choose ---------------------------------------------------------------------
@dataclass
class SpeculativeChoice:
    """What choose_speculative measured, and its decision (speculative only when speedup > min_speedup)."""
    use_speculative: bool
    speedup: float
    plain_tokens_per_s: float
    speculative_tokens_per_s: float
    draft_accept_rate: float
    tokens_per_verify: float
    min_speedup: float
    config: SpeculativeConfig
    per_prompt: list[dict] = field(default_factory=list)

    def line(self) -> str:
        sc = self.config
        return (f"speculative {sc.draft_loops}->{sc.verify_loops} ahead {sc.draft_ahead} width {sc.tree_width}: "
                f"{self.speculative_tokens_per_s:.1f} vs plain {self.plain_tokens_per_s:.1f} tok/s = {self.speedup:.2f}x "
                f"(accept {self.draft_accept_rate:.2f}, {self.tokens_per_verify:.2f} tok/verify) -> "
                f"{'speculative' if self.use_speculative else 'plain'} (needs > {self.min_speedup}x)")


def choose_speculative(model: Model, prompts: Seq, sc: SpeculativeConfig | None = None,
                       cfg: GenerateConfig | None = None, min_speedup: float = 1.3) -> SpeculativeChoice:
    """The seed's pattern 5: time plain and speculative decode side by side on a few representative prompts
    (each prompt once each way, after one warm-up) and pick speculative only when it is more than
    `min_speedup` times faster in tokens/s. Returns the measurements so a worker can log them."""
    if not prompts:
        raise ConfigError("choose_speculative needs at least one prompt")
    cfg = cfg or GenerateConfig(max_tokens=32)
    sc = sc or speculative_from_env() or SpeculativeConfig()
    plain_cfg = dataclasses.replace(cfg, loops=sc.resolved_verify_loops(model, cfg))
    generate(model, prompts[0], plain_cfg)  # warm-up: first calls pay for allocation
    generate_speculative(model, prompts[0], sc, cfg)
    rows, plain_s, spec_s, plain_n, spec_n, drafted, accepted, verifies = [], 0.0, 0.0, 0, 0, 0, 0, 0
    for prompt in prompts:
        t = time.perf_counter()
        a = generate(model, prompt, plain_cfg)
        t_plain = time.perf_counter() - t
        t = time.perf_counter()
        b = generate_speculative(model, prompt, sc, cfg)
        t_spec = time.perf_counter() - t
        plain_s, spec_s = plain_s + t_plain, spec_s + t_spec
        plain_n, spec_n = plain_n + a.stats.generated_tokens, spec_n + b.stats.generated_tokens
        drafted, accepted, verifies = drafted + b.stats.drafted, accepted + b.stats.accepted, verifies + b.stats.verify_steps
        rows.append({"plain_s": t_plain, "speculative_s": t_spec, "plain_tokens": a.stats.generated_tokens,
                     "speculative_tokens": b.stats.generated_tokens, "draft_accept_rate": b.stats.draft_accept_rate,
                     "tokens_per_verify": b.stats.tokens_per_verify})
    plain_tps, spec_tps = plain_n / max(plain_s, 1e-9), spec_n / max(spec_s, 1e-9)
    speedup = spec_tps / max(plain_tps, 1e-9)
    return SpeculativeChoice(speedup > min_speedup, speedup, plain_tps, spec_tps, accepted / max(drafted, 1),
                             sum(r["tokens_per_verify"] for r in rows) / len(rows), min_speedup,
                             SpeculativeConfig(sc.draft_loops, sc.resolved_verify_loops(model, cfg), sc.draft_ahead,
                                               sc.tree_width), rows)
