"""The request fields, one table: every GenerateConfig and SpeculativeConfig setting with the rule its value obeys.

GenerateConfig.validate (in process), the wire protocol (broker/protocol.py) and the OpenAI gateway
(broker/openai_schema.py) all check values with these rules, so a value means the same and is refused with the
same words everywhere. Rules that need a model (loops <= its max_loops, tree_width <= its vocabulary) are the
runtime's own, checked on top.

A check takes a value and returns None when it is fine, else the rule it breaks ("must be in [1, 65536], got 0").
This module imports only the standard library: the broker, the client and the gateway read it without torch.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

Check = Callable[[Any], "str | None"]


def is_int(value: Any) -> bool:
    """An integer, not a bool (bool is an int subclass, and msgpack / JSON keep true apart from 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float (no bool, NaN or infinity)."""
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def int_in(lo: int, hi: int) -> Check:
    def check(value: Any) -> str | None:
        if not is_int(value):
            return f"must be an integer, got {type(value).__name__}"
        if not lo <= value <= hi:
            return f"must be in [{lo}, {hi}], got {value}"
        return None

    return check


def number_in(lo: float, hi: float, lo_open: bool = False) -> Check:
    def check(value: Any) -> str | None:
        if not is_number(value):
            got = repr(value) if isinstance(value, float) else type(value).__name__  # inf / nan say so
            return f"must be a finite number, got {got}"
        if value > hi or value < lo or (lo_open and value == lo):
            return f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}"
        return None

    return check


def unicode_error(value: str) -> str | None:
    """None when `value` is valid Unicode text, else where it is not. JSON and Python strings may hold a lone
    surrogate ("\\ud800"), which no UTF-8 encoder (msgpack, the tokenizer, an HTTP response) can write."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"must be valid Unicode text, got a lone surrogate {value[exc.start]!r} at character {exc.start}"
    return None


def text(max_len: int, min_len: int = 0) -> Check:
    def check(value: Any) -> str | None:
        if not isinstance(value, str):
            return f"must be a string, got {type(value).__name__}"
        if not min_len <= len(value) <= max_len:
            return f"length must be in [{min_len}, {max_len}], got {len(value)}"
        return unicode_error(value)

    return check


def boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"must be a boolean, got {type(value).__name__}"


def token_list(max_len: int, min_len: int = 0) -> Check:
    def check(value: Any) -> str | None:
        if not isinstance(value, (list, tuple)):
            return f"must be a list of token ids, got {type(value).__name__}"
        if not min_len <= len(value) <= max_len:
            return f"length must be in [{min_len}, {max_len}], got {len(value)}"
        if not all(is_int(item) and 0 <= item < 2**31 for item in value):
            return "must contain only token ids in [0, 2**31)"
        return None

    return check


def one_of(*checks: Check) -> Check:
    def check(value: Any) -> str | None:
        results = [c(value) for c in checks]
        errors = [e for e in results if e is not None]
        return None if len(errors) < len(results) else " or ".join(errors)

    return check


def choice(names: tuple[str, ...]) -> Check:
    def check(value: Any) -> str | None:
        return None if isinstance(value, str) and value in names else f"must be one of {list(names)}, got {value!r}"

    return check


def optional(check: Check) -> Check:
    return lambda value: None if value is None else check(value)


def plain_map(max_keys: int) -> Check:
    def check(value: Any) -> str | None:
        if not isinstance(value, dict):
            return f"must be a map, got {type(value).__name__}"
        if len(value) > max_keys:
            return f"must have at most {max_keys} keys"
        if not all(isinstance(k, str) for k in value):
            return "keys must be strings"
        return None

    return check


def token_bias(max_items: int, lo: float, hi: float) -> Check:
    """A map of token id -> additive logit bias (ids as integers, or as decimal strings, which is how JSON keys
    arrive), at most max_items entries, each bias a number in [lo, hi]."""
    bias = number_in(lo, hi)

    def check(value: Any) -> str | None:
        if not isinstance(value, dict):
            return f"must be a map of token id to bias, got {type(value).__name__}"
        if len(value) > max_items:
            return f"must have at most {max_items} entries"
        for key, b in value.items():
            if not (is_int(key) and 0 <= key < 2**31) and not (isinstance(key, str) and key.isdigit() and len(key) < 11):
                return f"keys must be token ids, got {key!r}"
            error = bias(b)
            if error:
                return f"bias of token {key}: {error}"
        return None

    return check


def list_of(item_check: Check, max_len: int) -> Check:
    def check(value: Any) -> str | None:
        if not isinstance(value, (list, tuple)):
            return f"must be a list, got {type(value).__name__}"
        if len(value) > max_len:
            return f"must have at most {max_len} items"
        for item in value:
            error = item_check(item)
            if error:
                return f"item {item!r}: {error}"
        return None

    return check


# The variables a chat template gets from the renderer itself (tinyloop/chat.py): a request's own template variables
# (chat_template_kwargs) may not name them.
CHAT_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception")


def template_variables(max_keys: int) -> Check:
    """A map of a chat template's own variables: string names, none of CHAT_TEMPLATE_VARIABLES."""
    as_map = plain_map(max_keys)

    def check(value: Any) -> str | None:
        error = as_map(value)
        if error:
            return error
        taken = [name for name in value if name in CHAT_TEMPLATE_VARIABLES]
        if taken:
            return (f"may not set {taken[0]!r}: the renderer sets {list(CHAT_TEMPLATE_VARIABLES)} itself "
                    f"(send messages and add_generation_prompt as request fields)")
        return None

    return check


# Early-exit rules a request may choose (tinyloop/exits.py says what each compares); None: the model's own
EXIT_RULES = ("latent", "cdf", "entropy", "kl", "argmax")
MAX_LOOPS = 4096  # the most loops any request may name; a model's own max_loops is usually far lower
DEFAULT_MAX_TOKENS = 64  # GenerateConfig.max_tokens when a request sets none (the gateway bounds work with it)

# GenerateConfig's settings. `grammar` is checked for its form here; what it says is checked where it is compiled
# (tinyloop/grammar.py), which in process also takes a GrammarPrefix (a stream continuation).
GENERATE_FIELDS: dict[str, Check] = {
    "max_tokens": int_in(1, 1 << 16),
    "loops": optional(int_in(1, MAX_LOOPS)),
    "temperature": number_in(0.0, 100.0),
    "top_k": int_in(0, 1 << 20),
    "top_p": number_in(0.0, 1.0, lo_open=True),
    "repetition_penalty": number_in(0.0, 100.0, lo_open=True),
    "seed": optional(int_in(0, 2**63 - 1)),
    "stop_sequences": list_of(one_of(text(1024, 1), token_list(256, 1)), 16),
    "grammar": optional(one_of(text(1 << 16), plain_map(256))),
    "beam_size": int_in(1, 64),
    "cache_window": int_in(0, 1 << 20),
    "early_exit_threshold": number_in(0.0, 1e6),
    "exit_rule": optional(choice(EXIT_RULES)),
    # the fewest loops a token runs: under early exit its rule's floor; otherwise, with `loops` above it, a depth
    # range the worker's load controller may use (elastic depth, docs/engine.md). None: no floor (fixed depth)
    "min_loops": optional(int_in(1, MAX_LOOPS)),
    # elastic depth's quality floor: the most the expected loss per token may rise (nats, the model's loss_vs_loops)
    "max_loss_increase": optional(number_in(0.0, 100.0)),
    # vLLM's request priority: lower is more important. A worker admits waiting requests by it, and its load
    # controller takes depth from the least important lanes first (docs/engine.md)
    "priority": int_in(-(2**31), 2**31 - 1),
    # the sampler's further controls (the ones vLLM's clients send, docs/gateway.md)
    "min_p": number_in(0.0, 1.0),
    "presence_penalty": number_in(-2.0, 2.0),
    "frequency_penalty": number_in(-2.0, 2.0),
    "logit_bias": token_bias(1024, -100.0, 100.0),
    "ignore_eos": boolean,
    "min_tokens": int_in(0, 1 << 16),
    "stop_token_ids": list_of(int_in(0, 2**31 - 1), 64),
}

# GenerateConfig.logprobs (in process; the wire asks with `logprobs` and `top_logprobs`, broker/protocol.py): None, or
# how many of the most likely tokens each generated token's log-probability comes with
MAX_TOP_LOGPROBS = 20
LOGPROBS = optional(int_in(0, MAX_TOP_LOGPROBS))
# GenerateConfig.prompt_logprobs (in process; the wire asks with `echo` and `logprobs`): None, or how many of the most
# likely tokens each prompt token's log-probability comes with (vLLM's name and meaning)
PROMPT_LOGPROBS = optional(int_in(0, MAX_TOP_LOGPROBS))

# SpeculativeConfig's settings (verify_loops None: the request's loops).
SPECULATIVE_FIELDS: dict[str, Check] = {
    "draft_loops": int_in(1, MAX_LOOPS),
    "verify_loops": optional(int_in(1, MAX_LOOPS)),
    "draft_ahead": int_in(1, 256),
    "tree_width": int_in(1, 1 << 20),
    "fallback": boolean,
}
