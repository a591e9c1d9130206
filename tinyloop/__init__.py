"""TinyLoop: an inference runtime for looped (recurrent-depth) transformer language models."""
from .artifact import ArtifactInfo, read_artifact, save_artifact
from .batch import Scheduler, generate_batch
from .cache import CACHE_MODES, KVCache, bytes_per_token_slot
from .config import ModelConfig
from .decoding import Hypothesis, beam_search
from .errors import ArtifactError, BudgetError, BusyError, ConfigError, HandleError, ModeError, TinyLoopError
from .generate import GenerateConfig, GenerateResult, GenerateStats, generate, generate_stream
from .memory import MemoryPlan, plan_memory
from .modes import MATRIX, check_modes
from .runtime import Model, free_model, load_model
from .handles import Handle, free_handle
from .prefix import (PrefixCache, PrefixPool, PoolStats, create_prefix_cache, create_prefix_pool, generate_from_prefix_cache,
                     generate_with_pool, register_prefix)
from .resume import ResumeHandle, build_resume_handle, resume_generate
from .speculative import (SpeculativeChoice, SpeculativeConfig, SpeculativeStats, choose_speculative, generate_speculative,
                          speculative_from_env)

__all__ = [
    "Hypothesis", "beam_search", "generate_batch", "Scheduler",
    "ArtifactError", "ArtifactInfo", "BudgetError", "BusyError", "CACHE_MODES", "ConfigError", "GenerateConfig",
    "GenerateResult", "GenerateStats", "HandleError", "KVCache", "MATRIX", "MemoryPlan", "ModeError", "Model",
    "ModelConfig", "TinyLoopError", "bytes_per_token_slot", "check_modes", "free_model", "generate",
    "generate_stream", "load_model", "plan_memory", "read_artifact", "save_artifact",
    "Handle", "free_handle", "PrefixCache", "PrefixPool", "PoolStats", "create_prefix_cache", "create_prefix_pool",
    "generate_from_prefix_cache", "generate_with_pool", "register_prefix", "ResumeHandle", "build_resume_handle",
    "resume_generate",
    "SpeculativeChoice", "SpeculativeConfig", "SpeculativeStats", "choose_speculative", "generate_speculative",
    "speculative_from_env",
]
from .score import score  # noqa: E402 - per-position logits (docs/gateway.md: log-probabilities)
__all__.append("score")
