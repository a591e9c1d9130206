"""ModelConfig: every architectural choice of a looped model, stored in the artifact."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import ConfigError
from .fields import is_int

INJECTIONS = ("none", "add", "adapter")
STATE_INITS = ("zeros", "embed", "normal")
EXIT_RULES = ("latent", "cdf")
EXIT_KV = ("copy", "compute")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 256
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 688
    n_prelude: int = 1
    n_core: int = 2
    n_coda: int = 1
    max_loops: int = 16
    default_loops: int = 8
    injection: str = "adapter"
    state_init: str = "zeros"
    init_sigma: float = 1.0
    init_seed: int = 0
    sandwich_norm: bool = False
    tie_embeddings: bool = True
    exit_gate: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    bos_id: int = 0
    eos_id: int = 0
    # What real checkpoints (Ouro, Huginn; tinyloop/hf.py) bring. The defaults are the family as it was before them.
    embed_scale: float = 1.0        # embeddings are multiplied by this (Huginn: sqrt(d_model))
    qk_bias: bool = False           # the query and key projections have biases (Huginn)
    sandwich_residual: bool = False  # sandwich norms normalise the residual sum (Huginn) instead of the branch output (Ouro)
    loop_norm: bool = False         # the final norm is applied to the state after every loop, and that feeds the next (Ouro)
    coda_norm: bool = False         # the final norm is also applied to s_L before the coda (Huginn uses it twice)
    final_norm: bool = True         # the final norm before the head (off when loop_norm already normalised s_L)
    init_trunc: float = 0.0         # "normal" state init truncated at +-init_trunc sigma (Huginn: 3); 0: untruncated
    exit_rule: str = "latent"       # latent: relative change < threshold or gate >= 0.5 | cdf: Ouro's cumulative exit prob >= threshold
    exit_kv: str = "copy"           # copy: skipped loops are not run, their K/V copied | compute: loops run on for K/V, logits from the exit loop

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def n_slots(self, loops: int | None = None) -> int:
        """KV slots for a given loop count: one per prelude/coda layer, one per core layer per loop."""
        loops = self.max_loops if loops is None else loops
        return self.n_prelude + self.n_core * loops + self.n_coda

    def core_slot(self, loop: int, layer: int) -> int:
        """Slot of core layer `layer` at loop `loop` (0-based). Coda slots follow all core slots."""
        return self.n_prelude + loop * self.n_core + layer

    def coda_slot(self, layer: int) -> int:
        return self.n_prelude + self.max_loops * self.n_core + layer

    def validate(self) -> "ModelConfig":
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"ModelConfig: {msg}")

        for name in ("vocab_size", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "n_core", "max_loops"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"{name} must be a positive integer, got {v!r}")
        for name in ("n_prelude", "n_coda"):
            v = getattr(self, name)
            need(isinstance(v, int) and v >= 0, f"{name} must be a non-negative integer, got {v!r}")
        need(self.d_model % self.n_heads == 0, f"d_model {self.d_model} not divisible by n_heads {self.n_heads}")
        need(self.n_heads % self.n_kv_heads == 0, f"n_heads {self.n_heads} not divisible by n_kv_heads {self.n_kv_heads}")
        need(self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even for RoPE")
        need(1 <= self.default_loops <= self.max_loops, f"default_loops {self.default_loops} outside 1..{self.max_loops}")
        need(self.injection in INJECTIONS, f"injection {self.injection!r} not one of {INJECTIONS}")
        need(self.state_init in STATE_INITS, f"state_init {self.state_init!r} not one of {STATE_INITS}")
        need(self.init_sigma >= 0, f"init_sigma must be >= 0, got {self.init_sigma}")
        need(self.init_trunc >= 0, f"init_trunc must be >= 0, got {self.init_trunc}")
        need(self.embed_scale > 0, f"embed_scale must be > 0, got {self.embed_scale}")
        need(self.exit_rule in EXIT_RULES, f"exit_rule {self.exit_rule!r} not one of {EXIT_RULES}")
        need(self.exit_kv in EXIT_KV, f"exit_kv {self.exit_kv!r} not one of {EXIT_KV}")
        need(self.exit_rule != "cdf" or self.exit_gate, "exit_rule 'cdf' needs exit_gate")
        need(0 <= self.bos_id < self.vocab_size and 0 <= self.eos_id < self.vocab_size, "bos_id/eos_id outside the vocabulary")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"ModelConfig: expected an object, got {type(d).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(f"ModelConfig: unknown field(s) {unknown}")
        for k, v in d.items():
            want = known[k].type
            ok = {"int": is_int(v), "float": is_int(v) or isinstance(v, float),
                  "bool": isinstance(v, bool), "str": isinstance(v, str)}[want]
            if not ok:
                raise ConfigError(f"ModelConfig: field {k} must be {want}, got {v!r}")
        return cls(**d).validate()
