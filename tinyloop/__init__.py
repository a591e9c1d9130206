"""TinyLoop: an inference runtime for looped (recurrent-depth) transformer language models.

The public API is imported on first use (PEP 562), so that `import tinyloop.fields` (the request-field table the
broker and the gateway read) and the other torch-free facts (tinyloop.errors, tinyloop.env, tinyloop.modes) load
without torch. `tinyloop.generate`, `from tinyloop import load_model` and the rest work as usual.
"""
from __future__ import annotations

import importlib

# public name -> the module that defines it
_API = {
    "ArtifactInfo": "artifact", "read_artifact": "artifact", "save_artifact": "artifact",
    "Scheduler": "batch", "generate_batch": "batch",
    "CACHE_MODES": "cache", "KVCache": "cache", "bytes_per_token_slot": "cache",
    "ModelConfig": "config",
    "Hypothesis": "beam_decode", "beam_search": "beam_decode",
    "ArtifactError": "errors", "BudgetError": "errors", "BusyError": "errors", "ConfigError": "errors",
    "ForwardError": "errors", "HandleError": "errors", "ModeError": "errors", "TinyLoopError": "errors",
    "GenerateConfig": "request", "GenerateResult": "request", "GenerateStats": "request", "generate": "generation",
    "generate_stream": "generation",
    "MemoryPlan": "memory", "plan_memory": "memory",
    "MATRIX": "modes", "check_modes": "modes",
    "Model": "loader", "free_model": "loader", "load_model": "loader",
    "Handle": "handle_base", "free_handle": "handle_base",
    "PrefixCache": "prefix", "PrefixPool": "prefix", "PoolStats": "prefix", "create_prefix_cache": "prefix",
    "create_prefix_pool": "prefix", "generate_from_prefix_cache": "prefix", "generate_with_pool": "prefix",
    "register_prefix": "prefix",
    "ResumeHandle": "resume", "build_resume_handle": "resume", "resume_generate": "resume",
    "SpeculativeChoice": "speculative", "SpeculativeConfig": "speculative", "SpeculativeStats": "speculative",
    "choose_speculative": "speculative", "generate_speculative": "speculative", "speculative_from_env": "speculative",
    "score": "scoring",  # per-position logits (docs/gateway.md: log-probabilities)
}
__all__ = sorted(_API)


def __getattr__(name: str):
    module = _API.get(name)
    if module is None:  # a submodule, e.g. tinyloop.batch after `import tinyloop`
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module 'tinyloop' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
