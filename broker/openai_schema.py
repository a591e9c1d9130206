"""OpenAI request bodies -> broker requests, and broker results -> OpenAI response bodies.

Pure functions with no I/O (the HTTP side is broker/gateway.py), so every rule is in one
place: which OpenAI fields are supported and how they map to TinyLoop's GenerateConfig,
which TinyLoop knobs ride along as extra body fields, and the error for anything else.
Every invalid field raises APIError(400) naming the field (OpenAI's `param`).

This module must not import torch (it runs in the gateway); its value checks are tinyloop/fields.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tinyloop.fields import DEFAULT_MAX_TOKENS, SPECULATIVE_FIELDS, Check, boolean, int_in, is_int, number_in

# Extra body fields: the looped-model knobs (docs/gateway.md). Each maps 1:1 to a wire field, checked there.
EXTRA_FIELDS = ("loops", "early_exit_threshold", "cache_window", "top_k", "repetition_penalty", *SPECULATIVE_FIELDS)
# OpenAI fields accepted and ignored: they change nothing about the output.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                  "safety_identifier")
MAX_N = 16
MAX_STOP = 16
ROLES = ("system", "user", "assistant", "tool", "developer")

FINISH_REASONS = {"eos": "stop", "stop_sequence": "stop", "grammar_complete": "stop", "cancelled": "stop",
                  "max_tokens": "length"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
             504: "timeout_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(param: str, rule: str) -> APIError:
    return APIError(400, f"'{param}' {rule}", param=param, code="invalid_value")


# ------------------------------------------------------------------------------ field readers


def get_checked(body: dict, name: str, check: Check, default: Any = None) -> Any:
    """body[name] when it obeys `check` (tinyloop/fields.py), `default` when absent or null, else a 400 naming it."""
    v = body.get(name)
    if v is None:
        return default
    error = check(v)
    if error:
        raise bad(name, error)
    return v


def get_int(body: dict, name: str, lo: int, hi: int, default: Any = None) -> Any:
    return get_checked(body, name, int_in(lo, hi), default)


def get_num(body: dict, name: str, lo: float, hi: float, default: Any = None, lo_open: bool = False) -> Any:
    return get_checked(body, name, number_in(lo, hi, lo_open), default)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    return get_checked(body, name, boolean, default)


def must_be_neutral(body: dict, name: str, neutral: tuple) -> None:
    """An OpenAI field TinyLoop does not implement: allowed only at its no-op value."""
    if name in body and body[name] not in neutral:
        raise APIError(400, f"'{name}' is not supported by this server (allowed: {list(neutral)})",
                       param=name, code="unsupported_parameter")


# ------------------------------------------------------------------------------ requests


@dataclass(frozen=True)
class WorkLimits:
    """What one HTTP call may fan out to (docs/gateway.md, "Bounded work"); `tinyloop gateway` sets each."""

    max_requests: int = 128  # broker requests: prompts x n
    max_tokens: int = 1 << 20  # tokens to generate: prompts x n x max_tokens
    max_prompt: int = 1 << 21  # prompt characters (a text prompt) or ids (a token prompt), x n


@dataclass
class Plan:
    """What one OpenAI call turns into: len(prompts) x n broker requests with common params."""

    kind: str  # "completion" | "chat"
    model: str | None
    op: str
    prompts: list[Any]  # completion: prompt strings / token lists; chat: one messages list
    n: int
    stream: bool
    include_usage: bool
    params: dict = field(default_factory=dict)  # common wire params (config, scoring, extras)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    score_only: bool = False  # max_tokens 0 with echo: only the prompt's log-probabilities
    timeout: float | None = None

    def check_work(self, limits: "WorkLimits") -> None:
        """Refuse (400, naming the limit) a call whose fan-out asks for more than `limits` allow, before any broker
        request exists: the count of generations, their tokens, and the prompt text they carry."""
        requests = len(self.prompts) * self.n
        tokens = requests * self.params.get("max_tokens", DEFAULT_MAX_TOKENS)
        sizes = [sum(len(m["content"]) for m in p) if self.kind == "chat" else len(p) for p in self.prompts]
        prompt = sum(sizes) * self.n
        where = "messages" if self.kind == "chat" else "prompt"
        asked = f"{len(self.prompts)} prompt(s) x n {self.n}"
        for value, limit, option, what, param in (
                (requests, limits.max_requests, "--max-fanout", "generations", where if len(self.prompts) > 1 else "n"),
                (tokens, limits.max_tokens, "--max-work-tokens", "tokens (prompts x n x max_tokens)", "max_tokens"),
                (prompt, limits.max_prompt, "--max-prompt-size", "prompt characters or token ids (prompts x n x "
                                                                  "prompt length)", where)):
            if value > limit:
                raise APIError(400, f"this request asks for {value} {what} ({asked}); the gateway's limit is {limit} "
                                    f"per request ({option}): send fewer prompts or choices, or less work each",
                               param=param, code="limit_exceeded")

    def requests(self) -> list[tuple[int, int, dict]]:
        """(choice index, prompt index, params) for every broker request. Choice j of a seeded
        request uses seed + j, so n seeded choices differ yet each is reproducible."""
        out = []
        for p, prompt in enumerate(self.prompts):
            for j in range(self.n):
                params = dict(self.params)
                params["messages" if self.kind == "chat" else "prompt"] = prompt
                if self.seed is not None:
                    params["seed"] = self.seed + j
                out.append((p * self.n + j, p, params))
        return out


def _check_fields(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known - set(EXTRA_FIELDS) - set(IGNORED_FIELDS))
    if unknown:
        raise APIError(400, f"unrecognized request argument(s): {unknown} (see docs/gateway.md for the supported "
                            f"fields and TinyLoop's extra fields)", param=unknown[0], code="unrecognized_argument")


def _prompts(body: dict) -> list[Any]:
    """OpenAI's four prompt forms: a string, strings, token ids, lists of token ids."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return p
        if all(is_int(x) and 0 <= x < 2**31 for x in p):
            return [p]
        if all(isinstance(x, list) and x and all(is_int(t) and 0 <= t < 2**31 for t in x) for x in p):
            return p
    raise bad("prompt", "must be a non-empty string, list of strings, list of token ids or list of token-id lists")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise bad("stop", f"must be a non-empty string or a list of at most {MAX_STOP} non-empty strings")
    return stops


def _grammar(body: dict) -> dict | None:
    """response_format -> the runtime's grammar (docs/grammar.md): json_schema or any JSON object."""
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad("response_format.json_schema.schema", "must be a JSON schema object")
        return {"json_schema": schema}
    raise bad("response_format", "type must be one of text, json_object, json_schema")


def _common(body: dict, kind: str) -> tuple[dict, dict]:
    """Fields shared by both endpoints -> (wire params, plan fields)."""
    for name in ("frequency_penalty", "presence_penalty"):
        must_be_neutral(body, name, (0, 0.0, None))
    must_be_neutral(body, "logit_bias", (None, {}))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    stream = get_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad("stream_options", "must be an object, and is only allowed with stream: true")
    include_usage = bool(options and get_bool(options, "include_usage"))
    params: dict[str, Any] = {
        # OpenAI's defaults, not TinyLoop's: temperature 1 (sampling), top_p 1.
        "temperature": get_num(body, "temperature", 0.0, 2.0, 1.0),
        "top_p": get_num(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
    }
    stops = _stop(body)
    if stops:
        params["stop_sequences"] = stops
    grammar = _grammar(body)
    if grammar is not None:
        params["grammar"] = grammar
    for name in EXTRA_FIELDS:  # wire-validated by the broker client (errors name the field)
        if body.get(name) is not None:
            params[name] = body[name]
    timeout = get_num(body, "timeout", 0.0, 24 * 3600.0, None, lo_open=True)
    plan = dict(kind=kind, model=model, n=get_int(body, "n", 1, MAX_N, 1), stream=stream, include_usage=include_usage,
                seed=get_int(body, "seed", 0, 2**63 - 1 - MAX_N), timeout=timeout,
                op="speculative" if any(body.get(k) is not None for k in SPECULATIVE_FIELDS) else "generate")
    return params, plan


COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
                     "logprobs", "echo", "stop", "seed", "frequency_penalty", "presence_penalty", "logit_bias",
                     "best_of", "suffix", "response_format", "timeout"}


def completion_plan(body: dict) -> Plan:
    _check_fields(body, COMPLETION_FIELDS)
    must_be_neutral(body, "suffix", (None, ""))
    params, plan = _common(body, "completion")
    if body.get("best_of") not in (None, 1, plan["n"]):
        raise APIError(400, "'best_of' other than n is not supported", param="best_of", code="unsupported_parameter")
    prompts = _prompts(body)
    top = get_int(body, "logprobs", 0, 20)
    echo = get_bool(body, "echo")
    max_tokens = get_int(body, "max_tokens", 0, 1 << 16, 16)
    score_only = max_tokens == 0
    if score_only and not echo:
        raise bad("max_tokens", "must be >= 1 (0 is allowed only with echo: the prompt's log-probabilities)")
    if score_only and plan["stream"]:
        raise bad("max_tokens", "must be >= 1 when streaming")
    # The runtime always generates at least one token; a score-only call generates one greedily and drops it.
    params["max_tokens"] = max(1, max_tokens)
    if score_only:
        params["temperature"] = 0.0
    if top is not None:
        params.update(logprobs=True, top_logprobs=top)
    if echo:
        params["echo"] = True
    return Plan(prompts=prompts, params=params, logprobs=top is not None, top_logprobs=top or 0, echo=echo,
                score_only=score_only, **plan)


CHAT_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
               "stream_options", "logprobs", "top_logprobs", "stop", "seed", "frequency_penalty", "presence_penalty",
               "logit_bias", "response_format", "tools", "tool_choice", "timeout"}


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise bad(f"{where}.role", f"must be one of {list(ROLES)}, got {role!r}")
        if isinstance(content, list):  # content parts: only text parts can be rendered
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise bad(f"{where}.content", "parts must all be {type: text, text: str} (no images or audio)")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"{where}.content", "must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


def chat_plan(body: dict) -> Plan:
    _check_fields(body, CHAT_FIELDS)
    must_be_neutral(body, "tools", (None, []))
    must_be_neutral(body, "tool_choice", (None, "none"))
    params, plan = _common(body, "chat")
    messages = _messages(body)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise bad("max_completion_tokens", "and max_tokens are the same setting; give one")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = get_int(body, name, 1, 1 << 16)
    if max_tokens is not None:  # else the runtime's default
        params["max_tokens"] = max_tokens
    logprobs = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", 0, 20)
    if top is not None and not logprobs:
        raise bad("top_logprobs", "needs logprobs: true")
    if logprobs:
        params.update(logprobs=True, top_logprobs=top or 0)
    return Plan(prompts=[messages], params=params, logprobs=logprobs, top_logprobs=top or 0,
                **{**plan, "op": "chat"})


# ------------------------------------------------------------------------------ responses


def finish_reason(result: dict) -> str:
    return FINISH_REASONS.get(result.get("stats", {}).get("stop_reason"), "stop")


def completion_logprobs(result: dict, plan: Plan, prompt: Any) -> dict:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    parts = []
    if plan.echo and "prompt_logprobs" in result:
        parts.append(result["prompt_logprobs"])
    if not plan.score_only:
        parts.append(result.get("logprobs", {"tokens": [], "text": [], "logprobs": [], "top": []}))
    tokens, values, tops = [], [], []
    for part in parts:
        tokens += part["text"]
        values += part["logprobs"]
        tops += [None if alts is None else {text: lp for _id, text, lp in alts} for alts in part["top"]]
    # Offsets into choice.text (which starts with the prompt when echoing), token by token.
    offset = 0 if plan.echo else len(result.get("prompt_text", prompt if isinstance(prompt, str) else ""))
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(result: dict) -> dict:
    """The chat shape: content = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    lp = result.get("logprobs", {"text": [], "logprobs": [], "top": []})
    return {"content": [
        {"token": text, "logprob": value, "bytes": list(text.encode()),
         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for _id, t, v in (alts or [])]}
        for text, value, alts in zip(lp["text"], lp["logprobs"], lp["top"])
    ]}


def completion_choice(index: int, result: dict, plan: Plan, prompt: Any) -> dict:
    text = "" if plan.score_only else result.get("text", "")
    if plan.echo:
        text = result.get("prompt_text", prompt if isinstance(prompt, str) else "") + text
    return {"index": index, "text": text, "finish_reason": "length" if plan.score_only else finish_reason(result),
            "logprobs": completion_logprobs(result, plan, prompt) if plan.logprobs else None}


def chat_choice(index: int, result: dict, plan: Plan) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": result.get("text", "")},
            "finish_reason": finish_reason(result), "logprobs": chat_logprobs(result) if plan.logprobs else None}


def usage(results: list[tuple[int, int, dict]], plan: Plan) -> dict:
    """Prompt tokens counted once per prompt (not per choice), completion tokens over all choices."""
    prompt_tokens: dict[int, int] = {}
    completion = 0
    for _index, p, result in results:
        stats = result.get("stats", {})
        prompt_tokens[p] = stats.get("prompt_tokens", 0)
        completion += 0 if plan.score_only else stats.get("generated_tokens", len(result.get("tokens", [])))
    prompt = sum(prompt_tokens.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
