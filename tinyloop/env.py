"""Runtime modes from the environment (the original's env-flag surface). Explicit arguments override them.

TINYLOOP_CACHE_MODE     fp16 | int8 | int4       default cache mode of load_model
TINYLOOP_EARLY_EXIT     float >= 0               default GenerateConfig.early_exit_threshold (0 = off)
TINYLOOP_CACHE_WINDOW   int >= 0                 default GenerateConfig.cache_window (0 = full attention)
TINYLOOP_LOOPS          int >= 1                 default GenerateConfig.loops (unset = the model's default)
TINYLOOP_SPECULATIVE    draft:verify:ahead[:width]  default SpeculativeConfig of generate_speculative / choose_speculative
                                                  (read by tinyloop.speculative.speculative_from_env; e.g. 2:8:4)
"""
from __future__ import annotations

import os

from .errors import ConfigError

ENV_VARS = ("TINYLOOP_CACHE_MODE", "TINYLOOP_EARLY_EXIT", "TINYLOOP_CACHE_WINDOW", "TINYLOOP_LOOPS", "TINYLOOP_SPECULATIVE")


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
