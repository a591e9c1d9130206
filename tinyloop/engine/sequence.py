"""Sequence: one request's state, from its prompt to its result.

It owns what turns logits into output: the sampler (repetition penalty, grammar mask, temperature, top-k/p, a
seeded generator), the stop matcher, the grammar state, streaming (on_token, cancellation), the loop counts of
early exit, and the stats. Every call is a way of creating sequences and feeding them logits: plain and streamed
generate, batches, beam hypotheses (Sequence.fork), speculative rounds, prefix reuse and warm starts.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import NamedTuple, Protocol

import torch

from ..cache import KVCache
from ..sampling import LaneSampling, adjust, sample
from ..stops import StopMatcher
from ..exits import ExitRule, Track
from ..request import (GenerateConfig, GenerateResult, GenerateStats, OnToken, loss_increase, loss_table,
                       make_generator)


class AssignsLanes(Protocol):
    """What re-assigns lanes when a beam's children take their parents' cells (the executor, over its windowed
    lanes' rings too, or a KVCache)."""
    def assign_lanes(self, dst: list[int], src: list[int]) -> None: ...


class BeamRequest(Protocol):
    """The beam-search request a hypothesis belongs to, as its sequence and the scheduler see it (engine/beam.py's
    BeamGroup, which imports this module)."""
    root: Sequence
    lanes: list[int]
    live: list[tuple[Sequence, float]]
    outcome: GenerateResult | None

    @property
    def members(self) -> list[Sequence]: ...

    def advance(self, lanes_of: "AssignsLanes") -> list[Sequence]: ...

    def cancel(self) -> None: ...


class Client:
    """Who added a sequence to a runner: at most `lanes` of its sequences' lanes run at once, and the sequences of its
    that finish, in whoever's step, wait in `finished` until it takes them."""

    def __init__(self, lanes: int):
        self.lanes = lanes
        self.finished: list[Sequence] = []
        self.closed = False  # gone (a Scheduler collected): the engine gives up its sequences at its next step

    def take(self) -> list[Sequence]:
        done, self.finished = self.finished, []
        return done


# Sequence.prefix_cache's default: the engine's automatic prefix cache (when the model has prefix caching on)
ENGINE_PREFIXES = object()


# the cells the rest of a prompt writes after a handle lent its blocks: (slots, first cell, last cell)
Writes = tuple[list[int], int, int]
# a token's log-probability and the most likely (token, log-probability) pairs beside it, best first
Score = tuple[float, list[tuple[int, float]]]


@dataclasses.dataclass
class Start:
    """What replaces a prompt's prefill when a handle holds its first tokens (a resume handle, a prefix cache). In the
    step that schedules it, `lend(lane)` gives the handle's blocks to the lane (no forward) and returns the cells the
    rest of the prompt writes (None: none), so the scheduler takes their blocks with the step's others; the step's
    execute then calls `run(lane)`, which runs the rest and returns the logits [V] of the prompt's last position."""
    lend: Callable[[KVCache], Writes | None]
    run: Callable[[KVCache], torch.Tensor]


@dataclasses.dataclass
class Place:
    """Where a sequence stands in the engine: the lane state the scheduler keeps, apart from the request's own
    (Sequence). Reset when the sequence is preempted; a beam hypothesis gets its own copy."""
    # the cache lane it holds while admitted, None while it holds none (waiting, preempted, done). Typed int: the
    # engine reads it only of admitted sequences, an invariant mypy cannot follow.
    lane: int = None  # type: ignore[assignment]  # the cache lane it holds while admitted
    cached: int = 0  # prompt tokens in the lane's cache
    first: Start | None = None  # what replaces its prefill (a handle's, the prefix cache's)
    logits: torch.Tensor | None = None  # fresh logits to sample from
    prompt_row: bool = False  # its next decode row is the prompt's last token (the rest came from the prefix cache)
    decided: list[int] = dataclasses.field(default_factory=list)  # a driver's round's tokens, taken in postprocess
    drafter: "Drafter | None" = None  # its round around this step's shared forward (Plan.drafting), set at schedule
    drawn: list[int] = dataclasses.field(default_factory=list)  # tokens the C passes drew greedily (a Row's draws)
    # the logits [V] each drawn token was chosen from, where the request asks for log-probabilities (Row.keep_logits)
    chosen_from: list[torch.Tensor] = dataclasses.field(default_factory=list)
    arrival: int = 0  # its order of arrival in the runner (#n in the scheduler's log)
    came: int = 0  # the runner's step count when it arrived (the same for requests that came between two steps)

    def fresh(self) -> torch.Tensor:
        """The fresh logits, where the caller knows there are some."""
        assert self.logits is not None
        return self.logits


@dataclasses.dataclass
class InFlight:
    """A token between loop iterations (continuous-depth batching, Executor.iterate): the passes it has run, its latent
    rows (the prelude's output e and the state s, [1, 1, d] each), and, for a lane that may exit early, what the
    exit bookkeeping keeps for one token: the state it exits with, whether its exit loop is chosen, the loops it
    used, what its rule remembers between loops (exits.Track, one row), and the logits of its exit loop where its
    rule read them; while its passes run in C, e, s and out are its lane's rows of CBackend.latent."""
    done: int
    e: torch.Tensor
    s: torch.Tensor
    adaptive: bool = False
    out: torch.Tensor | None = None
    chosen: bool = False
    used: int = 0
    track: Track | None = None
    logits: torch.Tensor | None = None
    c_exit: list | None = None  # its exit rule's state while its passes run in C (Executor.iterate_in_c)

    def exit_state(self) -> torch.Tensor:
        """The state it exits with (chosen by its exit rule)."""
        assert self.out is not None
        return self.out


class Driver(Protocol):
    """What runs a sequence's own forwards (Sequence.driver): a speculative round (speculative.Speculator), a
    refine's verified piece of its guess (resume.GuessFollower). A step's round is its own forwards where it `runs`
    (`step`: the tokens it decides), or, where it offers a `drafter`, a round around the step's shared forward."""
    chosen_from: torch.Tensor | None  # [len(decided), V]: the logits each token of the last step was chosen from

    def runs(self, alone: bool) -> bool: ...

    def span(self) -> int: ...

    def plain_row(self, seconds: float) -> None: ...

    def step(self, cache: KVCache) -> list[int]: ...

    def drafter(self, alone: bool) -> "Drafter | None": ...

    def finish(self) -> None: ...


class Draft(NamedTuple):
    """A drafted chunk (plan.py's Chunk, from the lane's pending token): its tokens, the exit rule each of its rows
    stops by (None: every loop), its tree width (1: a chain)."""
    tokens: list[int]
    exit: ExitRule | None
    width: int


class Drafter(Protocol):
    """A round around a step's shared forward (speculative.Speculator beside other rows): its drafts before the
    forward (`draft`: the chunk to verify), the chunk's verification as rows of that forward, and `accept`: the
    tokens those logits and loops decide."""

    def draft(self, cache: KVCache) -> Draft: ...

    def accept(self, logits: torch.Tensor, used: list[int]) -> list[int]: ...


class Sequence:
    def __init__(self, model, prompt: list[int], cfg: GenerateConfig, on_token: OnToken | None = None,
                 t_call: float | None = None, stats: GenerateStats | None = None):
        self.model, self.prompt, self.cfg, self.on_token = model, prompt, cfg, on_token
        self.t_call = time.perf_counter() if t_call is None else t_call
        self.loops = cfg.resolved_loops(model)
        self.rule = cfg.exit(model)  # its early exit (tinyloop/exits.py): rule, threshold, min_loops
        self.gen = make_generator(cfg.seed)
        self.history = list(prompt)  # prompt + tokens taken: what the repetition penalty sees
        self.matcher = StopMatcher(model.codec, list(cfg.stop_sequences) + [[t] for t in cfg.stop_token_ids])
        self.grammar = None
        if cfg.grammar is not None:
            from ..grammar import GrammarState  # xgrammar imports transformers (~1 s): only when a grammar is asked for

            self.grammar = GrammarState.for_model(model, cfg.grammar)
        self.stats = stats or GenerateStats()  # speculative calls bring SpeculativeStats
        self.stats.prompt_tokens, self.stats.cache_mode = len(prompt), model.cache_mode
        self.pos = len(prompt)      # where the next fed token goes
        self.token = prompt[-1]     # the token fed next
        self.count = 0              # tokens sampled
        self.emitted = 0            # tokens streamed
        self.done, self.stop_reason = False, "max_tokens"
        self.loop_counts: list[int] = []  # loops run per forward that produced a sampled token
        # with cfg.logprobs: per token taken, its log-probability and the most likely (token, log-probability) pairs
        self.scores: list[Score] = []
        # with cfg.prompt_logprobs: the same for prompt tokens 1.. as its prefill pieces score them (score_prompt)
        self.prompt_scores: list[Score] | None = [] if cfg.prompt_logprobs is not None else None
        self.t_prefilled = self.t_end = self.t_call
        self.place = Place()  # where it stands in the engine (engine/scheduler.py): the scheduler's state of it
        self.prefixes = None  # where its prompt's prefix may be found besides the runner's prefix cache (a pool's view)
        # the prefix cache it reads its prompt from and adds its blocks to: the engine's (automatic prefix caching, when
        # the model has it on), None, or its own (a lookup-only view)
        self.prefix_cache: object = ENGINE_PREFIXES
        self.whole_prompt = False  # its prompt goes in as one prefill piece (not cut at the model's prefill_chunk)
        # who added it to the engine (engine/runner.py), and takes it when finished (a beam's hypotheses: its root's,
        # copied by fork)
        self.client: Client | None = None
        self.beam: BeamRequest | None = None  # the BeamGroup (tinyloop/engine/beam.py) of a beam-search request and its hypotheses
        # what runs the lane's decode forwards instead of a plain row when it `runs` (a speculative lane's Speculator,
        # a refine's GuessFollower): runs(alone), span() (cells a step may write from seq.pos), step(cache) -> the
        # tokens it decided (or [] with seq.place.logits set), plain_row(seconds), finish()
        self.driver: Driver | None = None
        # called with the GenerateResult (a refine keeps its answer as the handle's next guess)
        self.on_result: Callable[[GenerateResult], None] | None = None
        # called with its lane and the last position's logits once its prompt is in, before the lane's blocks can go
        # back (a prefix or resume handle built by engine steps keeps them: handle_base.prefill_by_steps)
        self.on_prefilled: Callable[[KVCache, torch.Tensor], None] | None = None
        # its cells may go to the prefix cache (not when a handle's prefill built them, nor a ring's)
        self.cacheable = not cfg.cache_window
        # with cfg.cache_window: the cells of its lanes' ring (the window, or more where a speculative lane's drafts
        # may roll back); its lanes keep their K/V there (Executor.attach_ring), not in the batch's block tables
        self.ring = cfg.cache_window
        # its prompt pieces' latent rows by start: (e, s) [1, T_piece, d] each (Executor.latent_piece); None: not asked
        # (a resume handle built by engine steps asks: it keeps every prompt token's, tinyloop/resume.py)
        self.latents: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.error: Exception | None = None  # why the scheduler gave it up (a BudgetError)
        # elastic depth (engine/elastic.py): the fewest loops the load controller may give its tokens (None: fixed
        # depth, never touched), the notch it stands at (0: its loops) and the cap that gives (None: untouched), the
        # forced depth of each token the scheduler planned under a cap (by index), and the seconds it waited before it
        # reached this runner (a broker's queue)
        self.floor = cfg.depth_floor(model)
        self.depth_notch = 0
        self.depth_cap: int | None = None
        self.depths: dict[int, int | None] = {}
        self.prompt_loops: int | None = None  # the loops its prompt runs, decided at its first piece (prompt_depth)
        self.queued_s = 0.0

    # --- sampling -----------------------------------------------------------------------------------------
    def penalised(self, logits: torch.Tensor, extra: Seq[int] = ()) -> torch.Tensor:
        """Logits [V] after every adjustment the config asks for (penalties, logit bias, tokens banned until
        min_tokens), with `extra` tokens taken after the history (speculative drafts pass their path)."""
        lane = self.sampling(extra)
        if lane.repetition_penalty == 1.0 and not lane.adjusts:
            return logits
        return adjust(logits.unsqueeze(0), [lane])[0]

    def sampling(self, extra: Seq[int] = ()) -> LaneSampling:
        """Its settings for the sampler (tinyloop/sampling.py) now, with `extra` tokens taken after the history."""
        c = self.cfg
        seen = self.history + list(extra) if extra else self.history
        early = self.count + len(extra) < c.min_tokens  # EOS and stop tokens may not end the output yet
        banned = ([] if c.ignore_eos else [self.model.eos_id]) + list(c.stop_token_ids) if early else []
        # the output and the bias are built only for a lane that uses them: this runs for every lane at every step
        counted = seen[len(self.prompt):] if c.presence_penalty or c.frequency_penalty else []
        bias = {int(k): float(v) for k, v in c.logit_bias.items()} if c.logit_bias else {}
        return LaneSampling(c.temperature, c.top_k, c.top_p, c.repetition_penalty, seen, self.gen, c.min_p,
                            c.presence_penalty, c.frequency_penalty, counted, bias, banned, self.grammar is not None)

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [V] with the tokens the grammar forbids now at -inf."""
        return logits if self.grammar is None else self.grammar.mask(logits)

    @staticmethod
    def sample_all(seqs: list["Sequence"], logits: list[torch.Tensor]) -> list[int]:
        """The next token of each sequence from its logits [V], all drawn in one pass of the sampler."""
        rows = torch.stack([seq.masked(row) for seq, row in zip(seqs, logits)])
        return sample(rows, [seq.sampling() for seq in seqs])

    def sample(self, logits: torch.Tensor) -> int:
        return Sequence.sample_all([self], [logits])[0]

    @staticmethod
    def score_all(seqs: list["Sequence"], logits: list[torch.Tensor], tokens: list[int]) -> None:
        """Note the log-probability of each chosen token under the logits [V] it was chosen from, and the cfg.logprobs
        most likely tokens', for the sequences that ask (cfg.logprobs not None): one log-softmax for all of them."""
        asking = [i for i, seq in enumerate(seqs) if seq.cfg.logprobs is not None]
        if not asking:
            return
        k = max(seqs[i].cfg.logprobs or 0 for i in asking)  # (not None: asking)
        got = scored_rows(torch.stack([logits[i] for i in asking]), [tokens[i] for i in asking], k)
        for (chosen, top), i in zip(got, asking):
            seqs[i].scores.append((chosen, top[:seqs[i].cfg.logprobs]))

    def rows_wanted(self, start: int, n: int) -> bool:
        """Whether a prefill piece of n prompt tokens at start.. must give back every row's logits: the sequence asks
        for prompt log-probabilities and some row predicts a prompt token not scored yet (a piece run again after a
        preemption scores nothing twice)."""
        return self.prompt_scores is not None and len(self.prompt_scores) < min(start + n, len(self.prompt) - 1)

    def score_prompt(self, start: int, rows: torch.Tensor) -> None:
        """Score the prompt tokens that rows [n, V] of the prefill piece at start.. predict (row i: token start + i +
        1; the last prompt row predicts the output, not the prompt), those not scored yet."""
        assert self.prompt_scores is not None and self.cfg.prompt_logprobs is not None  # (asked: rows_wanted)
        done = len(self.prompt_scores)  # tokens 1..done are scored
        assert done >= start  # (a prompt's pieces come in order)
        first, last = max(start, done), min(start + len(rows), len(self.prompt) - 1)  # rows first..last-1 are new
        if first < last:
            self.prompt_scores += scored_rows(rows[first - start:last - start], self.prompt[first + 1:last + 1],
                                              self.cfg.prompt_logprobs)

    # --- bookkeeping of one chosen token --------------------------------------------------------------------
    def take(self, token: int) -> bool:
        """Account a chosen token: grammar, EOS, stop sequences, streaming, max_tokens. True: feed it next."""
        if self.count == 0:
            self.stats.first_token_ms = (time.perf_counter() - self.t_call) * 1000
        self.count += 1
        if self.grammar is not None:
            self.grammar.accept(token)
        if token == self.model.eos_id and not self.cfg.ignore_eos:  # under a grammar: only once the output is complete
            return self.finish("grammar_complete" if self.grammar is not None else "eos")
        ready, stopped = self.matcher.push(token, can_stop=self.count >= self.cfg.min_tokens)
        if not self.emit(ready):
            return self.finish("cancelled")
        if stopped:
            return self.finish("stop_sequence")
        if self.grammar is not None and self.grammar.must_end():
            return self.finish("grammar_complete")
        if self.count == self.cfg.max_tokens:
            return self.finish("max_tokens")
        self.history.append(token)
        self.token = token
        return True

    def emit(self, tokens: list[int]) -> bool:
        for t in tokens:
            keep = self.on_token(t, self.emitted) if self.on_token is not None else True
            self.emitted += 1
            if keep is False:
                return False
        return True

    def cancel(self) -> None:
        """Stop from outside (a client's cancel, a deadline): the scheduler drops it at the next step boundary."""
        if not self.done:
            self.finish("cancelled")

    def finish(self, reason: str) -> bool:
        self.done, self.stop_reason = True, reason
        if reason in ("eos", "max_tokens", "grammar_complete") and not self.emit(self.matcher.flush()):
            self.stop_reason = "cancelled"
        self.t_end = time.perf_counter()
        return False

    # --- results ---------------------------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """The output: what was streamed if cancelled, else cut before a stop sequence, without EOS."""
        m = self.matcher
        return m.tokens[:self.emitted] if self.stop_reason == "cancelled" else m.tokens

    @property
    def text(self) -> str:
        m = self.matcher
        return m.text if self.stop_reason == "stop_sequence" and m.strings else self.model.codec.decode(self.tokens)

    @property
    def exit(self) -> ExitRule:
        """The exit rule of the token it produces next."""
        return self.exit_at(self.count)

    def exit_at(self, count: int) -> ExitRule:
        """The exit rule of its forward when it has sampled `count` tokens: its own, or that token's forced depth
        (exit_schedule, a depth cap)."""
        forced = self.forced_depth(count)
        return ExitRule("schedule", forced) if forced is not None else self.rule

    @property
    def prefill_exit(self) -> ExitRule:
        """The exit rule of its prompt's pieces (a depth cap is their loop count instead: prompt_depth)."""
        return self.exit if self.cfg.exit_schedule else self.rule

    def prompt_depth(self) -> int:
        """The loops its prompt's pieces run: its loops, or the depth cap it stands at when its first piece is planned
        (one depth for the whole prompt, and for a rebuild after preemption); the K/V slots of the loops above it get
        copies of its last loop's, as an early-exited token's do."""
        if self.prompt_loops is None:
            self.prompt_loops = self.depth_cap if self.depth_cap is not None and not self.cfg.exit_schedule \
                else self.loops
        return self.prompt_loops

    def forced_depth(self, i: int) -> int | None:
        """The loops its i-th generated token is forced to (exit_schedule's, or the depth cap it was planned under,
        else the cap now); None: its own exit rule decides (a fixed depth: every loop)."""
        schedule = self.cfg.exit_schedule
        if schedule:
            return schedule[i % len(schedule)]
        return self.depths[i] if i in self.depths else self.depth_cap

    def plan_depths(self, n: int, in_flight: bool = False) -> None:
        """Note the forced depth of its next n tokens (the one it feeds now and the greedy ones it may draw after it)
        under its cap now (None: uncapped), so a preempted lane is rebuilt as it ran; a token already in flight keeps
        the depth it started under. Nothing for a lane without a range."""
        if self.floor is None:
            return
        for i in range(self.count, self.count + n):
            if not (i == self.count and in_flight and i in self.depths):
                self.depths[i] = self.depth_cap

    def result(self) -> GenerateResult:
        if self.beam is not None:  # a beam-search request: its group's ranking (cancelled: what was streamed)
            self.beam.cancel()
            assert self.beam.outcome is not None  # (cancel ends the search)
            return self.with_prompt_scores(self.beam.outcome)
        if self.driver is not None:
            self.driver.finish()
        st = self.stats
        tokens = self.tokens
        st.generated_tokens, st.stop_reason = len(tokens), self.stop_reason
        st.decode_ms = (self.t_end - self.t_prefilled) * 1000
        st.total_ms = (self.t_end - self.t_call) * 1000
        counts = self.loop_counts
        st.loops_mean = sum(counts) / len(counts) if counts else float(self.loops)
        depth_stats(st, counts, self.loops, loss_table(self.model))
        res = GenerateResult(tokens, self.text, st, loops_used=list(counts[:len(tokens)]))
        if self.cfg.logprobs is not None:
            with_scores(res, self.scores)
        self.with_prompt_scores(res)
        if self.on_result is not None:
            self.on_result(res)
        return res

    def with_prompt_scores(self, res: GenerateResult) -> GenerateResult:
        """res with the prompt's log-probabilities, where asked (the first token's None: nothing predicts it)."""
        if self.prompt_scores is not None:
            res.prompt_logprobs = [None, *(lp for lp, _ in self.prompt_scores)]
            res.prompt_top_logprobs = [[], *(top for _, top in self.prompt_scores)]
        return res

    def fork(self) -> "Sequence":
        """An independent copy (beam search: a child hypothesis); the model, config and callback are shared."""
        child = copy.copy(self)
        child.matcher = self.matcher.fork()
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        child.history, child.loop_counts, child.scores = list(self.history), list(self.loop_counts), list(self.scores)
        child.place = dataclasses.replace(self.place, decided=[])
        return child


def with_scores(res: GenerateResult, scores: list[Score]) -> None:
    """res with its tokens' log-probabilities: its output is a prefix of the tokens scored (EOS and stops come last)."""
    res.logprobs = [lp for lp, _ in scores[:len(res.tokens)]]
    res.top_logprobs = [top for _, top in scores[:len(res.tokens)]]


def scored_rows(logits: torch.Tensor, tokens: list[int], k: int) -> list[Score]:
    """Each row's log-probability of its token (log_softmax of logits [n, V] in fp32, row by row) and its k most likely
    (token, log-probability) pairs, best first."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    # (one tolist for all rows, not two a row: a wide batch's draws are many tokens a step)
    ids, values = top_i.tolist(), top_v.tolist()
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids, values)]


def depth_stats(st: GenerateStats, counts: list[int], asked: int, table: dict[int, float]) -> None:
    """The depth its tokens ran: fewest loops, tokens below the asked loops, a histogram, the estimated loss rise."""
    st.loops_min = min(counts) if counts else asked
    st.tokens_below_loops = sum(n < asked for n in counts)
    hist: dict[str, int] = {}
    for n in counts:
        hist[str(n)] = hist.get(str(n), 0) + 1
    st.loops_histogram = hist
    st.loss_increase = loss_increase(table, asked, counts)
