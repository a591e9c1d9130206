"""Single-request generation: GenerateConfig, GenerateStats, GenerateResult, generate, generate_stream."""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .cache import KVCache
from .env import env_number
from .errors import ConfigError
from .kernels.lean import decode_forward
from .modes import check_modes
from .runtime import Model
from .sampling import apply_repetition_penalty, sample_token
from .stops import StopMatcher

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

    def validate(self, model: Model | None = None) -> "GenerateConfig":
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

    def resolved_loops(self, model: Model) -> int:
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


def check_length(model: Model, prompt_len: int, cfg: GenerateConfig, what: str = "prompt") -> None:
    if prompt_len + cfg.max_tokens > model.max_seq_len:
        raise ConfigError(f"{what} length {prompt_len} + max_tokens {cfg.max_tokens} exceeds max_seq_len "
                          f"{model.max_seq_len} (GenerateConfig.max_tokens or load_model(max_seq_len=...))")


def make_generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)


class Decoder:
    """Runs the model over one lane: prefill a chunk, then one token at a time, with optional early exit."""

    def __init__(self, model: Model, loops: int, cache: KVCache, early_exit: float = 0.0):
        self.model, self.net, self.loops, self.cache, self.early_exit = model, model.net, loops, cache, early_exit
        self.loop_counts: list[int] = []

    def forward(self, ids: list[int], start: int) -> torch.Tensor:
        """Logits [T, V] for tokens at positions start.. (prefill and multi-token chunks run all loops)."""
        dev = self.model.device
        x = torch.tensor([ids], device=dev)
        step = self.net.make_step(torch.arange(start, start + len(ids), device=dev).unsqueeze(0), start + len(ids))
        if len(ids) == 1 and (self.early_exit > 0 or self.net.exit_gate is not None):
            logits, used = self.net.forward_adaptive(x, self.loops, step, self.cache, self.early_exit)
            self.loop_counts.append(int(used[0]))
            return logits[0]
        self.loop_counts.append(self.loops)  # every forward yields one sampled token
        return decode_forward(self.net, x, self.loops, step, self.cache)[0]  # lean when one token (kernels/lean.py)


def generate_stream(model: Model, prompt, cfg: GenerateConfig | None = None, on_token: OnToken | None = None) -> GenerateResult:
    """Generate from one prompt; on_token(token, index) gets each token as it is final, False cancels."""
    cfg = (cfg or GenerateConfig()).validate(model)
    check_modes("single", model.cache_mode, cfg)
    if cfg.beam_size > 1 or cfg.grammar is not None:
        from .decoding import generate_special  # beam search and grammar live beside plain decode
        return generate_special(model, prompt, cfg, on_token)
    with model.busy():
        ids = model.encode_prompt(prompt)
        check_length(model, len(ids), cfg)
        cache = model.decode_cache if cfg.cache_window == 0 else model.new_cache(1, model.max_seq_len, cfg.cache_window)
        cache.reset()
        decoder = Decoder(model, cfg.resolved_loops(model), cache, cfg.early_exit_threshold)
        return run_decode(model, decoder, ids, 0, cfg, on_token, GenerateStats())


@torch.inference_mode()
def run_decode(model: Model, decoder: Decoder, prompt_ids: list[int], cached: int, cfg: GenerateConfig,
               on_token: OnToken | None, stats: GenerateStats) -> GenerateResult:
    """Prefill prompt_ids[cached:] (the first `cached` tokens are already in the cache) and decode."""
    t0 = time.perf_counter()
    stats.prompt_tokens, stats.cache_mode = len(prompt_ids), model.cache_mode
    logits = decoder.forward(prompt_ids[cached:], cached)[-1]
    t_prefill = time.perf_counter()
    stats.prefill_ms = (t_prefill - t0) * 1000
    gen = make_generator(cfg.seed)
    seen = torch.tensor(prompt_ids, device=logits.device)
    matcher = StopMatcher(model.codec.decode, cfg.stop_sequences)
    emitted, stop_reason, pos = 0, "max_tokens", len(prompt_ids)

    def emit(tokens: list[int]) -> bool:
        nonlocal emitted
        for t in tokens:
            keep = on_token(t, emitted) if on_token is not None else True
            emitted += 1
            if keep is False:
                return False
        return True

    for i in range(cfg.max_tokens):
        logits = apply_repetition_penalty(logits, seen, cfg.repetition_penalty)
        token = sample_token(logits, cfg.temperature, cfg.top_k, cfg.top_p, gen)
        if i == 0:
            stats.first_token_ms = (time.perf_counter() - t0) * 1000
        if token == model.eos_id:
            stop_reason = "eos"
            break
        ready, stopped = matcher.push(token)
        if not emit(ready):
            stop_reason = "cancelled"
            break
        if stopped:
            stop_reason = "stop_sequence"
            break
        if i == cfg.max_tokens - 1:
            break
        if cfg.repetition_penalty != 1.0:
            seen = torch.cat((seen, torch.tensor([token], device=seen.device)))
        logits = decoder.forward([token], pos)[-1]
        pos += 1
    if stop_reason in ("eos", "max_tokens") and not emit(matcher.flush()):
        stop_reason = "cancelled"
    tokens, text = finish(model, matcher, emitted, stop_reason, stats, t0, t_prefill)
    counts = decoder.loop_counts
    stats.loops_mean = sum(counts) / len(counts) if counts else float(decoder.loops)
    return GenerateResult(tokens, text, stats)


def finish(model: Model, matcher: StopMatcher, emitted: int, stop_reason: str, stats: GenerateStats, t0: float,
           t_prefill: float) -> tuple[list[int], str]:
    """The tokens and text a finished decode returns (only what was streamed, if cancelled); fills in the
    stats' token count, stop reason and decode/total times."""
    t_end = time.perf_counter()
    tokens = matcher.tokens[:emitted] if stop_reason == "cancelled" else matcher.tokens
    text = model.codec.decode(tokens) if stop_reason != "stop_sequence" or not matcher.strings else matcher.text
    stats.generated_tokens = len(tokens)
    stats.decode_ms = (t_end - t_prefill) * 1000
    stats.total_ms = (t_end - t0) * 1000
    stats.stop_reason = stop_reason
    return tokens, text


def generate(model: Model, prompt, cfg: GenerateConfig | None = None) -> GenerateResult:
    return generate_stream(model, prompt, cfg, None)
