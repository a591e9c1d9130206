"""The types every call shares: GenerateConfig (what to do), GenerateStats and GenerateResult (what happened)."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from collections import Counter
from dataclasses import dataclass, field

import torch

from .env import env_number
from .errors import ConfigError, ModeError
from .fields import DEFAULT_MAX_TOKENS, GENERATE_FIELDS, LOGPROBS, PROMPT_LOGPROBS

OnToken = Callable[[int, int], bool]


@dataclass
class GenerateConfig:
    """Per-call settings. Defaults for loops, early exit and cache window come from the environment."""
    max_tokens: int = DEFAULT_MAX_TOKENS
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
    exit_rule: str | None = None  # what early exit compares (tinyloop/exits.py); None: the model's own rule
    # the fewest loops a token runs (`loops` is the most): under early exit, its rule's floor; at a fixed depth with
    # loops above it, a depth range the worker's load controller may use (elastic depth, docs/engine.md, "Elastic
    # depth"). None: no floor, fixed depth
    min_loops: int | None = None
    # elastic depth's quality floor: the depth range reaches down to the fewest loops whose expected loss (the
    # model's loss_vs_loops table) is at most this many nats/token above that of `loops`. None: no such floor
    max_loss_increase: float | None = None
    # lower is more important (vLLM's convention): waiting requests take lanes by it, and under load the least
    # important lanes with a depth range give up depth first (docs/engine.md, "Admission" and "Elastic depth")
    priority: int = 0
    # a forced exit pattern (benchmarks, research; in process only): generated token i stops after
    # exit_schedule[i % len] loops whatever the rule says (tinyloop/exits.py, "schedule")
    exit_schedule: Sequence = ()
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability (0: off)
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # subtracted once per time the output holds the token
    logit_bias: dict = field(default_factory=dict)  # token id -> added to its logit (-100 bans, 100 forces)
    ignore_eos: bool = False  # EOS is a token like any other: generate max_tokens
    min_tokens: int = 0  # EOS, stop_token_ids and stop sequences end nothing before this many tokens
    stop_token_ids: Sequence = ()  # tokens that end the output like EOS (not part of it)
    # each generated token's log-probability under the logits it was chosen from (the model's, before any sampling
    # adjustment), with the `logprobs` most likely tokens' beside it (GenerateResult.logprobs); None: none
    logprobs: int | None = None
    # each prompt token's log-probability under its prefill's own logits (the row before it; the first token has
    # none), with the `prompt_logprobs` most likely tokens' beside it (GenerateResult.prompt_logprobs); None: none.
    # A request that asks runs its whole prompt: it reuses no cached prefix (docs/engine.md, "Prompt log-probabilities")
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # A bad value fails where it is written, with the words the wire uses, not later inside generate.
        self.check_fields()

    def check_fields(self) -> None:
        """Every setting against its rule in tinyloop/fields.py (the wire's and the gateway's table); ConfigError
        names the first one broken. Run when built and again by validate (a field may be set after building)."""
        for name, check in GENERATE_FIELDS.items():
            if name == "grammar":  # in process it may be a GrammarPrefix too; tinyloop/grammar.py checks it
                continue
            error = check(getattr(self, name))
            if error:
                raise ConfigError(f"GenerateConfig.{name} {error}")
        for name, check in (("logprobs", LOGPROBS), ("prompt_logprobs", PROMPT_LOGPROBS)):
            error = check(getattr(self, name))
            if error:
                raise ConfigError(f"GenerateConfig.{name} {error}")

    def validate(self, model=None) -> "GenerateConfig":
        """check_fields, then the rules that need the model; ConfigError names the first one broken."""
        self.check_fields()
        if model is not None and model.cfg.dense:
            self.check_dense()
        if model is not None and self.loops is not None and self.loops > model.cfg.max_loops:
            # the table's words ("must be in [lo, hi], got x") with this model's own limit
            raise ConfigError(f"GenerateConfig.loops must be in [1, {model.cfg.max_loops}] (this model's max_loops), "
                              f"got {self.loops!r}")
        if model is not None:
            self.check_exit(model)
            vocab = model.cfg.vocab_size
            for name, tokens in (("logit_bias", [int(t) for t in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
                bad = [t for t in tokens if t >= vocab]
                if bad:
                    raise ConfigError(f"GenerateConfig.{name}: token id(s) {bad[:5]} outside the vocabulary 0..{vocab - 1}")
        return self

    def check_dense(self) -> None:
        """ModeError for a looped feature asked of a dense model (one pass of its layers per token)."""
        asked = [f"loops={self.loops}"] if self.loops not in (None, 1) else []
        asked += [f"early_exit_threshold={self.early_exit_threshold}"] if self.early_exit_threshold > 0 else []
        asked += [f"min_loops={self.min_loops}"] if (self.min_loops or 1) > 1 else []
        asked += [f"max_loss_increase={self.max_loss_increase}"] if self.max_loss_increase is not None else []
        asked += ["exit_schedule"] if any(n != 1 for n in self.exit_schedule) else []
        if asked:
            raise ModeError(f"{', '.join(asked)}: this is a dense model (its layers run once per token, loops 1), "
                            f"so it has no loops to add, exit early from or schedule")

    def check_exit(self, model) -> None:
        rule, loops = self.exit_rule or model.cfg.exit_rule, self.resolved_loops(model)
        if rule == "cdf" and model.net.exit_gate is None:
            raise ConfigError("GenerateConfig.exit_rule 'cdf' needs a model with an exit gate (Ouro's); this one has none")
        if self.exit_rule is not None and self.exit_rule != "latent" and self.early_exit_threshold <= 0:
            raise ConfigError(f"GenerateConfig.exit_rule {self.exit_rule!r} needs early_exit_threshold > 0 (Huginn's "
                              f"defaults: entropy 1e-3, kl 1e-3, argmax 5; Ouro's cdf: 0.5-0.9)")
        if rule == "argmax" and self.early_exit_threshold != int(self.early_exit_threshold):
            raise ConfigError(f"GenerateConfig.early_exit_threshold under exit_rule 'argmax' counts loops: a whole "
                              f"number, got {self.early_exit_threshold!r}")
        if any(not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= loops for n in self.exit_schedule):
            raise ConfigError(f"GenerateConfig.exit_schedule must hold loop counts in 1..{loops}, got "
                              f"{list(self.exit_schedule)[:8]!r}")
        if self.min_loops is not None and self.min_loops > loops:
            raise ConfigError(f"GenerateConfig.min_loops {self.min_loops} is more than the {loops} loops the request "
                              f"runs at most (loops)")
        if self.max_loss_increase is not None and not loss_table(model):
            raise ConfigError(f"GenerateConfig.max_loss_increase {self.max_loss_increase}: this model has no "
                              f"loss-by-loops table (loss_vs_loops in its artifact; `tinyloop inspect` prints it), so "
                              f"a quality floor cannot be read; give min_loops instead")
        if self.depth_range_asked(model):
            from .modes import check_depth_range

            check_depth_range(model, self)

    def exit(self, model):
        """This request's ExitRule (tinyloop/exits.py)."""
        from .exits import ExitRule

        return ExitRule(self.exit_rule or model.cfg.exit_rule, self.early_exit_threshold, self.min_loops or 1)

    def resolved_loops(self, model) -> int:
        return self.loops if self.loops is not None else model.cfg.default_loops

    # --- elastic depth (tinyloop/engine/elastic.py) ---------------------------------------------------------------
    def exits_early(self, model) -> bool:
        """Whether its tokens' depth is its exit rule's choice (then min_loops is that rule's floor)."""
        return model.net.adaptive(self.exit(model))

    def depth_range_asked(self, model) -> bool:
        """Whether the request asks for a depth range: max_loss_increase, or min_loops below its loops without early
        exit (under early exit min_loops is the rule's floor, as before)."""
        if self.max_loss_increase is not None:
            return True
        return self.min_loops is not None and self.min_loops < self.resolved_loops(model) \
            and not self.exits_early(model)

    def depth_floor(self, model) -> int | None:
        """The fewest loops the load controller may give its tokens (elastic depth), or None: fixed depth (no range
        asked, early exit, or a floor at its loops). With both floors, the higher one holds."""
        if not self.depth_range_asked(model) or self.exits_early(model):
            return None
        loops = self.resolved_loops(model)
        floor = self.min_loops or 1
        if self.max_loss_increase is not None:
            floor = max(floor, loss_floor(loss_table(model), loops, self.max_loss_increase))
        return floor if floor < loops else None


def loss_table(model) -> dict[int, float]:
    """The model's loss-by-loops table (held-out loss per token at each measured loop count; {} when it has none)."""
    info = getattr(model, "info", None)
    return dict(getattr(info, "loss_vs_loops", None) or {})


def loss_at(table: dict[int, float], loops: float) -> float:
    """Expected loss per token at `loops` from the table: linear between measured loop counts, the end values
    beyond them."""
    keys = sorted(table)
    if loops <= keys[0]:
        return table[keys[0]]
    if loops >= keys[-1]:
        return table[keys[-1]]
    hi = next(k for k in keys if k >= loops)
    lo = max(k for k in keys if k <= loops)
    if hi == lo:
        return table[lo]
    return table[lo] + (table[hi] - table[lo]) * (loops - lo) / (hi - lo)


def loss_floor(table: dict[int, float], loops: int, max_increase: float) -> int:
    """The fewest loops whose expected loss is at most max_increase above that of `loops` (loops itself at worst)."""
    top = loss_at(table, loops)
    return next((n for n in range(1, loops + 1) if loss_at(table, n) - top <= max_increase + 1e-12), loops)


def loss_increase(table: dict[int, float], asked: int, ran: list[int]) -> float:
    """Estimated rise of expected loss per token when tokens ran `ran` loops instead of `asked` (0 without a table)."""
    if not table or not ran:
        return 0.0
    top = loss_at(table, asked)
    return sum(k * max(0.0, loss_at(table, n) - top) for n, k in Counter(ran).items()) / len(ran)


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
    # the loops its tokens actually ran (elastic depth, early exit): fewest, how many ran below the asked loops, the
    # count at each depth ({loops: tokens}), and the estimated rise of loss per token (the model's loss_vs_loops)
    loops_min: int = 0
    tokens_below_loops: int = 0
    loops_histogram: dict = field(default_factory=dict)
    loss_increase: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def line(self) -> str:
        return (f"[{self.generated_tokens} tokens, stop={self.stop_reason}, prefill {self.prefill_ms:.1f} ms, "
                f"first token {self.first_token_ms:.1f} ms, decode {self.decode_ms:.1f} ms "
                f"({self.generated_tokens / max(self.decode_ms, 1e-9) * 1000:.1f} tok/s), loops {self.loops_mean:.2f}"
                + (f" (min {self.loops_min}, {self.tokens_below_loops} tokens below the asked loops, estimated loss "
                   f"+{self.loss_increase:.4f} nats/token)" if self.tokens_below_loops else "")
                + f", cache {self.cache_mode}]")


@dataclass
class GenerateResult:
    tokens: list[int]
    text: str
    stats: GenerateStats
    n_best: list | None = None  # beam search: decoding.Hypothesis list, best first
    loops_used: list[int] | None = None  # loops run by each forward that produced a token (early exit's choices)
    # with GenerateConfig.logprobs: per token its log-probability, and the most likely tokens as (id, log-probability),
    # best first
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # with GenerateConfig.prompt_logprobs: the same for every prompt token, from its prefill's logits; the first
    # token's is None (nothing predicts it) and its alternatives []
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


def make_generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
