"""OpenAI request bodies -> broker requests, and broker results -> OpenAI response bodies.

Pure functions with no I/O (the HTTP side is broker/gateway.py), so every rule is in one
place: which OpenAI fields are supported and how they map to TinyLoop's GenerateConfig,
which TinyLoop knobs ride along as extra body fields, and the error for anything else.
Every invalid field raises APIError(400) naming the field (OpenAI's `param`).

This module must not import torch (it runs in the gateway); its value checks are tinyloop/fields.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from tinyloop.fields import (DEFAULT_MAX_TOKENS, GENERATE_FIELDS, SPECULATIVE_FIELDS, Check, boolean, int_in, is_int,
                             list_of, number_in, plain_map, template_variables, text)

# Extra body fields: the looped-model knobs (docs/gateway.md). Each maps 1:1 to a wire field, checked there.
EXTRA_FIELDS = ("loops", "early_exit_threshold", "exit_rule", "min_loops", "max_loss_increase", "cache_window",
                *SPECULATIVE_FIELDS)
# the name looped-model servers (a vLLM fork for Ouro) give `loops` beside min_loops: the most loops a token runs
ALIASES = {"max_loops": "loops"}
# Sampler fields (OpenAI's penalties and logit_bias, vLLM's extra sampling parameters) that map 1:1 onto the wire's
# GenerateConfig fields, checked here with their rules from tinyloop/fields.py so a bad value is a 400 naming it.
SAMPLER_FIELDS = ("repetition_penalty", "min_p", "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos",
                  "min_tokens", "stop_token_ids")
# vLLM's extra fields that both endpoints take (docs/gateway.md says what each does here).
VLLM_FIELDS = {"top_k", "priority", *SAMPLER_FIELDS, "include_stop_str_in_output", "skip_special_tokens",
               "spaces_between_special_tokens", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern"}
GUIDED_FIELDS = {"json": "json_schema", "regex": "regex", "grammar": "ebnf", "choice": "regex"}  # vLLM -> grammar key
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
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers) if headers else {}

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
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    params: dict = field(default_factory=dict)  # common wire params (config, scoring, extras)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    echo_text: str = ""  # chat echo: the last (assistant) message, put before each choice's content
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
    unknown = sorted(set(body) - known - VLLM_FIELDS - set(EXTRA_FIELDS) - set(ALIASES) - set(IGNORED_FIELDS))
    if unknown:
        raise APIError(400, f"unrecognized request argument(s): {unknown} (see docs/gateway.md for the supported "
                            f"fields and TinyLoop's extra fields)", param=unknown[0], code="unrecognized_argument")


def _prompts(body: dict) -> list[Any]:
    """OpenAI's four prompt forms: a string, strings, token ids, lists of token ids."""
    p = body.get("prompt")
    if isinstance(p, str) and p:  # an empty prompt has nothing to continue from (the runtime refuses it too)
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) and x for x in p):
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


def _response_format(body: dict) -> dict | None:
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


def _choice_regex(param: str, choices: Any) -> str:
    """guided_choice: the output is exactly one of the strings (a regex of escaped alternatives)."""
    error = list_of(text(1024, 1), 256)(choices) or (None if choices else "must not be empty")
    if error:
        raise bad(param, error)
    return "|".join(re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", c) for c in choices)


def _guided_grammar(param: str, kind: str, value: Any) -> dict:
    if kind == "choice":
        return {"regex": _choice_regex(param, value)}
    if not isinstance(value, str) and not (kind == "json" and isinstance(value, dict)):
        raise bad(param, "must be a JSON schema (an object or a string)" if kind == "json" else "must be a string")
    return {GUIDED_FIELDS[kind]: value}


def _guided(body: dict) -> list[tuple[str, dict]]:
    """vLLM's structured-output spellings -> (field, the runtime's grammar): `guided_json` / `guided_regex` /
    `guided_choice` / `guided_grammar` (EBNF), or the same keys without the prefix inside `structured_outputs`."""
    must_be_neutral(body, "guided_whitespace_pattern", (None,))
    nested = get_checked(body, "structured_outputs", plain_map(16), {})
    unknown = sorted(k for k, v in nested.items() if k not in GUIDED_FIELDS and v not in (None, False))
    if unknown:
        raise APIError(400, f"'structured_outputs.{unknown[0]}' is not supported by this server (supported: "
                            f"{list(GUIDED_FIELDS)})", param=f"structured_outputs.{unknown[0]}",
                       code="unsupported_parameter")
    asked = [(f"guided_{k}", k, body.get(f"guided_{k}")) for k in GUIDED_FIELDS]
    asked += [(f"structured_outputs.{k}", k, nested.get(k)) for k in GUIDED_FIELDS]
    return [(param, _guided_grammar(param, kind, v)) for param, kind, v in asked if v is not None]


def _grammar(body: dict) -> dict | None:
    """The one grammar a request may ask for, in any of its spellings; two at once is a 400 naming the second."""
    asked = _guided(body)
    fmt = _response_format(body)
    if fmt is not None:
        asked.insert(0, ("response_format", fmt))
    if len(asked) > 1:
        raise bad(asked[1][0], f"asks for a second structured output besides '{asked[0][0]}'; give one")
    return asked[0][1] if asked else None


def _sampler(body: dict) -> dict:
    """vLLM's and OpenAI's further sampling fields -> wire fields, each checked by its GenerateConfig rule."""
    params = {name: get_checked(body, name, GENERATE_FIELDS[name]) for name in SAMPLER_FIELDS}
    top_k = body.get("top_k")
    if top_k is not None:  # vLLM's "off" is -1, TinyLoop's is 0
        params["top_k"] = get_checked({"top_k": 0 if top_k == -1 else top_k}, "top_k", GENERATE_FIELDS["top_k"])
    # Special tokens never reach the text here, so the spaces between them change nothing.
    get_bool(body, "spaces_between_special_tokens", True)
    must_be_neutral(body, "skip_special_tokens", (True, None))
    must_be_neutral(body, "include_stop_str_in_output", (False, None))
    return {k: v for k, v in params.items() if v is not None}


def _common(body: dict, kind: str) -> tuple[dict, dict]:
    """Fields shared by both endpoints -> (wire params, plan fields)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "must be a string")
    stream = get_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad("stream_options", "must be an object, and is only allowed with stream: true")
    include_usage = bool(options and get_bool(options, "include_usage"))
    # vLLM's: every chunk carries the usage so far (only together with include_usage, as in vLLM)
    continuous_usage = include_usage and options is not None and get_bool(options, "continuous_usage_stats")
    params: dict[str, Any] = {
        # OpenAI's defaults, not TinyLoop's: temperature 1 (sampling), top_p 1.
        "temperature": get_num(body, "temperature", 0.0, 2.0, 1.0),
        "top_p": get_num(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
    }
    params.update(_sampler(body))
    if body.get("priority") is not None:  # vLLM's: lower is handled first
        params["priority"] = get_checked(body, "priority", GENERATE_FIELDS["priority"])
    stops = _stop(body)
    if stops:
        params["stop_sequences"] = stops
    grammar = _grammar(body)
    if grammar is not None:
        params["grammar"] = grammar
    for name in EXTRA_FIELDS:  # wire-validated by the broker client (errors name the field)
        if body.get(name) is not None:
            params[name] = body[name]
    for alias, name in ALIASES.items():
        if body.get(alias) is not None:
            if params.get(name, body[alias]) != body[alias]:
                raise bad(alias, f"is another name for {name!r}; give one of them, or the same value")
            params[name] = body[alias]
    timeout = get_num(body, "timeout", 0.0, 24 * 3600.0, None, lo_open=True)
    plan = dict(kind=kind, model=model, n=get_int(body, "n", 1, MAX_N, 1), stream=stream, include_usage=include_usage,
                continuous_usage=continuous_usage, seed=get_int(body, "seed", 0, 2**63 - 1 - MAX_N), timeout=timeout,
                op="speculative" if any(body.get(k) is not None for k in SPECULATIVE_FIELDS) else "generate")
    return params, plan


COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
                     "logprobs", "echo", "stop", "seed", "frequency_penalty", "presence_penalty", "logit_bias",
                     "best_of", "suffix", "response_format", "timeout"}


def completion_plan(body: dict) -> Plan:
    _check_fields(body, COMPLETION_FIELDS)
    must_be_neutral(body, "suffix", (None, ""))
    params, plan = _common(body, "completion")
    best_of = get_int(body, "best_of", plan["n"], MAX_N)  # vLLM's rule: best_of >= n
    if best_of not in (None, plan["n"]):  # choosing n of best_of by log-probability is not implemented
        raise APIError(400, f"'best_of' greater than n is not supported by this server (got best_of {best_of}, "
                            f"n {plan['n']}); ask for n choices instead", param="best_of", code="unsupported_parameter")
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
               "logit_bias", "response_format", "tools", "tool_choice", "timeout", "echo", "add_generation_prompt",
               "continue_final_message", "chat_template_kwargs"}


def _template_options(body: dict) -> dict:
    """vLLM's chat-template fields -> the chat op's wire fields: add_generation_prompt and chat_template_kwargs (the
    template's own variables, e.g. Ouro's enable_thinking) travel to the worker; continue_final_message is not
    supported (only its no-op value is accepted)."""
    get_bool(body, "continue_final_message")
    must_be_neutral(body, "continue_final_message", (False, None))
    out: dict = {}
    if not get_bool(body, "add_generation_prompt", True):
        out["add_generation_prompt"] = False
    kwargs = get_checked(body, "chat_template_kwargs", template_variables(16), {})
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    return out


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
    template = _template_options(body)
    params, plan = _common(body, "chat")
    params.update(template)
    messages = _messages(body)
    # vLLM's chat echo: a last assistant message (the answer's start) is put before each choice's content.
    echo = get_bool(body, "echo")
    echo_text = messages[-1]["content"] if echo and messages[-1]["role"] == "assistant" else ""
    both = body.get("max_tokens"), body.get("max_completion_tokens")
    if None not in both and both[0] != both[1]:  # benchmarks send both, equal
        raise bad("max_completion_tokens", "and max_tokens are the same setting; give one, or both equal")
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
    return Plan(prompts=[messages], params=params, logprobs=logprobs, top_logprobs=top or 0, echo=bool(echo_text),
                echo_text=echo_text, **{**plan, "op": "chat"})


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
    for piece in tokens:
        offsets.append(offset)
        offset += len(piece)
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
    return {"index": index, "message": {"role": "assistant", "content": plan.echo_text + result.get("text", "")},
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
    out: dict = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    loops = usage_loops([result.get("stats", {}) for _i, _p, result in results])
    if loops is not None and not plan.score_only:
        out["loops"] = loops
    return out


def usage_loops(stats: list[dict]) -> dict | None:
    """The depth the choices' tokens ran (elastic depth, early exit: docs/gateway.md): mean and fewest loops, the
    tokens below their asked loops, a histogram {loops: tokens}, and the estimated loss increase per token (nats,
    from the model's loss-by-loops table); None when no result says."""
    hist: dict[str, int] = {}
    below, loss, tokens = 0, 0.0, 0
    for st in stats:
        h = st.get("loops_histogram") if isinstance(st, dict) else None
        if not isinstance(h, dict) or not h:
            continue
        n = sum(int(c) for c in h.values())
        for depth, count in h.items():
            hist[str(depth)] = hist.get(str(depth), 0) + int(count)
        below += int(st.get("tokens_below_loops") or 0)
        loss += float(st.get("loss_increase") or 0.0) * n
        tokens += n
    if not tokens:
        return None
    return {"mean": round(sum(int(d) * c for d, c in hist.items()) / tokens, 4), "min": min(int(d) for d in hist),
            "below_asked": below, "histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            "loss_increase": round(loss / tokens, 6)}


def running_usage(results: list[tuple[int, int, dict]], streamed: dict[int, int], plan: Plan) -> dict:
    """A stream's usage so far (stream_options.continuous_usage_stats): finished choices as `usage` counts them, plus
    the tokens streamed of the others. A prompt's tokens are counted once its first choice has finished, since only
    the worker's result says how many the prompt (or the rendered chat) has."""
    u = usage(results, plan)
    finished = {index for index, _p, _r in results}
    more = sum(count for index, count in streamed.items() if index not in finished)
    return {**u, "completion_tokens": u["completion_tokens"] + more, "total_tokens": u["total_tokens"] + more}
