"""Runner: the engine of one cache. It steps sequences through the model, each in a lane of the cache while it runs.

A model has one (`engine/calls.py`'s `engine_of`): every in-process call, the worker's scheduler and the benches run
their sequences through it, each as a `Client` with a quota of lanes, and a client gets back its own finished
sequences. Sequences may be added at any time (`add`); one `step()` is one scheduling iteration (iteration-level
scheduling, as in Orca and vLLM) over every client's sequences: an in-process call (`run`: add, then step until its
own are done) made between two of the worker's steps advances the worker's batch with it.
One step, schedule -> execute -> postprocess (the shape of nano-vllm's and vLLM v1's engine step):
  1. retire: drop sequences cancelled from outside (`Sequence.cancel`) and give their lanes back; then, with a
     depth controller (engine/elastic.py), steer the depth caps of the lanes with a depth range;
  2. schedule (engine/scheduler.py): admit waiting sequences and make the step's plan (engine/plan.py), plain data:
     prefill pieces, decode rows with their loop counts and exit rules, lanes whose driver runs its own forwards;
     every block they write is taken here;
  3. execute (engine/executor.py): the plan's forwards on a backend (C rows and passes, torch, Triton, CUDA graphs);
     fresh logits come back by lane; then each driven lane's round (a speculative round: the tokens it
     decides wait for postprocess); a batched speculative lane drafts before the forward, and its drafted chunk is
     rows of it, whose logits decide its tokens;
  4. postprocess: every sequence with fresh logits takes its next token, drawn for all of them in one pass of the
     sampler (stops, grammar, streaming, max_tokens), a driven lane the tokens its round decided, and every beam
     request chooses its next beam (engine/beam.py); a finished one leaves at once and gives its blocks back; a fault
     of one request's own fails it alone.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from ..cache import KVCache
from ..errors import ForwardError, TinyLoopError
from ..exits import ExitRule
from ..memory import release_freed_memory
from .elastic import DepthController
from .executor import Executor
from .options import EngineOptions
from .plan import Chunk, Outputs, Plan
from .scheduler import Scheduler
from .sequence import Client, Sequence, Start

T = TypeVar("T")

log = logging.getLogger("tinyloop.scheduler")


class Runner:
    def __init__(self, model, cache: KVCache, loops: int | None = None, early_exit: "ExitRule | float" = 0.0,
                 chunk: int | None = None, options: EngineOptions | None = None,
                 depth_control: DepthController | None = None):
        self.model = model
        # elastic depth (engine/elastic.py): steers the depth caps of lanes with a depth range once per step
        self.depth_control = depth_control
        # defaults for callers that feed the forwards themselves (tests); sequences bring their own
        self.loops, self.rule = loops or model.cfg.default_loops, ExitRule.of(early_exit, model.cfg.exit_rule)
        self.chunk = chunk  # None: the model's prefill_chunk
        self.fail_at_step: int | None = None  # a test-only hook: that step's forwards raise (workers/engine.py)
        self.cache, self.options = cache, options or EngineOptions.from_env()
        self.executor = Executor(model, cache, self.loops, self.rule, self.options)
        self.scheduler = Scheduler(model, cache, self.executor, chunk)

    def configure(self, cache: KVCache, options: EngineOptions) -> None:
        """Run over `cache` with `options` from now on (only while idle: the old cache's blocks go back)."""
        assert self.idle
        if self.cache is not cache:
            self.cache.reset()
        self.cache, self.options = cache, options
        self.executor = Executor(self.model, cache, self.loops, self.rule, options)
        self.scheduler = Scheduler(self.model, cache, self.executor, self.chunk)

    # the forwards, for callers that feed them themselves
    def prefill(self, ids: list[int], start: int, lane: int = 0, loops: int | None = None,
                exits: ExitRule | None = None, all_rows: bool = False) -> torch.Tensor:
        return self.executor.prefill(ids, start, lane, loops, exits, all_rows)

    def decode(self, tokens: list[int], positions: list[int], loops: list[int] | int | None = None,
               exits: list[ExitRule] | ExitRule | None = None) -> tuple[torch.Tensor, list[int]]:
        return self.executor.decode(tokens, positions, loops, exits)

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    def add(self, seq: Sequence, cached: int = 0, first: Start | None = None, client: Client | None = None) -> None:
        seq.client = client
        self.scheduler.add(seq, cached, first)

    def idle_for(self, client: Client) -> bool:
        """Whether none of client's sequences is left in the runner, finished ones not taken included."""
        sched = self.scheduler
        return not client.finished and not any(s.client is client for s in sched.waiting + sched.admitted)

    def drop(self, client: Client) -> None:
        """Give up every sequence of client's still in the runner (a call that ended on an error): their lanes and
        blocks go back now."""
        sched = self.scheduler
        for seq in [s for s in sched.waiting if s.client is client]:
            sched.waiting.remove(seq)
        for root in {id(r): r for r in (s.beam.root if s.beam is not None else s for s in sched.admitted)
                     if r.client is client}.values():
            sched.give_up(root)
        client.finished = []

    # --- a step -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One scheduling iteration, schedule -> execute -> postprocess; returns the sequences that finished in it
        (`seq.error` set when one had to be given up: it could not get a block with nothing else running, or a fault
        of its own)."""
        self.scheduler.steps += 1
        for client in {id(s.client): s.client for s in self.scheduler.waiting + self.scheduler.admitted
                       if s.client is not None and s.client.closed}.values():
            self.drop(client)
        finished = self.scheduler.retire()
        if self.depth_control is not None:
            self.depth_control.steer(self.scheduler.admitted, self.scheduler.waiting)
        plan = self.scheduler.schedule(finished)
        try:
            finished += self.execute(plan)
        except Exception as exc:  # noqa: BLE001 (a shared forward broke: its lanes fail, nobody else's)
            finished += self.fail_step(plan, exc)
        finished += self.postprocess()
        for seq in finished:
            if seq.client is not None:
                seq.client.finished.append(seq)
        return finished

    def execute(self, plan: Plan) -> list[Sequence]:
        """The plan's forwards (the executor's), their outputs given to the sequences, then each driven lane's round.
        Returns the sequences given up in them (a fault of their own)."""
        if plan.step == self.fail_at_step and plan.lanes():
            raise RuntimeError(f"a fault injected into step {plan.step}'s forwards (Runner.fail_at_step)")
        seqs = self.scheduler.by_lane()
        for lane in plan.drafting:  # a batched speculative round: its drafts now, their chunk rows of the forward
            seq = seqs[lane]
            assert seq.place.drafter is not None  # (set at schedule)
            drafted = seq.place.drafter.draft(self.executor.lane(lane))
            plan.chunks.append(Chunk(lane, seq.pos, drafted.tokens, seq.loops, drafted.exit, drafted.width))
        out = self.executor.execute(plan)
        finished = [self.scheduler.fail(seqs[lane], exc) for lane, exc in out.failed.items()]
        self.take_outputs(seqs, out)
        for lane, (logits, used) in out.verified.items():  # the round's verification: the tokens it decides
            at = seqs[lane].place
            assert at.drafter is not None  # (set at schedule)
            at.decided, at.drafter = at.drafter.accept(logits, used), None
        lone = seqs[plan.rows[0].lane].driver if out.lone_row_seconds is not None else None
        if lone is not None and out.lone_row_seconds is not None:
            lone.plain_row(out.lone_row_seconds)
        for lane in plan.driven:
            seq = seqs[lane]
            assert seq.driver is not None  # (a driven lane's)
            seq.place.decided = seq.driver.step(self.executor.lane(seq.place.lane))
        return finished

    def take_outputs(self, seqs: dict[int, Sequence], out: Outputs) -> None:
        """Each sequence's share of the step's outputs: a prefill piece done (its latent rows and its prompt tokens'
        log-probabilities, where the sequence asks for them; once the prompt is in, its last position's logits are the fresh logits, and the prompt's blocks go
        to the prefix cache), the greedy tokens C drew, and a fed token's logits."""
        for lane, start, e, s in out.latents:  # (before the pieces: on_prefilled reads them)
            latents = seqs[lane].latents
            assert latents is not None  # (only a sequence that asks gets a keep_latent piece)
            latents[start] = (e, s)
        for lane, start, rows in out.rows:  # scored now: a piece's [T, V] rows are not kept
            seqs[lane].score_prompt(start, rows)
        for lane, n, logits, used, seconds in out.pieces:
            seq = seqs[lane]
            at = seq.place
            at.cached += n
            seq.stats.prefill_ms += seconds * 1000
            if at.cached == len(seq.prompt):
                seq.loop_counts.append(used)
                at.logits = logits
                self.prompt_in(seq, logits)
                release_freed_memory(self.model.device)
        for lane, drawn in out.drawn.items():  # taken at this step's postprocess, before any fresh logits
            seq = seqs[lane]
            seq.place.chosen_from.extend(out.chosen_from.get(lane, ()))
            for token, used in drawn:
                seq.pos += 1
                seq.loop_counts.append(used)
                seq.place.drawn.append(token)
        for lane, (logits, used) in out.tokens.items():
            seq = seqs[lane]
            seq.place.logits = logits
            if seq.place.prompt_row:  # its prompt is in: what the end of a prefill does
                seq.place.prompt_row = False
                self.prompt_in(seq, logits)
            else:
                seq.pos += 1
            seq.loop_counts.append(used)

    def prompt_in(self, seq: Sequence, logits: torch.Tensor) -> None:
        """seq's prompt is in (`logits`: its last position's): the prompt's blocks go to the prefix cache, and to the
        sequence's own `on_prefilled` (a prefix or resume handle built by this step keeps them)."""
        seq.t_prefilled = time.perf_counter()
        lane = self.executor.lane(seq.place.lane)
        prefixes = self.scheduler.prefix_cache(seq)
        if prefixes is not None and seq.cacheable:
            prefixes.keep(seq.prompt, seq.loops, lane)
        if seq.on_prefilled is not None:
            seq.on_prefilled(lane, logits)

    def postprocess(self) -> list[Sequence]:
        """Every lane with fresh logits takes its next token (one pass of the sampler for all of them) and every beam
        request chooses its next beam; returns the requests that finished. A fault while one request samples,
        matches stops, advances its grammar or streams fails that request alone (seq.error); the others go on."""
        finished = []
        admitted = self.scheduler.admitted
        drawing = [s for s in admitted if s.place.drawn]
        self.score_drawn(drawing)
        for seq in drawing:  # the C passes' greedy draws, in turn
            drawn, seq.place.drawn = seq.place.drawn, []
            for i, token in enumerate(drawn):
                ended = self.ended(seq, self.guarded(seq.take, token))
                if ended is not None:  # (a stop sequence: the draws after it, their loop counts and scores, go)
                    unused = len(drawn) - 1 - i + (seq.place.logits is not None)
                    del seq.loop_counts[len(seq.loop_counts) - unused:]
                    if seq.cfg.logprobs is not None:
                        del seq.scores[len(seq.scores) - (len(drawn) - 1 - i):]
                    seq.place.logits = None
                    finished.append(ended)
                    break
        fresh = [s for s in admitted if s.place.logits is not None and s.beam is None]
        try:
            tokens: list = Sequence.sample_all(fresh, [s.place.fresh() for s in fresh]) if fresh else []
        except Exception:  # noqa: BLE001 (a lane's own fault broke the shared pass: draw each alone to find it)
            tokens = [self.guarded(s.sample, s.place.logits) for s in fresh]
        took = [(s, t) for s, t in zip(fresh, tokens) if not isinstance(t, Exception)]
        Sequence.score_all([s for s, _ in took], [s.place.fresh() for s, _ in took], [t for _, t in took])
        for seq, token in zip(fresh, tokens):
            seq.place.logits = None
            ended = self.ended(seq, token if isinstance(token, Exception) else self.guarded(seq.take, token))
            if ended is not None:
                finished.append(ended)
        for seq in [s for s in self.scheduler.admitted if s.place.decided]:  # a driver's round decided these
            decided, seq.place.decided = seq.place.decided, []
            if seq.cfg.logprobs is not None:  # each under the verified logits it was chosen from
                assert seq.driver is not None and seq.driver.chosen_from is not None  # (its round decided them)
                Sequence.score_all([seq] * len(decided), list(seq.driver.chosen_from), decided)
            for token in decided:
                ended = self.ended(seq, self.guarded(seq.take, token))
                if ended is not None:
                    finished.append(ended)
                    break
            else:
                seq.pos += len(decided)
        for group in self.scheduler.groups():  # beam requests: their members' logits choose the next beam
            if any(m.place.logits is None for m in group.members):
                continue  # (a member's token still loops)
            old = group.members
            new = self.guarded(group.advance, self.executor)
            if isinstance(new, Exception):
                finished.append(self.scheduler.fail(group.root, new))
                continue
            admitted = self.scheduler.admitted
            at = admitted.index(old[0])
            admitted[at:at] = new
            for seq in old:
                admitted.remove(seq)
            if group.outcome is not None:
                self.scheduler.release(group.root)
                finished.append(group.root)
        return finished

    @staticmethod
    def score_drawn(drawing: list[Sequence]) -> None:
        """The log-probabilities of the tokens C drew for the sequences that ask, under the logits each was drawn
        from (Place.chosen_from): one Sequence.score_all for all of them, the function that scores a token the
        sampler chose, so a request's scores are the same whether its tokens were drawn in C or not."""
        asking = [s for s in drawing if s.cfg.logprobs is not None]
        for seq in asking:
            assert len(seq.place.chosen_from) == len(seq.place.drawn)  # (C kept the logits of each draw)
        Sequence.score_all([s for s in asking for _ in s.place.drawn], [x for s in asking for x in s.place.chosen_from],
                           [t for s in asking for t in s.place.drawn])
        for seq in drawing:
            seq.place.chosen_from = []

    def ended(self, seq: Sequence, alive: object) -> Sequence | None:
        """After a take (its result, or the exception it raised): the request if it ended, its lane given back (a
        fault of its own fails it alone), else None."""
        if isinstance(alive, Exception):
            return self.scheduler.fail(seq, alive)
        if not alive:
            self.scheduler.release(seq)
            return seq
        return None

    @staticmethod
    def guarded(fn: Callable[..., T], *args: object) -> T | Exception:
        """fn(*args), or the exception it raised (a request's own fault, answered to that request alone)."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001
            log.warning("a request failed in its own postprocess: %s: %s", type(exc).__name__, exc)
            return exc

    def fail_step(self, plan: Plan, exc: Exception) -> list[Sequence]:
        """A forward of the step failed on no request's account: every request whose lane it ran (a prefill piece, a
        decode row, a driven round) fails with a ForwardError (or the runtime's own refusal, a TinyLoopError, as it
        is), its lanes and their half-written cells given back; the waiting ones and lanes the step did not run go
        on."""
        lanes = plan.lanes()
        log.error("step %d: a shared forward failed (%s: %s); its %d lane(s) fail", plan.step, type(exc).__name__,
                  exc, len(lanes))
        error = exc  # the runtime refusing what the lanes ask (a ModeError of the model's): that, not a fault
        if not isinstance(exc, TinyLoopError):
            error = ForwardError(f"a forward this request shared with others failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        seqs = self.scheduler.by_lane()
        failed: list[Sequence] = []
        for seq in (seqs[lane] for lane in lanes if lane in seqs):
            root = seq.beam.root if seq.beam is not None else seq
            if root.error is None and not any(root is f for f in failed):
                failed.append(self.scheduler.fail(root, error))
        return failed

    # --- in-process calls -------------------------------------------------------------------------------------
    def run(self, seqs: list[Sequence], cached: int = 0, first: Start | None = None, raise_errors: bool = True,
            client: Client | None = None) -> list:
        '''Take every sequence from its prompt to its result: add them all, then step until they are done (other
        clients' sequences step with them). A sequence given up raises its error (raise_errors), or has it in its
        place among the results.'''
        client = client or Client(self.cache.lanes)
        for seq in seqs:
            self.add(seq, cached, first, client)
        left = {id(s) for s in seqs}
        while left and not self.idle:
            self.step()
            for seq in client.take():
                left.discard(id(seq))
                if seq.error is not None and raise_errors:
                    raise seq.error
        return [seq.result() if seq.error is None else seq.error for seq in seqs]
