"""The model side of a worker: one Model, its scheduler (continuous batching), its handle
registry and prefix pool.

Every generation op (`generate`, `chat`, `generate_pool`, `speculative`, `resume`; beam search, sliding
windows, early exit, grammars and continued streams among them) joins the scheduler's batch (`join`, then
`step` until it finishes); the handle ops (`build_handle`, `release_handle`) run between two steps
(`run`, workers/worker.py).

An op the worker does not know answers "unsupported_op".
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import tinyloop
from broker.protocol import DIGEST_CHARS, DIGEST_TOKENS, MAX_ANNOUNCED_PREFIXES, Codes, prefix_digests
from tinyloop.batch import DEFAULT_LANES
from tinyloop.chat import chat_prompt
from tinyloop.detokenize import Detokenizer
from tinyloop.env import env_number
from tinyloop.fields import GENERATE_FIELDS, SPECULATIVE_FIELDS
from workers.stream_takeover import Continuation, continuation, delivered_answer
from workers.handle_registry import EngineError, HandleRegistry

log = logging.getLogger("tinyloop.worker")

TokenSink = Callable[[int, int, str], None]
# ops that join the continuous batch; the handle ops (build_handle, release_handle) run between two of its steps
BATCHED_OPS = ("generate", "chat", "generate_pool", "speculative", "resume")
USED_BLOCKS_EVERY_S = 0.2  # counting them walks the prefix cache: a few times a second is plenty for a gauge
CHAT_ONLY = ("messages", "add_generation_prompt", "chat_template_kwargs")  # a chat's fields no generate op takes
LOOPS_RULE = GENERATE_FIELDS["loops"]  # a prefix file's "loops" obeys the request field's rule (and words)


@dataclass
class Batched:
    """A request in the batch: its sequence, its params as sent, its prompt ids, the continuation it is, and fields
    its answer carries besides the result (a resume's handle)."""

    key: str
    seq: Any
    params: dict
    ids: list[int]
    should_stop: Callable[[], bool]
    continued: Continuation | None
    extra: dict


def to_wire(value: Any) -> Any:
    """Make a stats value msgpack-friendly (plain numbers, strings, lists, maps; NaN -> None)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_wire(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def load_prefix_file(path: str | Path) -> list[dict]:
    """Scaffolds for the prefix pool: a JSON list of {"prefix": str, "loops": int} (or plain strings)."""
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"cannot read prefix file {path}: {exc}")
    if not isinstance(entries, list):
        raise SystemExit(f"prefix file {path} must hold a JSON list")
    scaffolds = []
    for i, entry in enumerate(entries):
        where = f"prefix file {path}, entry {i}"  # every error names the file, the entry and the field
        if isinstance(entry, str):
            entry = {"prefix": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("prefix"), str) or not entry["prefix"]:
            raise SystemExit(f"{where}: must be a non-empty string or {{\"prefix\": str, \"loops\": int}}")
        unknown = sorted(set(entry) - {"prefix", "loops"})
        if unknown:
            raise SystemExit(f"{where}: unknown field(s) {unknown}; an entry has 'prefix' and 'loops'")
        error = entry.get("loops") is not None and LOOPS_RULE(entry["loops"])
        if error:
            raise SystemExit(f"{where}: 'loops' {error}")
        scaffolds.append({"prefix": entry["prefix"], "loops": entry.get("loops"), "where": where})
    return scaffolds


class ModelEngine:
    def __init__(self, model: "tinyloop.Model", *, max_handles: int, plan_bytes: int, model_name: str,
                 prefixes: list[dict] | None = None, lanes: int = DEFAULT_LANES, targets: Any = None):
        self.model = model
        self.slots = lanes
        self.targets = targets  # elastic depth's latency targets (engine/elastic.py Targets; None: fixed depth)
        self.scheduler = self.new_scheduler()
        # test-only: the forwards of the batch's Nth step raise (a fault no request caused; tests/test_hard_to_break.py)
        # (counted from here: the model's engine may have stepped before, a warm-up's or a prefix file's calls)
        fail_at = env_number("TINYLOOP_TEST_FAIL_STEP", int, None, 1)
        runner = self.scheduler.runner
        runner.fail_at_step = None if fail_at is None else runner.scheduler.steps + fail_at
        self.batch: dict[int, Batched] = {}  # id(seq) -> the request it serves
        self.plan_bytes = plan_bytes
        self.model_name = model_name
        self.device = str(model.device)
        self.max_handles = max_handles
        self.handle_prefix = "handle"  # replaced by the worker identity (see WorkerProcess)
        # digest of a prompt prefix the prefix cache holds -> the cache node it needs (announced while alive)
        self.announced: OrderedDict[int, Any] = OrderedDict()
        self.announcing: tuple = ()  # a snapshot the I/O thread reads
        # blocks running requests and handles hold (the KV usage routers read; cached-only blocks count as free, as
        # in vLLM); counted by the compute thread after a step, read by the I/O thread
        self.used_blocks, self.used_counted_at = 0, 0.0
        prefixes = prefixes or []
        # The live-handle cap counts pool entries too; they are pinned (never evicted).
        if len(prefixes) > max_handles:
            raise SystemExit(
                f"the prefix file holds {len(prefixes)} scaffolds but --max-handles is {max_handles}; "
                "pool entries count against the live-handle cap"
            )
        self.pool_entries = len(prefixes)
        self.handles = HandleRegistry(max_handles - len(prefixes), "handle", on_evict=self._free_handle)
        self.pool = tinyloop.create_prefix_pool(max(1, len(prefixes)))
        for entry in prefixes:  # pinned entries of the model's prefix cache
            loops = entry["loops"] or model.cfg.default_loops
            where = entry.get("where", "prefix file entry")
            if loops > model.cfg.max_loops:  # the table's words, with this model's limit (as GenerateConfig says it)
                raise SystemExit(f"{where}: 'loops' must be in [1, {model.cfg.max_loops}] (this model's max_loops), "
                                 f"got {loops}")
            try:
                tinyloop.register_prefix(self.pool, model, entry["prefix"], loops)
            except tinyloop.TinyLoopError as exc:
                raise SystemExit(f"{where}: {exc}") from None
            self.remember(entry["prefix"], model.encode_prompt(entry["prefix"]), loops)
        # ops that run between two steps of the batch (the others join it: BATCHED_OPS)
        self.ops_table: dict[str, Callable[..., dict]] = {"build_handle": self.op_build_handle,
                                                          "release_handle": self.op_release_handle}
        self.ops = ["ping", *BATCHED_OPS, *self.ops_table]

    def new_scheduler(self) -> "tinyloop.Scheduler":
        """The batch's scheduler, with elastic depth's controller when the worker has latency targets."""
        control = None
        if self.targets is not None:
            from tinyloop.engine.elastic import DepthController

            control = DepthController(self.targets)
        return tinyloop.Scheduler(self.model, self.slots, depth_control=control)

    def set_identity(self, identity: str) -> None:
        """Handle ids start with the worker identity so the broker can route by them."""
        self.handles.id_prefix = identity

    def live_handles(self) -> int:
        return len(self.handles) + self.pool_entries

    def cache_state(self) -> dict:
        """Heartbeat fields for routing: free KV blocks and the digests of the prompt prefixes still cached, newest
        last (called from the I/O thread: it reads a snapshot the compute thread replaces whole)."""
        alive = [d for d, node in self.announcing if node.alive]
        return {"free_blocks": self.model.pool.free_count, "prefixes": alive[-MAX_ANNOUNCED_PREFIXES:],
                "total_blocks": self.model.pool.num_blocks, "used_blocks": self.used_blocks}

    def remember(self, prompt: Any, ids: list[int], loops: int) -> None:
        """After a request: announce the digests of the prompt's prefixes its cache now holds (up to the characters,
        or ids, of the longest cached token prefix), each tied to the cache node holding the end of that prefix, so
        evicting a request's own last blocks does not withdraw the scaffold it shares with others."""
        path, n = self.model.prefixes.match(ids, loops)
        if not n:
            return
        text = isinstance(prompt, str)
        ends = [len(self.model.codec.decode(ids[:min(node.depth, n)])) if text else min(node.depth, n) for node in path]
        unit = DIGEST_CHARS if text else DIGEST_TOKENS
        for i, digest in enumerate(prefix_digests(prompt, ends[-1])):
            self.announced[digest] = next(node for node, end in zip(path, ends) if end >= unit << i)
            self.announced.move_to_end(digest)
        while len(self.announced) > MAX_ANNOUNCED_PREFIXES:
            self.announced.popitem(last=False)
        self.announcing = tuple(self.announced.items())

    # ---------------------------------------------------------------- dispatch

    def run(self, op: str, params: dict, on_token: TokenSink | None, should_stop: Callable[[], bool],
            delivered: list[int] | None = None) -> dict:
        """An op that runs between two steps of the batch: the handle ops, or a continued stream with nothing left
        to generate (its answer is what was delivered)."""
        with runtime_errors():
            if op in BATCHED_OPS and delivered:
                if op == "chat":
                    params = {**params, "prompt": self.chat_prompt(params)[1]}
                return delivered_answer(self, params, delivered)
            handler = self.ops_table.get(op)
            if handler is None:
                raise EngineError(Codes.UNSUPPORTED_OP, f"op {op!r} is not supported by this worker's runtime "
                                  f"(supported: {self.ops})")
            return handler(params, on_token, should_stop)

    # ---------------------------------------------------------------- the batch

    def join(self, key: str, op: str, params: dict, on_token: TokenSink | None, should_stop: Callable[[], bool],
             delivered: list[int] | None = None, queued_s: float = 0.0, backlog_s: float = 0.0) -> bool:
        """Add a request to the batch: generate, chat, pool, speculative and resume requests, continued or not. False
        for one that runs between two steps instead (`run`: the handle ops, a continuation with nothing left)."""
        if op not in BATCHED_OPS:
            return False
        control = self.scheduler.runner.depth_control
        if control is not None:  # (the broker's queue, as it stood when it sent this one)
            control.note_backlog(backlog_s)
        cfg = self.config(params)  # validated once, by the scheduler's submit
        if delivered and len(delivered) >= cfg.max_tokens:  # nothing left to generate: `run` answers it
            return False
        with runtime_errors():
            if op == "resume":
                handle = self.handles.get(params["handle"])
                seq = self.scheduler.resume(handle, cfg, self.callback(on_token, should_stop))
                seq.queued_s = queued_s
                self.batch[id(seq)] = Batched(key, seq, params, handle.ids, should_stop, None,
                                              {"handle": params["handle"]})
                return True
            if op == "chat":
                text, ids = self.chat_prompt(params)
                params = {**params, "prompt": ids, "prompt_text": text}
            ids = self.model.encode_prompt(params["prompt"])  # once: the scheduler and the prefix notes share it
            cont = continuation(self, params, ids, delivered) if delivered else None
            run = cont.params(params) if cont else {**params, "prompt": ids}
            sink = self.callback(on_token, should_stop, *((cont.text, len(cont.delivered)) if cont else ()))
            spec = {k: params[k] for k in SPECULATIVE_FIELDS if k in params}
            seq = self.scheduler.submit(run["prompt"], self.config(run, continued=cont is not None), sink,
                                        pool=self.pool if op == "generate_pool" else None,
                                        speculative=tinyloop.SpeculativeConfig(**spec) if spec or op == "speculative"
                                        else None)
        seq.queued_s = queued_s  # (elastic depth counts it in the request's time to first token)
        self.remember(params["prompt"], ids, seq.loops)  # its prompt's blocks stay in the prefix cache (routing digests)
        self.batch[id(seq)] = Batched(key, seq, params, ids, should_stop, cont, {})
        return True

    def step(self) -> list[tuple[str, dict | EngineError]]:
        """One scheduling iteration: requests cancelled or past their deadline leave first; (key, answer) of each
        request that finished."""
        for job in self.batch.values():
            if job.should_stop():
                job.seq.cancel()
        try:
            done = self.scheduler.step()
        except Exception as exc:  # a bug in a step must not kill the worker: every request in the batch fails
            log.exception("a scheduler step failed")
            failed: list[tuple[str, dict | EngineError]] = [(job.key, EngineError(Codes.RUNTIME_ERROR, f"{type(exc).__name__}: {exc}"))
                      for job in self.batch.values()]
            self.batch.clear()
            self.scheduler.close()  # (its requests leave the model's engine now)
            self.scheduler = self.new_scheduler()
            return failed
        now = time.monotonic()
        if done or now - self.used_counted_at > USED_BLOCKS_EVERY_S:
            self.used_blocks, self.used_counted_at = self.model.pool.num_blocks - self.model.pool.room(), now
        return [self.answer(self.batch.pop(id(seq))) for seq in done]

    def answer(self, job: "Batched") -> tuple[str, dict | EngineError]:
        seq, params = job.seq, job.params
        # announce the prompt's prefixes again now that its blocks are surely cached (at join they may not be yet):
        # a heartbeat sent after this answer must list them, since the broker forgets its own note of them then
        if "prompt" in params:  # (a resume's prompt is its handle's: the prefix cache does not keep it)
            self.remember(params["prompt"], job.ids, seq.loops)
        if seq.error is not None:  # given up: out of blocks, or a fault of its own (its batch-mates went on)
            return job.key, engine_error(seq.error)
        try:
            with runtime_errors():
                res = seq.result()
                result = self.result(res, **job.extra)
                if job.continued is not None:
                    result = job.continued.result(self.model.codec, result)
                result = self.scored(params, job.ids, result, res)
        except EngineError as err:
            return job.key, err
        return job.key, {**result, "prompt_text": params["prompt_text"]} if "messages" in params else result

    def idle(self) -> bool:
        return self.scheduler.idle()


    def config(self, params: dict, continued: bool = False) -> "tinyloop.GenerateConfig":
        """The request's GenerateConfig. The wire's `logprobs` flag and `top_logprobs` count: the step notes each
        output token's (GenerateConfig.logprobs), and with `echo` the prefill each prompt token's
        (GenerateConfig.prompt_logprobs), as does a continued stream's: its prompt holds the delivered tokens."""
        fields = {k: params[k] for k in GENERATE_FIELDS if k in params}
        if params.get("logprobs"):
            fields["logprobs"] = params.get("top_logprobs", 0)
            if params.get("echo") or continued:
                fields["prompt_logprobs"] = fields["logprobs"]
        return tinyloop.GenerateConfig(**fields)

    def callback(self, on_token: TokenSink | None, should_stop: Callable[[], bool], text: Detokenizer | None = None,
                 offset: int = 0) -> Callable[[int, int], bool]:
        """The runtime's on_token: forwards streamed tokens with their text pieces (positions moved by `offset`, text
        continuing `text`: a continuation's) and returns False to stop the decode."""
        if on_token is not None and text is None:
            text = Detokenizer(self.model.codec)

        def on_runtime_token(token: int, pos: int) -> bool:
            if on_token is not None:
                assert text is not None  # (made above for a sink)
                on_token(int(token), int(pos) + offset, text.push(int(token)))
            return not should_stop()

        return on_runtime_token

    @staticmethod
    def result(res: Any, **extra: Any) -> dict:
        return {"tokens": [int(t) for t in res.tokens], "text": res.text, "stats": to_wire(res.stats.to_dict()), **extra}

    # ---------------------------------------------------------------- ops

    def op_build_handle(self, params: dict, on_token: TokenSink | None, should_stop: Callable[[], bool]) -> dict:
        kwargs = {"cache_window": params["cache_window"]} if "cache_window" in params else {}
        handle = tinyloop.build_resume_handle(self.model, params["prompt"], params["l_used"], **kwargs)
        return {"handle": self.handles.add(handle), "live_handles": self.live_handles()}

    def op_release_handle(self, params: dict, on_token: TokenSink | None, should_stop: Callable[[], bool]) -> dict:
        self.handles.release(params["handle"])
        return {"released": params["handle"], "live_handles": self.live_handles()}

    def chat_prompt(self, params: dict) -> tuple[str, list[int]]:
        """A chat request's rendered prompt and its ids, with the template options it sent."""
        return chat_prompt(self.model, params["messages"], params.get("add_generation_prompt", True),
                           **params.get("chat_template_kwargs", {}))

    def scored(self, params: dict, ids: list[int], result: dict, res: Any) -> dict:
        """Add the log-probabilities (and echoed prompt) a request asked for (docs/gateway.md), all from the step's own
        logits (no second forward): the output's from the logits each token was chosen from (res.logprobs), the
        prompt's (echo) from its prefill's rows (res.prompt_logprobs). A continued stream ran prompt ids + the
        delivered tokens as its prompt, so the delivered tokens' come from that prefill's rows too. `ids`: the
        request's own prompt ids."""
        if not (params.get("logprobs") or params.get("echo")):
            return result
        if params.get("echo"):
            prompt = params["prompt"]
            result["prompt_text"] = prompt if isinstance(prompt, str) else self.model.codec.decode(ids)
        if params.get("logprobs") and result["stats"].get("stop_reason") != "cancelled":
            prompt_scores = list(zip(res.prompt_logprobs or [], res.prompt_top_logprobs or []))
            delivered = prompt_scores[len(ids):]  # (a continued stream's: its run's prompt goes on past ids)
            output = list(zip(res.logprobs or [], res.top_logprobs or []))
            result["logprobs"] = self.wire_scores(result["tokens"], delivered + output)
            if params.get("echo"):
                result["prompt_logprobs"] = self.wire_scores(ids, prompt_scores[:len(ids)])
        return result

    def wire_scores(self, tokens: list[int], scores: list) -> dict:
        """Tokens with their (log-probability, top [(id, log-probability)]) as the wire carries them: each token's
        text, and per position its top [id, text, log-probability] (None where nothing predicts the token)."""
        piece = self.model.codec.decode  # (one token decoded alone: a partial UTF-8 character shows as U+FFFD)
        if len(scores) != len(tokens):  # (a runtime path that notes no scores: this request fails, alone)
            raise EngineError(Codes.RUNTIME_ERROR, f"log-probabilities of {len(scores)} of {len(tokens)} tokens")
        return {"tokens": list(tokens), "text": [piece([t]) for t in tokens], "logprobs": [lp for lp, _ in scores],
                "top": [None if lp is None else [[t, piece([t]), v] for t, v in alts] for lp, alts in scores]}

    def _free_handle(self, handle: Any) -> None:
        tinyloop.free_handle(handle)


def engine_error(exc: Exception) -> EngineError:
    """A runtime exception as the wire's error code (anything else is a runtime_error naming its type)."""
    for kind, code in ((tinyloop.ModeError, Codes.MODE_ERROR), (tinyloop.ConfigError, Codes.CONFIG_ERROR),
                       (tinyloop.HandleError, Codes.HANDLE_UNKNOWN), (tinyloop.BudgetError, Codes.BUDGET),
                       (tinyloop.ForwardError, Codes.FORWARD_FAILED)):
        if isinstance(exc, kind):
            return EngineError(code, str(exc))
    return EngineError(Codes.RUNTIME_ERROR, f"{type(exc).__name__}: {exc}")


@contextmanager
def runtime_errors():
    """The runtime's exceptions as the wire's error codes."""
    try:
        yield
    except tinyloop.TinyLoopError as exc:
        raise engine_error(exc) from None
