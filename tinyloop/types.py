"""The types every call shares: GenerateConfig (what to do), GenerateStats and GenerateResult (what happened)."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .env import env_number
from .errors import ConfigError

OnToken = Callable[[int, int], bool]


@dataclass
class GenerateConfig:
    """Per-call settings. Defaults for loops, early exit and cache window come from the environment."""
    max_tokens: int = 64
    loops: int | None = field(default_factory=lambda: env_number("TINYLOOP_LOOPS", int, None, 1))
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_sequences: Sequence = ()
    grammar: object = None
    beam_size: int = 1
    cache_window: int = field(default_factory=lambda: env_number("TINYLOOP_CACHE_WINDOW", int, 0, 0))
    early_exit_threshold: float = field(default_factory=lambda: env_number("TINYLOOP_EARLY_EXIT", float, 0.0, 0.0))

    def validate(self, model=None) -> "GenerateConfig":
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ConfigError(f"GenerateConfig.{name} {rule}, got {getattr(self, name)!r}")

        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
        is_num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
        need(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        max_loops = model.cfg.max_loops if model is not None else None
        need(self.loops is None or (is_int(self.loops) and self.loops >= 1 and (max_loops is None or self.loops <= max_loops)),
             "loops", f"must be an integer in 1..{max_loops or 'max_loops'}")
        need(is_num(self.temperature) and self.temperature >= 0, "temperature", "must be a number >= 0")
        need(is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an integer >= 0 (0 = off)")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be a number in (0, 1]")
        need(is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "must be a number > 0")
        need(self.seed is None or (is_int(self.seed) and self.seed >= 0), "seed", "must be None or an integer >= 0")
        need(is_int(self.beam_size) and self.beam_size >= 1, "beam_size", "must be an integer >= 1")
        need(is_int(self.cache_window) and self.cache_window >= 0, "cache_window", "must be an integer >= 0 (0 = off)")
        need(is_num(self.early_exit_threshold) and self.early_exit_threshold >= 0, "early_exit_threshold", "must be a number >= 0")
        seqs = self.stop_sequences
        need(isinstance(seqs, (list, tuple)), "stop_sequences", "must be a list of strings or token-id lists")
        for s in seqs:
            ok = (isinstance(s, str) and s != "") or (isinstance(s, (list, tuple)) and len(s) > 0 and all(is_int(t) for t in s))
            need(ok, "stop_sequences", "entries must be non-empty strings or non-empty lists of token ids")
        return self

    def resolved_loops(self, model) -> int:
        return self.loops if self.loops is not None else model.cfg.default_loops


@dataclass
class GenerateStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_ms: float = 0.0
    first_token_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    stop_reason: str = ""
    loops_mean: float = 0.0
    cache_mode: str = ""
    prefix_hit_tokens: int = 0
    skipped_loops: int = 0
    draft_reused_tokens: int = 0  # resume_generate: answer tokens taken from drafts (docs/cache-reuse.md)
    preempted: int = 0  # times the sequence gave its blocks back to the pool and was recomputed (docs/engine.md)
    draft_accept_rate: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def line(self) -> str:
        return (f"[{self.generated_tokens} tokens, stop={self.stop_reason}, prefill {self.prefill_ms:.1f} ms, "
                f"first token {self.first_token_ms:.1f} ms, decode {self.decode_ms:.1f} ms "
                f"({self.generated_tokens / max(self.decode_ms, 1e-9) * 1000:.1f} tok/s), loops {self.loops_mean:.2f}, "
                f"cache {self.cache_mode}]")


@dataclass
class GenerateResult:
    tokens: list[int]
    text: str
    stats: GenerateStats
    n_best: list | None = None  # beam search: decoding.Hypothesis list, best first
    loops_used: list[int] | None = None  # loops run by each forward that produced a token (early exit's choices)


def make_generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
