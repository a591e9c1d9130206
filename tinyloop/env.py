"""Runtime modes from the environment (the original's env-flag surface). Explicit arguments override them.

TINYLOOP_CACHE_MODE     fp16 | int8 | int4       default cache mode of load_model
TINYLOOP_EARLY_EXIT     float >= 0               default GenerateConfig.early_exit_threshold (0 = off)
TINYLOOP_CACHE_WINDOW   int >= 0                 default GenerateConfig.cache_window (0 = full attention)
TINYLOOP_LOOPS          int >= 1                 default GenerateConfig.loops (unset = the model's default)
TINYLOOP_MEMORY_BUDGET  bytes (512MiB, 2GB, ...)  default load_model memory_budget: weights + KV block pool
TINYLOOP_PREFILL_CHUNK int >= 0                 prompt tokens per prefill forward (Model.prefill_chunk; 0 = a prompt
                                                  in one forward; default 256)
TINYLOOP_PREFIX_CACHE   on | off                 default load_model prefix_caching (automatic prefix caching)
TINYLOOP_WEIGHTS        fp32 | bf16 | int8 | int4[:group]  default load_model weights (the artifact's own format)
TINYLOOP_SPECULATIVE    draft:verify:ahead[:width]  default SpeculativeConfig of generate_speculative / choose_speculative
                                                  (read by tinyloop.speculative.speculative_from_env; e.g. 2:8:4)
TINYLOOP_DEPTH_STEPS    1 | 0                    1: decode rows at different depths advance by loop iterations
                                                  (continuous-depth batching, docs/engine.md); 0: by whole tokens
"""
from __future__ import annotations

import os
import re

from .errors import ConfigError

ENV_VARS = ("TINYLOOP_CACHE_MODE", "TINYLOOP_MEMORY_BUDGET", "TINYLOOP_EARLY_EXIT", "TINYLOOP_CACHE_WINDOW", "TINYLOOP_LOOPS", "TINYLOOP_SPECULATIVE",
            "TINYLOOP_PREFILL_CHUNK", "TINYLOOP_PREFIX_CACHE", "TINYLOOP_DEPTH_STEPS")


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if value not in choices:
        raise ConfigError(f"environment {name}={value!r} is not one of {choices}")
    return value


def env_number(name: str, kind, default, minimum):
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        number = kind(value)
    except ValueError:
        raise ConfigError(f"environment {name}={value!r} is not a valid {kind.__name__}") from None
    if number < minimum:
        raise ConfigError(f"environment {name}={value!r} must be >= {minimum}")
    return number


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """'512MiB' -> 536870912; '2GB' -> 2000000000; '1024' -> 1024. ValueError names the text."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: 512MiB, 2GB, 1073741824)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def env_bytes(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise ConfigError(f"environment {name}: {exc}") from None
